"""Each worker's section takes the sizes a user set, and the unset ones as the loader resolved them."""

from __future__ import annotations

import pytest

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


def test_each_model_s_graphs_key_reaches_its_forwards(tiny_dir: str) -> None:
    """actor_rollout_ref.actor.cuda_graphs switches every model's micro-batch graphs (the reference's and
    the critic's keys follow it unless set); the models' forwards carry what their key says, and a
    model whose key is false gives that as the reason it runs eagerly."""
    import torch

    from fulcrum.workers.actor import ActorWorker, reference_worker
    from fulcrum.workers.critic import CriticWorker

    cpu = torch.device("cpu")
    sizes = [
        f"actor_rollout_ref.model.path={tiny_dir}",
        f"critic.model.path={tiny_dir}",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "critic.ppo_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.actor.use_kl_loss=true",
    ]
    default = load_config(sizes)
    assert (default.actor_rollout_ref.ref.cuda_graphs, default.critic.cuda_graphs) == (True, True)
    cfg = load_config([*sizes, "actor_rollout_ref.actor.cuda_graphs=false", "critic.cuda_graphs=true"])
    assert (cfg.actor_rollout_ref.ref.cuda_graphs, cfg.critic.cuda_graphs) == (False, True)
    actor = ActorWorker(actor_section(cfg), cpu, total_training_steps=1)
    reference = reference_worker(reference_section(cfg), cpu, actor)
    critic = CriticWorker(critic_section(cfg), cpu, total_training_steps=1)
    off = "its cuda_graphs key is false"
    assert [w.forwards.graphs_off for w in (actor, reference, critic)] == [off, off, "not on CUDA"]


def test_the_cpp_wrapper_key_reaches_every_compiled_model() -> None:
    sized = [
        "critic.ppo_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
    ]
    cfg = load_config([*sized, "actor_rollout_ref.actor.inductor_cpp_wrapper=false"])
    assert cfg.actor_rollout_ref.actor.inductor_cpp_wrapper is False
    assert (reference_section(cfg).inductor_cpp_wrapper, critic_section(cfg).inductor_cpp_wrapper) == (
        False,
        False,
    )
    assert critic_section(load_config(sized)).inductor_cpp_wrapper is True


def test_each_section_names_its_keys_by_the_path_it_sits_at() -> None:
    """A section's key("x") is the path a user types for x: every section of the tree, found by walking it."""
    import dataclasses

    from fulcrum.config.keys import Section, get_path

    cfg, seen = load_config([]), []

    def walk(node: object, prefix: str) -> None:
        if isinstance(node, Section):
            seen.append(type(node))
            assert type(node).PATH == prefix.rstrip(".")
            first = dataclasses.fields(node)[0].name
            assert get_path(cfg, node.key(first)) == getattr(node, first)
        for f in dataclasses.fields(node):  # type: ignore[arg-type]
            value = getattr(node, f.name)
            if dataclasses.is_dataclass(value):
                walk(value, f"{prefix}{f.name}.")

    walk(cfg, "")
    assert len(seen) == len(set(seen)) == len(Section.__subclasses__())
    with pytest.raises(KeyError, match="critic has no key 'ppo_micro_batch_size_per_gpus'"):
        cfg.critic.key("ppo_micro_batch_size_per_gpus")


def test_a_key_named_through_a_section_is_checked_at_every_depth() -> None:
    """Every path a section's key() gives is a key of the tree, and a typo inside a nested group fails
    where a module names it instead of reaching a user as a key that does not exist; a free-form
    mapping's sub-keys are the user's to choose."""
    from fulcrum.config.keys import Section, all_keys
    from fulcrum.config.schema import ActorConfig, FulcrumConfig, RewardModelConfig

    tree = set(all_keys(FulcrumConfig))
    for section in Section.__subclasses__():
        assert {section.key(name) for name in all_keys(section)} <= tree
    assert ActorConfig.key("fsdp_config.param_offload") == "actor_rollout_ref.actor.fsdp_config.param_offload"
    with pytest.raises(KeyError, match=r"actor_rollout_ref\.actor has no key 'fsdp_config\.param_offlod'"):
        ActorConfig.key("fsdp_config.param_offlod")
    with pytest.raises(KeyError, match=r"has no key 'optim\.lr\.max'"):
        ActorConfig.key("optim.lr.max")
    assert RewardModelConfig.key("reward_kwargs.threshold") == "reward_model.reward_kwargs.threshold"
