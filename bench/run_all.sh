#!/usr/bin/env bash
# Every GPU figure of BENCHMARKS.md's throughput sections in one run (one H200, < 10 min), then one table:
# the rollout engine (bench/rollout.py), each training pass alone (bench/passes.py, when present),
# the seed PPO step (bench/train_step.py), the GRPO step and TRL's GRPOTrainer beside it (bench/vs_trl.py).
#
#   bash bench/run_all.sh                 # from the repository root; results under $OUT (default /tmp/run_all)
#   SMOKE=1 bash bench/run_all.sh         # the same scripts, tiny shapes, on the CPU (~3 min)
#
# Inputs (made when missing): $DATA, GSM8K in verl's parquet (`fulcrum data gsm8k --src ../shared/data/gsm8k
# --out .bench/gsm8k`; the device machine has no ../shared: make it here and carry .bench); $MODEL, the random
# Qwen2.5-0.5B-shaped model (bench/train_step.py make-model). Missing Python packages (omegaconf, trl,
# datasets) are installed from the wheel folders .whl and .whl-trl when they are there (carry them).
# The learning benchmark (bench/learning.py, ~15 min) is not part of this run: see BENCHMARKS.md.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/run_all}; mkdir -p "$OUT"
SMOKE=${SMOKE:-0}
DATA=${DATA:-.bench/gsm8k}
PY=${PYTHON:-python3}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
started=$(date +%s)
elapsed() { echo "[$(( $(date +%s) - started )) s] $*"; }

for wheels in .whl .whl-trl; do  # the device image lacks omegaconf, trl and datasets
  if [ -d "$wheels" ] && ! $PY -c "import omegaconf, trl, datasets" 2>/dev/null; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site_run_all "$wheels"/*.whl \
      && export PYTHONPATH=$PYTHONPATH:/tmp/site_run_all
  fi
done
if [ ! -f "$DATA/train.parquet" ]; then
  $PY -m fulcrum.cli data gsm8k --src ../shared/data/gsm8k --out "$DATA" || { echo "no GSM8K data in $DATA"; exit 1; }
fi

if [ "$SMOKE" = 1 ]; then
  MODEL=${MODEL:-$OUT/tiny_model}
  [ -f "$MODEL/config.json" ] || $PY -m fulcrum.cli tiny-model --out "$MODEL" >/dev/null
  ROLLOUT_ARGS="--small --device cpu --prompts 8 --new-tokens 8 --grpo-prompts 2 --grpo-n 2 --skip-hf --repeats 1"
  STEP_ARGS="data.train_batch_size=4 actor_rollout_ref.actor.ppo_mini_batch_size=4 data.max_response_length=8
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2 critic.ppo_micro_batch_size_per_gpu=2
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4 actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4
    critic.forward_micro_batch_size_per_gpu=4 trainer.device=cpu"
  TRL_ARGS="--smoke"
else
  MODEL=${MODEL:-.bench/qwen05}
  [ -f "$MODEL/config.json" ] || $PY bench/train_step.py make-model --out "$MODEL" >/dev/null
  ROLLOUT_ARGS=""
  STEP_ARGS=""
  TRL_ARGS=""
fi
elapsed "inputs ready: model $MODEL, data $DATA"

# shellcheck disable=SC2086  # the *_ARGS are word lists
$PY bench/rollout.py $ROLLOUT_ARGS --json "$OUT/rollout.json" >"$OUT/rollout.log" 2>&1 \
  || { echo "rollout FAILED"; tail -20 "$OUT/rollout.log"; }
elapsed "rollout"
if [ -f bench/passes.py ] && [ "$SMOKE" != 1 ]; then  # GPU only: it times CUDA passes
  $PY bench/passes.py --model "$MODEL" --repeat 2 --json "$OUT/passes.json" >"$OUT/passes.log" 2>&1 \
    || { echo "passes FAILED"; tail -20 "$OUT/passes.log"; }
  elapsed "passes"
fi
# The seed command on one device, native rollout, 2 steps (the second is the warm one), no validation/save.
# shellcheck disable=SC2086
$PY bench/train_step.py run --data "$DATA" --model "$MODEL" --run "$OUT/seed_run" --steps 2 --summary "$OUT/seed.json" \
  actor_rollout_ref.rollout.name=native trainer.test_freq=-1 trainer.save_freq=-1 trainer.resume_mode=disable \
  $STEP_ARGS >"$OUT/seed.log" 2>&1 || { echo "seed step FAILED"; tail -20 "$OUT/seed.log"; }
elapsed "seed step"
# GRPO step (64 prompts x 8, micro 32, gradient checkpointing) as fulcrum's side of the TRL comparison.
# shellcheck disable=SC2086
$PY bench/vs_trl.py --model "$MODEL" --data "$DATA" --out "$OUT/vs_trl" $TRL_ARGS >"$OUT/vs_trl.log" 2>&1 \
  || { echo "vs_trl FAILED"; tail -20 "$OUT/vs_trl.log"; }
elapsed "GRPO step and TRL"

$PY - "$OUT" <<'EOF'
import json, sys
from pathlib import Path

out = Path(sys.argv[1])
def load(name):
    path = out / name
    return json.loads(path.read_text()) if path.exists() else None

rows = []
r = load("rollout.json")
if r:
    rows.append(("rollout: native engine, generated tok/s", f"{r.get('native_tok_per_s', 0):,}"))
    if "hf_tok_per_s" in r:
        rows.append(("rollout: HF static-cache generate, tok/s (native / HF)", f"{r['hf_tok_per_s']:,} ({r.get('speedup_vs_hf')}x)"))
p = load("passes.json")
for name, row in ((p or {}).get("passes") or {}).items():
    mfu = f", MFU {row['mfu']:.1%}" if "mfu" in row else ""
    rows.append((f"pass {name} (seed sizes): s, tok/s", f"{row['seconds']:.2f} s, {row['tokens_per_s']:,.0f}{mfu}"))
s = load("seed.json")
if s and s["steps"]:
    last = s["steps"][-1]
    rows.append(("seed PPO step (warm): s, tok/s/GPU, MFU actor",
                 f"{last.get('timing_s/step', 0):.1f} s, {last.get('perf/throughput', 0):,.0f}, {last.get('perf/mfu/actor', 0):.1%}"))
v = load("vs_trl/vs_trl.json")
if v:
    f, t = v["fulcrum"], v["trl"]
    rows.append(("GRPO step 64x8 (warm): s, prompt+completion tok/s", f"{f['steps'][-1]['seconds']:.1f} s, {f['tokens_per_s']:,.0f}"))
    rows.append((f"TRL {t['version']} GRPOTrainer, same shape: tok/s", f"{t['tokens_per_s']:,.0f}"))
    rows.append(("fulcrum / TRL", f"{v['ratio_fulcrum_over_trl']:.2f}x"))
width = max(len(k) for k, _ in rows) if rows else 10
print(f"\n| {'figure':<{width}} | value |\n| {'-' * width} | --- |")
for k, val in rows:
    print(f"| {k:<{width}} | {val} |")
EOF
elapsed "done; logs and JSON in $OUT"
