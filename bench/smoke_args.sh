# Sourced by bench/run_all.sh and bench/tools/compare_trees.sh: their parts' arguments at the smoke's tiny
# shapes (SMOKE=1, the CPU), so that both scripts smoke-test the same workload.
# shellcheck disable=SC2034  # used by the scripts that source this file
SMOKE_ROLLOUT_ARGS="--small --device cpu --prompts 8 --new-tokens 8 --grpo-prompts 2 --grpo-n 2 --skip-hf --repeats 1"
SMOKE_STEP_ARGS="data.train_batch_size=4 actor_rollout_ref.actor.ppo_mini_batch_size=4 data.max_response_length=8
  actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2 critic.ppo_micro_batch_size_per_gpu=2
  actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4 actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4
  critic.forward_micro_batch_size_per_gpu=4 trainer.device=cpu"
