#!/usr/bin/env bash
# The GPU figures of the features beside the core step, in one device call (one H200, < 9.5 min by
# default), each a part under its own limit (bench/parts.sh):
#   multi_turn  bench/multi_turn.py: 512 conversations x 3 turns with a 1-ms tool against single-turn
#               generation of the same tokens, and one 200-ms tool (the multi-turn page's floor: 0.75)
#   checkpoint  the seed command for 9 steps with a save every 3 (trainer.save_in_background): the step's
#               stall, the wait for the previous write and each write's seconds (summary "checkpoints")
#   lora        bench/lora.py: the 0.5B GRPO shape, LoRA rank 32 against full fine-tuning, same call
#   qwen3, qwen3_moe   bench/rollout.py --shape qwen3-0.6b | qwen3-moe-small (the engine on those families)
#   qwen3_grpo, qwen3_moe_grpo   the GRPO step (64 prompts x 8, micro-batches of 32, gradient checkpointing,
#               native rollout) on those shapes, 3 steps: tok/s/GPU, MFU and the phases (bench/train_step.py)
#   lora7b      bench/lora.py --shape 7b (writes a 15 GB random model first; a call of its own)
#   host        the seed command for 3 steps, then again with one CPU-burning neighbour process per host core
#               (`bench/train_step.py run --burn N`, N the online CPUs: not `nproc`, which answers OMP_NUM_THREADS):
#               how much the step's figure depends on the host's speed
#
#   PARTS=multi_turn,checkpoint,qwen3,qwen3_moe RESULTS=$OUT bash bench/features.sh
#   PARTS=qwen3_grpo,qwen3_moe_grpo RESULTS=$OUT bash bench/features.sh
#   SMOKE=1 bash bench/features.sh      # multi_turn, the shape parts' and lora's scripts on the CPU, tiny models
#
# Inputs as bench/run_all.sh's ($DATA, $MODEL made when missing; carried wheel folders installed). With
# $RESULTS set, at most 8 files are copied there: each part's JSON and one tar.gz of the logs.
set -u
cd "$(dirname "$0")/.."
WORK=${WORK:-/tmp/features}; mkdir -p "$WORK"
RESULTS=${RESULTS:-}
SMOKE=${SMOKE:-0}
DATA=${DATA:-.bench/gsm8k}
PY=${PYTHON:-python3}
DEADLINE_S=${DEADLINE_S:-560}
PARTS=${PARTS:-multi_turn,checkpoint,qwen3,qwen3_moe}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
started=$(date +%s)
# shellcheck source=bench/parts.sh
. bench/parts.sh
wheels "$PY"
wants() { [[ ",$PARTS," == *",$1,"* ]]; }
rm -rf "$WORK"/*.json "$WORK"/ckpt_run "$WORK"/lora "$WORK"/lora7b "$WORK"/grpo_* "$WORK"/model_* "$WORK"/host_*

if [ "$SMOKE" = 1 ]; then
  . bench/smoke_args.sh
  SMALL=(--small --device cpu)
  read -r -a SHAPE_ARGS <<<"$SMOKE_ROLLOUT_ARGS"  # a tiny Qwen2 in place of the shape: the script's path only
  # the others time the 0.5B shape's seed steps: GPU only
  PARTS=multi_turn,qwen3,qwen3_moe,qwen3_grpo,qwen3_moe_grpo,lora
  TINY=(--tiny)  # the shapes' families at a CPU size
  MODEL=$WORK/model_tiny
  $PY bench/train_step.py make-model --tiny --out "$MODEL" >/dev/null || { echo "could not make $MODEL"; exit 1; }
  # shellcheck disable=SC2206  # a word list over several lines
  STEP_SMOKE=($SMOKE_STEP_ARGS)
else
  SMALL=()
  SHAPE_ARGS=()
  TINY=()
  STEP_SMOKE=()
  if wants checkpoint || wants lora || wants host; then
    MODEL=${MODEL:-.bench/qwen05}
    [ -f "$MODEL/config.json" ] || $PY bench/train_step.py make-model --out "$MODEL" >/dev/null \
      || { echo "could not make the model in $MODEL"; exit 1; }
  fi
fi
if { wants checkpoint || wants lora || wants lora7b || wants host || wants qwen3_grpo || wants qwen3_moe_grpo; } &&
  [ ! -f "$DATA/train.parquet" ]; then
  $PY -m fulcrum.cli data gsm8k --src ../shared/data/gsm8k --out "$DATA" || { echo "no GSM8K data in $DATA"; exit 1; }
fi
elapsed "parts: $PARTS"

# Limits (H200): the engine benches ~40-60 s each with graph capture; a 0.5B seed step ~6 s after ~60 s of
# loading and compiling, a save of its 12 GB state 22-26 s in the step before background saving.
if wants multi_turn; then
  part multi_turn 150 "$PY" bench/multi_turn.py "${SMALL[@]}" --json "$WORK/multi_turn.json"
fi
if wants checkpoint; then
  # 9 steps, a save every 3: ~100 s to the first warm step, then ~6 s a step and the saves' stalls
  part checkpoint 330 "$PY" bench/train_step.py run --data "$DATA" --model "$MODEL" --run "$WORK/ckpt_run" --steps 9 \
    --summary "$WORK/checkpoint.json" actor_rollout_ref.rollout.name=native trainer.test_freq=-1 trainer.save_freq=3 \
    trainer.resume_mode=disable
fi
for shape in qwen3 qwen3_moe; do
  if wants $shape; then
    name=qwen3-0.6b; [ $shape = qwen3_moe ] && name=qwen3-moe-small
    part $shape 100 "$PY" bench/rollout.py "${SHAPE_ARGS[@]}" --shape $name --skip-hf --json "$WORK/rollout_$shape.json"
  fi
done
# The GRPO step (train_step.py --grpo) on each shape: the model is written first (random bf16, ~1.2 / 2.0 GB),
# then 3 steps.
for shape in qwen3 qwen3_moe; do
  if wants ${shape}_grpo; then
    name=qwen3-0.6b; [ $shape = qwen3_moe ] && name=qwen3-moe-small
    part ${shape}_grpo 200 bash -c "$PY bench/train_step.py make-model --shape $name ${TINY[*]} --out $WORK/model_$shape >/dev/null \
      && $PY bench/train_step.py run --data $DATA --model $WORK/model_$shape --run $WORK/grpo_$shape --steps 3 \
      --summary $WORK/grpo_$shape.json --grpo ${STEP_SMOKE[*]}"
  fi
done
if wants host; then
  SEED_RUN=(--data "$DATA" --model "$MODEL" --steps 3 actor_rollout_ref.rollout.name=native trainer.test_freq=-1
    trainer.save_freq=-1 trainer.resume_mode=disable)
  part host 300 bash -c "$PY bench/train_step.py run --run $WORK/host_plain --summary $WORK/host_plain.json ${SEED_RUN[*]} \
    && $PY bench/train_step.py run --run $WORK/host_burn --summary $WORK/host_burn.json --burn $(getconf _NPROCESSORS_ONLN) ${SEED_RUN[*]}"
fi
if wants lora; then
  part lora 330 "$PY" bench/lora.py --data "$DATA" --model "$MODEL" --out "$WORK/lora" --steps 3 --order lora,full "${STEP_SMOKE[@]}"
fi
if wants lora7b; then
  part lora7b 540 "$PY" bench/lora.py --shape 7b --data "$DATA" --model "${MODEL7B:-/tmp/qwen7b}" --out "$WORK/lora7b" --steps 2
fi

if [ -n "$RESULTS" ]; then  # the parts' JSON (LoRA's named by variant) and the logs, at most 8 files
  mkdir -p "$RESULTS"
  for f in "$WORK"/*.json "$WORK"/lora/*.json "$WORK"/lora7b/*.json; do
    [ -f "$f" ] || continue
    case $f in "$WORK"/lora*/*) name=$(basename "$(dirname "$f")")_$(basename "$f") ;; *) name=$(basename "$f") ;; esac
    cp "$f" "$RESULTS/$name"
  done
  (cd "$WORK" && tar czf "$RESULTS/features_logs.tar.gz" ./*.log)
fi
elapsed done
