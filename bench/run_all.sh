#!/usr/bin/env bash
# Every GPU figure of BENCHMARKS.md's throughput sections in one run (one H200, < 9.5 min), then one table:
# the rollout engine (bench/rollout.py), the GRPO step and TRL's GRPOTrainer beside it (bench/vs_trl.py),
# the seed PPO step (bench/train_step.py), each training pass alone (bench/passes.py).
#
#   bash bench/run_all.sh                 # from the repository root
#   SMOKE=1 bash bench/run_all.sh         # the same scripts, tiny shapes, on the CPU (~3 min)
#
# Each part runs under its own time limit (PART_S below, cut further to what is left of $DEADLINE_S,
# counted from the start), so a slow or hung part costs its own figure only. Work files go to $WORK
# (default /tmp/run_all); with $RESULTS set (a device call's $OUT) at most 8 files are copied there:
# summary.md (the table), the parts' JSON and one tar.gz of their logs.
#
# Inputs (made when missing): $DATA, GSM8K in verl's parquet (`fulcrum data gsm8k --src ../shared/data/gsm8k
# --out .bench/gsm8k`; the device machine has no ../shared: make it here and carry .bench/gsm8k); $MODEL, the
# random Qwen2.5-0.5B-shaped model (bench/train_step.py make-model). Missing Python packages (omegaconf, trl,
# datasets) are installed from the wheel folders .whl and .whl-trl when they are there (carry them).
# The learning benchmark (bench/learning.py, one call of its own) is not part of this run: see BENCHMARKS.md.
# Before/after a change in one call: bench/tools/compare_trees.sh OLD_TREE (its parts, both trees alternating).
# SMOL=DIR (SmolLM2-135M-Instruct, `fulcrum pretrained smollm2-135m-instruct --out DIR`) adds its seed-shape
# and GRPO-shape steps in place of the TRL comparison.
set -u
cd "$(dirname "$0")/.."
WORK=${WORK:-/tmp/run_all}; mkdir -p "$WORK"
RESULTS=${RESULTS:-}
SMOKE=${SMOKE:-0}
DATA=${DATA:-.bench/gsm8k}
PY=${PYTHON:-python3}
DEADLINE_S=${DEADLINE_S:-550}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
started=$(date +%s)
# shellcheck source=bench/parts.sh
. bench/parts.sh
wheels "$PY"  # the device image lacks omegaconf, trl and datasets
if [ ! -f "$DATA/train.parquet" ]; then
  $PY -m fulcrum.cli data gsm8k --src ../shared/data/gsm8k --out "$DATA" || { echo "no GSM8K data in $DATA"; exit 1; }
fi

if [ "$SMOKE" = 1 ]; then
  MODEL=${MODEL:-$WORK/tiny_model}
  [ -f "$MODEL/config.json" ] || $PY -m fulcrum.cli tiny-model --out "$MODEL" >/dev/null
  . "$(dirname "$0")/smoke_args.sh"
  ROLLOUT_ARGS=$SMOKE_ROLLOUT_ARGS
  STEP_ARGS=$SMOKE_STEP_ARGS
  TRL_ARGS="--smoke"
else
  MODEL=${MODEL:-.bench/qwen05}
  [ -f "$MODEL/config.json" ] || $PY bench/train_step.py make-model --out "$MODEL" >/dev/null
  ROLLOUT_ARGS=""
  STEP_ARGS=""
  TRL_ARGS=""
