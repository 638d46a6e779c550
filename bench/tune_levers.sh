#!/usr/bin/env bash
# `fulcrum tune` over the seed command's throughput levers on one GPU, Qwen2.5-0.5B shape (random weights,
# responses run to 256 tokens: a fixed worst-case load), for BENCHMARKS.md and docs/levers.md.
#
#   bench/tune_levers.sh [LEVERS] [MAX_TRIALS]      # e.g. bench/tune_levers.sh micro 5
#
# LEVERS: comma-separated (micro, checkpointing, dynamic, max_num_seqs, max_num_batched_tokens,
# gpu_memory_utilization; default all). A trial trains 2 steps (the second is measured) and takes about
# 2-3 minutes on one H200 with the seed's sizes, so run one lever per call where a call is time-limited.
# Each call's table goes to $OUT/tune-<levers>.txt; trials' run directories stay under $OUT/tune-<levers>/.
set -euo pipefail
LEVERS=${1:-}
MAX_TRIALS=${2:-12}
OUT=${OUT:-.bench}
mkdir -p "$OUT"
[ -f "$OUT/data/train.parquet" ] || fulcrum data gsm8k --src ../shared/data/gsm8k --out "$OUT/data"
[ -f "$OUT/qwen05/config.json" ] || python bench/train_step.py make-model --out "$OUT/qwen05"
name=${LEVERS:-all}; name=${name//,/-}
args=(--steps 2 --max-trials "$MAX_TRIALS" --work-dir "$OUT/tune-$name")
[ -n "$LEVERS" ] && args+=(--levers "$LEVERS")
# The seed command of DESIGN §4 on one device (n_gpus_per_node=1, tensor_model_parallel_size=1).
fulcrum tune "${args[@]}" \
  data.train_files="$OUT/data/train.parquet" data.val_files="$OUT/data/test.parquet" data.train_batch_size=512 \
  data.max_prompt_length=512 data.max_response_length=256 actor_rollout_ref.model.path="$OUT/qwen05" \
  actor_rollout_ref.actor.optim.lr=1.5e-6 actor_rollout_ref.actor.ppo_mini_batch_size=128 \
  actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8 actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16 \
  actor_rollout_ref.rollout.tensor_model_parallel_size=1 actor_rollout_ref.rollout.gpu_memory_utilization=0.65 \
  actor_rollout_ref.rollout.max_num_seqs=1896 actor_rollout_ref.rollout.max_num_batched_tokens=16384 \
  actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=16 critic.optim.lr=1e-5 critic.model.path="$OUT/qwen05" \
  critic.ppo_micro_batch_size_per_gpu=8 critic.forward_micro_batch_size_per_gpu=8 algorithm.kl_ctrl.kl_coef=0.0005 \
  trainer.logger=[console] trainer.n_gpus_per_node=1 trainer.nnodes=1 \
  | tee "$OUT/tune-$name.txt"
