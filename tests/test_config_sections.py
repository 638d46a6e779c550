"""Each worker's section takes the sizes a user set, and the unset ones as the loader resolved them."""

from __future__ import annotations

from fulcrum.config import load_config
from fulcrum.config.sections import actor_section, critic_section, reference_section


def test_unset_forward_sizes_follow_the_training_micro_batch() -> None:
    cfg = load_config(
        [
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
            "critic.ppo_micro_batch_size_per_gpu=4",
            "actor_rollout_ref.actor.use_kl_loss=true",
        ]
    )
    assert actor_section(cfg).log_prob.micro_batch_size == 2
    assert reference_section(cfg).log_prob.micro_batch_size == 2
    assert (critic_section(cfg).micro_batch_size, critic_section(cfg).values.micro_batch_size) == (4, 4)


def test_verl_s_global_spelling_alone_sizes_the_critic() -> None:
    cfg = load_config(["critic.ppo_micro_batch_size=6", "critic.forward_micro_batch_size_per_gpu=3"])
    section = critic_section(cfg)
    assert (section.micro_batch_size, section.values.micro_batch_size) == (6, 3)
    section = critic_section(load_config(["critic.ppo_micro_batch_size=6"]))
    assert (section.micro_batch_size, section.values.micro_batch_size) == (6, 6)