fi
elapsed "inputs ready: model $MODEL, data $DATA"
rm -rf "$WORK/seed_run" "$WORK/vs_trl" "$WORK"/smol_* "$WORK"/*.json
# The GRPO shape on SmolLM2: 128 prompts x 8, micro-batches of 64 (its seed shape is the seed command's).
SMOL_GRPO_ARGS="algorithm.adv_estimator=grpo data.train_batch_size=128 actor_rollout_ref.rollout.n=8
  actor_rollout_ref.actor.ppo_mini_batch_size=128 actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=64
  actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=64 actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=64"

# Limits: measured parts take (H200, 2026-11-30) rollout ~1 min with HF's compiled generate, a fulcrum step
# 2-8 s after ~1 min of loading and compiling, a TRL step 11-14 s; the sum stays under DEADLINE_S.
# shellcheck disable=SC2086  # the *_ARGS are word lists
part rollout 110 $PY bench/rollout.py $ROLLOUT_ARGS --json "$WORK/rollout.json"
# GRPO step (64 prompts x 8, micro 32, gradient checkpointing), fulcrum's side of the TRL comparison; each
# side has its own limit inside (vs_trl --timeout-s), so a slow TRL still leaves fulcrum's figure.
# With $SMOL (a SmolLM2-135M-Instruct folder from `fulcrum pretrained`), its seed-shape and GRPO-shape steps
# take the TRL comparison's place (bench/real_model.sh's throughput stage; the call's time holds one or the other).
if [ -n "${SMOL:-}" ]; then
  for shape in seed grpo; do
    # shellcheck disable=SC2086
    part "smol_$shape" 130 $PY bench/train_step.py run --data "$DATA" --model "$SMOL" --run "$WORK/smol_$shape" \
      --steps 3 --summary "$WORK/smol_$shape.json" actor_rollout_ref.rollout.name=native trainer.test_freq=-1 \
      trainer.save_freq=-1 trainer.resume_mode=disable $( [ $shape = grpo ] && echo "$SMOL_GRPO_ARGS" ) $STEP_ARGS
  done
else
  # shellcheck disable=SC2086
  part vs_trl 265 $PY bench/vs_trl.py --model "$MODEL" --data "$DATA" --out "$WORK/vs_trl" --timeout-s 125 $TRL_ARGS
fi
# The seed command on one device, native rollout, 2 steps (the second is the warm one), no validation/save.
# shellcheck disable=SC2086
part seed 150 $PY bench/train_step.py run --data "$DATA" --model "$MODEL" --run "$WORK/seed_run" --steps 2 \
  --summary "$WORK/seed.json" actor_rollout_ref.rollout.name=native trainer.test_freq=-1 trainer.save_freq=-1 \
  trainer.resume_mode=disable $STEP_ARGS
if [ -f bench/passes.py ] && [ "$SMOKE" != 1 ]; then  # GPU only: it times CUDA passes
  part passes 80 $PY bench/passes.py --model "$MODEL" --repeat 2 --json "$WORK/passes.json"
fi

$PY - "$WORK" <<'EOF' | tee "$WORK/summary.md"
import json, sys
from pathlib import Path

out = Path(sys.argv[1])
def load(name):
    path = out / name
    try:
        return json.loads(path.read_text()) if path.exists() else None
    except json.JSONDecodeError:
        return None

rows = []
r = load("rollout.json")
if r:
    rows.append(("rollout: native engine, generated tok/s", f"{r.get('native_tok_per_s', 0):,}"))
    if "hf_tok_per_s" in r:
        rows.append(("rollout: HF static-cache generate, tok/s (native / HF)", f"{r['hf_tok_per_s']:,} ({r.get('speedup_vs_hf')}x)"))
else:
    rows.append(("rollout", "no result (rollout.log)"))
v = load("vs_trl/vs_trl.json")
f, t = (v or {}).get("fulcrum"), (v or {}).get("trl")
if f:
    rows.append(("GRPO step 64x8 (warm): s, prompt+completion tok/s", f"{f['steps'][-1]['seconds']:.1f} s, {f['tokens_per_s']:,.0f}"))
if t:
    rows.append((f"TRL {t['version']} GRPOTrainer, same shape: s, tok/s", f"{t['steps'][-1]['seconds']:.1f} s, {t['tokens_per_s']:,.0f}"))
if v and v.get("ratio_fulcrum_over_trl"):
    rows.append(("fulcrum / TRL", f"{v['ratio_fulcrum_over_trl']:.2f}x"))
for side, why in ((v or {}).get("failed") or {}).items():
    rows.append((f"vs_trl {side} side", why))
if not v:
    rows.append(("GRPO step and TRL", "no result (vs_trl.log)"))
s = load("seed.json")
if s and s.get("steps"):
    last = s["steps"][-1]
    rows.append(("seed PPO step (warm): s, tok/s/GPU, MFU actor",
                 f"{last.get('timing_s/step', 0):.1f} s, {last.get('perf/throughput', 0):,.0f}, {last.get('perf/mfu/actor', 0):.1%}"))
else:
    rows.append(("seed PPO step", "no result (seed.log)"))
for shape in ("seed", "grpo"):
    sm = load(f"smol_{shape}.json")
    if sm and sm.get("steps"):
        last = sm["steps"][-1]
        rows.append((f"SmolLM2-135M {shape} step (warm): s, tok/s/GPU, MFU actor",
                     f"{last.get('timing_s/step', 0):.1f} s, {last.get('perf/throughput', 0):,.0f}, {last.get('perf/mfu/actor', 0):.1%}"))
p = load("passes.json")
for name, row in ((p or {}).get("passes") or {}).items():
    mfu = f", MFU {row['mfu']:.1%}" if "mfu" in row else ""
    rows.append((f"pass {name} (seed sizes): s, tok/s", f"{row['seconds']:.2f} s, {row['tokens_per_s']:,.0f}{mfu}"))
width = max(len(k) for k, _ in rows)
print(f"\n| {'figure':<{width}} | value |\n| {'-' * width} | --- |")
for k, val in rows:
    print(f"| {k:<{width}} | {val} |")
EOF
if [ -n "$RESULTS" ]; then  # at most 8 files: the table, 4 JSON, the logs
  mkdir -p "$RESULTS"
  cp "$WORK/summary.md" "$RESULTS/run_all_summary.md"
  for f in rollout.json seed.json passes.json vs_trl/vs_trl.json smol_seed.json smol_grpo.json; do [ -f "$WORK/$f" ] && cp "$WORK/$f" "$RESULTS/"; done
  (cd "$WORK" && tar czf "$RESULTS/run_all_logs.tar.gz" ./*.log vs_trl/*.json seed_run/metrics.jsonl 2>/dev/null)
fi
elapsed "done; logs and JSON in $WORK${RESULTS:+, results in $RESULTS}"
