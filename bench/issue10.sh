#!/usr/bin/env bash
# The packed training passes against the tree before them, on one H200 in one call: per-pass benches
# and the seed / GRPO train steps, before (the tree in $BASE, e.g. `git archive 5083253 | tar -x -C runs/base`) and after.
#   bash bench/issue10.sh after|before|final|grpo-ab|extra   (logs and JSON summaries under $OUT)
set -u
OUT=${OUT:-/tmp/issue10}; mkdir -p "$OUT"
MODEL=${MODEL:-/tmp/q05}; DATA=${DATA:-runs/bench_data}; BASE=${BASE:-runs/base}
[ -d "$MODEL" ] || python bench/train_step.py make-model --out "$MODEL" >/dev/null 2>&1
NATIVE="actor_rollout_ref.rollout.name=native trainer.test_freq=-1 trainer.save_freq=-1"
GRPO="algorithm.adv_estimator=grpo data.train_batch_size=64 actor_rollout_ref.rollout.n=8 \
actor_rollout_ref.actor.ppo_mini_batch_size=64 actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=32 \
actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=32 actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=32"
MICRO32="actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=32 actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=32 \
critic.ppo_micro_batch_size_per_gpu=32 critic.forward_micro_batch_size_per_gpu=32"
step() {  # name, tree, overrides...
  local name=$1 tree=$2; shift 2
  (PYTHONPATH=$tree:${PYTHONPATH:-} python $tree/bench/train_step.py run --data "$DATA" --model "$MODEL" \
     --run /tmp/run_$name --steps 2 --summary "$OUT/step_$name.json" $NATIVE "$@" >"$OUT/log_$name.txt" 2>&1 \
   && python -c "import json,sys; s=json.load(open(sys.argv[1]))['steps'][-1]; \
print(sys.argv[2], {k: round(v, 3) for k, v in s.items() if k.startswith(('timing_s/', 'perf/'))})" \
     "$OUT/step_$name.json" "$name") || { echo "$name FAILED"; tail -20 "$OUT/log_$name.txt"; }
}
passes() {  # label, tree, extra args...
  local label=$1 tree=$2; shift 2
  PYTHONPATH=$tree:${PYTHONPATH:-} python bench/passes.py --model "$MODEL" --label "$label" \
    --json "$OUT/passes_$label.json" "$@" 2>&1 | grep -v -i -E "warn|Loading weights"
}
case ${1:-after} in
  after)
    step seed_after . ; step grpo_after . $GRPO
    passes seed_after . --repeat 2 --profile "$OUT/prof_seed_after.txt"
    passes grpo_after . --repeat 2 --mini 512 $MICRO32 ;;
  before)
    passes seed_before "$BASE" --repeat 1
    step grpo_before "$BASE" $GRPO ; step seed_before "$BASE" ;;
  final)  # this tree: the two steps, and the seed without the actor's gradient checkpointing
    step seed_final . ; step grpo_final . $GRPO
    step seed_nockpt_final . actor_rollout_ref.model.enable_gradient_checkpointing=False ;;
  grpo-ab)  # the GRPO step on $BASE and on this tree, in one call
    step grpo_base "$BASE" $GRPO ; step grpo_this . $GRPO ;;
  extra)
    step seed_micro32_after . $MICRO32
    step seed_dynamic_after . actor_rollout_ref.actor.use_dynamic_bsz=True actor_rollout_ref.actor.ppo_max_token_len_per_gpu=16384 ;;
esac
