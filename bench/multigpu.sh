#!/usr/bin/env bash
# Scaling to two H200s (nvidia-h200-x2), in one call: the seed command's step on 1 GPU, on 2 GPUs with
# data-parallel rollout (two engines) and on 2 GPUs as written (one engine over both GPUs, TP=2);
# per-GPU perf/throughput and the phase breakdown of each (JSON summaries and logs under $OUT).
#   bash bench/multigpu.sh            # all three
#   bash bench/multigpu.sh tp2        # one of: 1gpu dp2 tp2 fsdp2 tests resume
#   EXTRA="actor_rollout_ref.actor.use_torch_compile=False" TAG=nocompile bash bench/multigpu.sh tp2   # more overrides
#   (TAG names the variant's files: step_tp2_nocompile.json)
# fsdp2: tp2 with every model sharded by FSDP2 (verl's fsdp_size=2; the 0.5B is replicated by default).
# tests: the GPU tests that need two devices, each under a time limit (a hang shows as exit 124).
# resume: a small run on 2 GPUs (TP=2) saves steps 1 and 2; step 2 again from step 1's checkpoint on 2 GPUs
#   and on 1; the actor's weights after step 2 compared (largest difference, and whether bit-equal).
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
SHARDED="actor_rollout_ref.actor.fsdp_config.fsdp_size=2 actor_rollout_ref.ref.fsdp_config.fsdp_size=2
  critic.model.fsdp_config.fsdp_size=2"
TWO="trainer.n_gpus_per_node=2 actor_rollout_ref.rollout.tensor_model_parallel_size=2"
ONE="trainer.n_gpus_per_node=1 actor_rollout_ref.rollout.tensor_model_parallel_size=1"
resume() {  # run name, overrides...: 2 steps of a small batch, a save after each
  local name=$1; shift
  python bench/train_step.py run --data "$DATA" --model "$MODEL" --run "/tmp/resume/$name" --steps 2 $NATIVE \
    data.train_batch_size=64 data.max_response_length=128 actor_rollout_ref.actor.ppo_mini_batch_size=32 \
    critic.ppo_mini_batch_size=32 trainer.save_freq=1 ${EXTRA:-} "$@" >"$OUT/log_resume_$name.txt" 2>&1 \
    || { echo "resume $name FAILED"; tail -30 "$OUT/log_resume_$name.txt"; }
}
case ${1:-all} in
  fsdp2) step tp2_fsdp2 $TWO $SHARDED ;;
  tests)
    for file in tests/test_parallel_fsdp.py tests/test_rollout_tensor_parallel.py; do
      timeout 600 python -m pytest -q -m gpu -p no:cacheprovider "$file" 2>&1 | tail -3; echo "$file exit ${PIPESTATUS[0]}"
    done ;;
  resume)
    rm -rf /tmp/resume
    resume two $TWO
    from="trainer.resume_mode=resume_path trainer.resume_from_path=/tmp/resume/two/global_step_1"
    resume again_two $TWO $from
    resume again_one $ONE $from
    python - <<'PY'
import torch
from safetensors.torch import load_file
want = load_file("/tmp/resume/two/global_step_2/actor/model.safetensors")
for run in ("again_two", "again_one"):
    got = load_file(f"/tmp/resume/{run}/global_step_2/actor/model.safetensors")
    diff = max((got[k].float() - w.float()).abs().max().item() for k, w in want.items())
    equal = all(torch.equal(got[k], w) for k, w in want.items())
    print(f"resume {run}: step 2's actor weights, largest difference {diff:.3g}, bit-equal {equal}")
PY
    ;;
  1gpu) step 1gpu trainer.n_gpus_per_node=1 actor_rollout_ref.rollout.tensor_model_parallel_size=1 ;;
  dp2) step dp2 trainer.n_gpus_per_node=2 actor_rollout_ref.rollout.tensor_model_parallel_size=1 ;;
  tp2) step tp2 trainer.n_gpus_per_node=2 actor_rollout_ref.rollout.tensor_model_parallel_size=2 ;;
  all)
    step 1gpu trainer.n_gpus_per_node=1 actor_rollout_ref.rollout.tensor_model_parallel_size=1
    step dp2 trainer.n_gpus_per_node=2 actor_rollout_ref.rollout.tensor_model_parallel_size=1
    step tp2 trainer.n_gpus_per_node=2 actor_rollout_ref.rollout.tensor_model_parallel_size=2 ;;
esac
grep -h "world size" "$OUT"/log_*.txt | cut -c1-200
