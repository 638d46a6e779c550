#!/usr/bin/env bash
# Two trees of fulcrum, the same GPU figures, one call: the native rollout engine, the seed PPO step and the
# GRPO step of the 0.5B shape, each measured with each tree's own bench scripts, the trees alternating part by
# part (old, new, old, new, ...) so that a host that drifts during the call moves both alike; then one table of
# new / old ratios. It answers "did this change move the figures of bench/run_all.sh?" in under 9.5 minutes,
# where two whole run_all.sh runs would take 19.
#
#   git archive 42c7781 | tar x -C /tmp/old                # the tree to compare against (the device has no .git)
#   bash bench/tools/compare_trees.sh /tmp/old                    # new = this tree; work files in $WORK (/tmp/compare)
#   RESULTS=$OUT bash bench/tools/compare_trees.sh /tmp/old       # copies the table and the JSON there
#   SMOKE=1 bash bench/tools/compare_trees.sh /tmp/old            # the same on the CPU with a tiny model (~3 min)
#   PARTS=grpo ROUNDS=2 bash bench/tools/compare_trees.sh /tmp/old   # only the GRPO step, old/new/old/new
#
# A step figure moves by up to 10 % between two runs of the same tree (the host's speed drifts; the GRPO
# step measured 56.8k-62.5k tok/s for one tree in one call, 2026-12-02): ROUNDS=N runs each step part N
# times, the trees alternating, and the table takes the median over the warm steps of all rounds.
#
# Inputs (made when missing): $DATA (GSM8K in verl's parquet) and $MODEL (the random Qwen2.5-0.5B shape, made by
# the new tree's bench/train_step.py make-model), shared by both trees. Each part runs under its own limit.
set -u
NEW=$(cd "$(dirname "$0")/../.." && pwd)
OLD=$(cd "${1:?usage: compare_trees.sh OLD_TREE_DIR}" && pwd)
WORK=${WORK:-/tmp/compare}; mkdir -p "$WORK"
RESULTS=${RESULTS:-}
SMOKE=${SMOKE:-0}
ROUNDS=${ROUNDS:-1}
PARTS=${PARTS:-rollout,seed,grpo}
wants() { [[ ",$PARTS," == *",$1,"* ]]; }
DATA=$(realpath -m "${DATA:-$NEW/.bench/gsm8k}")
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
started=$(date +%s)
elapsed() { echo "[$(( $(date +%s) - started )) s] $*"; }

# run TREE NAME SECONDS COMMAND...: COMMAND from TREE's root with TREE's fulcrum first on the path.
run() {
  local tree=$1 name=$2 limit=$3; shift 3
  elapsed "$name"
  (cd "$tree" && PYTHONPATH=$tree${PYTHONPATH:+:$PYTHONPATH} timeout --signal=TERM --kill-after=10 "$limit" "$@") \
    >"$WORK/$name.log" 2>&1 || { elapsed "$name FAILED or stopped (exit $?)"; tail -5 "$WORK/$name.log"; }
}

if [ ! -f "$DATA/train.parquet" ]; then
  (cd "$NEW" && PYTHONPATH=$NEW${PYTHONPATH:+:$PYTHONPATH} $PY -m fulcrum.cli data gsm8k --src ../shared/data/gsm8k --out "$DATA") \
    || { echo "no GSM8K data in $DATA"; exit 1; }
fi
if [ "$SMOKE" = 1 ]; then
  MODEL=$(realpath -m "${MODEL:-$WORK/tiny_model}")
  [ -f "$MODEL/config.json" ] || (cd "$NEW" && PYTHONPATH=$NEW${PYTHONPATH:+:$PYTHONPATH} $PY -m fulcrum.cli tiny-model --out "$MODEL" >/dev/null) \
    || { echo "could not make the model in $MODEL"; exit 1; }
  . "$(dirname "$0")/../smoke_args.sh"
  ROLLOUT_ARGS=$SMOKE_ROLLOUT_ARGS
  STEP_ARGS=$SMOKE_STEP_ARGS
  GRPO_ARGS="algorithm.adv_estimator=grpo actor_rollout_ref.rollout.n=2"
  ENGINE=hf
else
  MODEL=$(realpath -m "${MODEL:-$NEW/.bench/qwen05}")
  [ -f "$MODEL/config.json" ] || (cd "$NEW" && PYTHONPATH=$NEW${PYTHONPATH:+:$PYTHONPATH} $PY bench/train_step.py make-model --out "$MODEL" >/dev/null) \
    || { echo "could not make the model in $MODEL"; exit 1; }
  ROLLOUT_ARGS=""
  STEP_ARGS=""
  # vs_trl.py's fulcrum side: 64 prompts x 8, one mini-batch, micro-batches of 32, no KL term
  GRPO_ARGS="algorithm.adv_estimator=grpo data.train_batch_size=64 actor_rollout_ref.rollout.n=8
    actor_rollout_ref.actor.ppo_mini_batch_size=64 actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=32
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=32 actor_rollout_ref.actor.use_kl_loss=False
    algorithm.use_kl_in_reward=False"
  ENGINE=native
fi
COMMON="actor_rollout_ref.rollout.name=$ENGINE trainer.test_freq=-1 trainer.save_freq=-1 trainer.resume_mode=disable"
elapsed "model $MODEL, data $DATA; old $OLD, new $NEW"
rm -rf "$WORK"/*.json "$WORK"/run_*

# Limits (H200): the engine alone ~40 s without HF; a step part ~60-100 s with loading and compiling on a
# machine that compiled before, more on a fresh one: the first GRPO part of a fresh machine's call did not
# finish 5 steps in 130 s (2026-12-03), hence 200 s for each step part.
tree_dir() { if [ "$1" = new ]; then echo "$NEW"; else echo "$OLD"; fi; }
if wants rollout; then
  for tree in old new; do
    # shellcheck disable=SC2086  # the *_ARGS are word lists
    run "$(tree_dir $tree)" "rollout_$tree" 100 $PY bench/rollout.py --skip-hf $ROLLOUT_ARGS --json "$WORK/rollout_$tree.json"
  done
fi
for round in $(seq 1 "$ROUNDS"); do
  suffix=""; [ "$ROUNDS" -gt 1 ] && suffix="_r$round"
  for tree in old new; do
    if wants seed; then
      # shellcheck disable=SC2086
      run "$(tree_dir $tree)" "seed_$tree$suffix" 200 $PY bench/train_step.py run --data "$DATA" --model "$MODEL" \
        --run "$WORK/run_seed_$tree$suffix" --steps 3 --summary "$WORK/seed_$tree$suffix.json" $COMMON $STEP_ARGS
    fi
  done
  for tree in old new; do
    if wants grpo; then
      # shellcheck disable=SC2086
      run "$(tree_dir $tree)" "grpo_$tree$suffix" 200 $PY bench/train_step.py run --data "$DATA" --model "$MODEL" \
        --run "$WORK/run_grpo_$tree$suffix" --steps 5 --summary "$WORK/grpo_$tree$suffix.json" $COMMON $GRPO_ARGS $STEP_ARGS
    fi
  done
done

$PY "$NEW/bench/tools/compare_table.py" "$WORK" | tee "$WORK/compare.md"
if [ -n "$RESULTS" ]; then
  mkdir -p "$RESULTS"
  cp "$WORK/compare.md" "$RESULTS/"
  (cd "$WORK" && tar czf "$RESULTS/compare_logs.tar.gz" ./*.json ./*.log 2>/dev/null)
fi
elapsed "done"
