#!/usr/bin/env bash
# `fulcrum tune` over the seed command's throughput levers on one GPU, Qwen2.5-0.5B shape (random weights,
# responses run to 256 tokens: a fixed worst-case load), for BENCHMARKS.md and docs/levers.md.
#
#   bench/tools/tune_levers.sh [LEVERS] [MAX_TRIALS] [KEY=VALUE ...]   # e.g. bench/tools/tune_levers.sh micro 5
#
# LEVERS: comma-separated (micro, checkpointing, dynamic, max_num_seqs, max_num_batched_tokens,
# gpu_memory_utilization; default all). A trial trains $STEPS steps (default 2: the second is measured).
# At the seed's sizes a trial takes about 2-3 minutes on one H200; for a short call, shrink the batch and
# bound the search (the table and the best overrides found by then are still printed):
#
#   PROMPTS=128 MINI=32 BUDGET=210 bench/tools/tune_levers.sh micro,checkpointing,dynamic 8
#
# PROMPTS (data.train_batch_size, default 512) and MINI (ppo_mini_batch_size, default 128) keep the
# seed's 4 mini-batches a step and its micro-batch of 8 (the micro lever then tries 16 and 32);
# BUDGET is `fulcrum tune --time-budget` in seconds. Inputs: $DATA (GSM8K parquet, made from
# ../shared/data/gsm8k when missing) and $MODEL (made by bench/train_step.py make-model when missing).
# The output goes to $OUT/tune-<levers>.txt (also printed at the end), each trial's run directory and
# trials.json (phase times, per-phase peaks) to $OUT/tune-<levers>/.
set -uo pipefail
# On SIGTERM (an outer `timeout`) bash runs this after `fulcrum tune` has printed its table, then goes on.
trap 'echo "tune_levers.sh: SIGTERM; the tune printed what finished" >&2' TERM
LEVERS=${1:-}
MAX_TRIALS=${2:-12}
shift $(($# < 2 ? $# : 2))  # the rest: overrides after the seed command's (a CPU check: trainer.device=cpu ...)
OUT=${OUT:-.bench}
DATA=${DATA:-$OUT/data}
MODEL=${MODEL:-$OUT/qwen05}
PROMPTS=${PROMPTS:-512}
MINI=${MINI:-128}
STEPS=${STEPS:-2}
mkdir -p "$OUT"
[ -f "$DATA/train.parquet" ] || python -m fulcrum.cli data gsm8k --src ../shared/data/gsm8k --out "$DATA" || exit 1
[ -f "$MODEL/config.json" ] || python bench/train_step.py make-model --out "$MODEL" >/dev/null || exit 1
name=${LEVERS:-all}; name=${name//,/-}
args=(--steps "$STEPS" --max-trials "$MAX_TRIALS" --work-dir "$OUT/tune-$name")
[ -n "$LEVERS" ] && args+=(--levers "$LEVERS")
[ -n "${BUDGET:-}" ] && args+=(--time-budget "$BUDGET")
# The seed command of docs/configuration.md on one device (n_gpus_per_node=1, tensor_model_parallel_size=1).
# Written to a file, not through tee: a SIGTERM to this group must not kill the reader of the last table.
python -m fulcrum.cli tune "${args[@]}" \
  data.train_files="$DATA/train.parquet" data.val_files="$DATA/test.parquet" data.train_batch_size="$PROMPTS" \
  data.max_prompt_length=512 data.max_response_length=256 actor_rollout_ref.model.path="$MODEL" \
  actor_rollout_ref.actor.optim.lr=1.5e-6 actor_rollout_ref.actor.ppo_mini_batch_size="$MINI" \
  actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8 actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16 \
  actor_rollout_ref.rollout.tensor_model_parallel_size=1 actor_rollout_ref.rollout.gpu_memory_utilization=0.65 \
  actor_rollout_ref.rollout.max_num_seqs=1896 actor_rollout_ref.rollout.max_num_batched_tokens=16384 \
  actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=16 critic.optim.lr=1e-5 critic.model.path="$MODEL" \
  critic.ppo_micro_batch_size_per_gpu=8 critic.forward_micro_batch_size_per_gpu=8 algorithm.kl_ctrl.kl_coef=0.0005 \
  trainer.logger=[console] trainer.n_gpus_per_node=1 trainer.nnodes=1 "$@" >"$OUT/tune-$name.txt" 2>&1
code=$?
grep -v -i -E "warn|Loading weights" "$OUT/tune-$name.txt"
exit $code
