#!/usr/bin/env bash
# Scaling to two H200s (nvidia-h200-x2), in one call: the seed command's step on 1 GPU, on 2 GPUs with
# data-parallel rollout (two engines) and on 2 GPUs as written (one engine over both GPUs, TP=2);
# per-GPU perf/throughput and the phase breakdown of each (JSON summaries and logs under $OUT).
#   bash bench/multigpu.sh            # all three
#   bash bench/multigpu.sh tp2        # one of: 1gpu dp2 tp2
#   EXTRA="actor_rollout_ref.actor.use_torch_compile=False" TAG=nocompile bash bench/multigpu.sh tp2   # more overrides
#   (TAG names the variant's files: step_tp2_nocompile.json)
set -u
OUT=${OUT:-/tmp/multigpu}; mkdir -p "$OUT"
MODEL=${MODEL:-/tmp/q05}; DATA=${DATA:-runs/bench_data}
[ -d "$MODEL" ] || python bench/train_step.py make-model --out "$MODEL" >/dev/null 2>&1
[ -f "$DATA/train.parquet" ] || fulcrum data gsm8k --src ../shared/data/gsm8k --out "$DATA" >/dev/null 2>&1 \
  || python -m fulcrum.data.cli gsm8k --src ../shared/data/gsm8k --out "$DATA" >/dev/null
NATIVE="actor_rollout_ref.rollout.name=native trainer.test_freq=-1 trainer.save_freq=-1"
step() {  # name, overrides...
  local name=$1${TAG:+_$TAG}; shift
  python bench/train_step.py run --data "$DATA" --model "$MODEL" --run /tmp/run_$name --steps 3 \
      --summary "$OUT/step_$name.json" $NATIVE ${EXTRA:-} "$@" >"$OUT/log_$name.txt" 2>&1 \
   && python -c "import json,sys; s=json.load(open(sys.argv[1]))['mean_after_first']; \
print(sys.argv[2], {k: round(v, 3) for k, v in s.items() if k.startswith(('timing_s/', 'perf/'))})" \
     "$OUT/step_$name.json" "$name" || { echo "$name FAILED"; tail -30 "$OUT/log_$name.txt"; }
}
case ${1:-all} in
  1gpu) step 1gpu trainer.n_gpus_per_node=1 actor_rollout_ref.rollout.tensor_model_parallel_size=1 ;;
  dp2) step dp2 trainer.n_gpus_per_node=2 actor_rollout_ref.rollout.tensor_model_parallel_size=1 ;;
  tp2) step tp2 trainer.n_gpus_per_node=2 actor_rollout_ref.rollout.tensor_model_parallel_size=2 ;;
  all)
    step 1gpu trainer.n_gpus_per_node=1 actor_rollout_ref.rollout.tensor_model_parallel_size=1
    step dp2 trainer.n_gpus_per_node=2 actor_rollout_ref.rollout.tensor_model_parallel_size=1
    step tp2 trainer.n_gpus_per_node=2 actor_rollout_ref.rollout.tensor_model_parallel_size=2 ;;
esac
grep -h "world size" "$OUT"/log_*.txt | cut -c1-200
