"""The size rules of a resolved configuration, the one place they are checked: micro-batch sizes set in
one spelling (verl's check_mutually_exclusive), mini- and micro-batches dividing what holds them (verl's
worker asserts), and dynamic-batch token budgets holding one full-length sequence. Sections
(fulcrum.config.sections) and workers take the sizes as checked here."""

from __future__ import annotations

from fulcrum.config.finding import Finding
from fulcrum.config.keys import Section
from fulcrum.config.schema import ActorConfig, CriticConfig, FulcrumConfig

# Estimators that need values from a critic; the others are critic-free. The one list of this rule:
# the trainer builds a critic, and doctor sizes one, through uses_critic().
CRITIC_ESTIMATORS = frozenset({"gae"})


def uses_critic(cfg: FulcrumConfig) -> bool:
    """A critic is trained when critic.enable says so, else when the estimator needs values (gae), as in verl."""
    if cfg.critic.enable is not None:
        return cfg.critic.enable
    return cfg.algorithm.adv_estimator in CRITIC_ESTIMATORS


def uses_reference(cfg: FulcrumConfig) -> bool:
    """A reference policy is needed for a KL loss or a KL penalty in the reward."""
    return cfg.actor_rollout_ref.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward


def world_size(cfg: FulcrumConfig) -> int:
    return cfg.trainer.n_gpus_per_node * cfg.trainer.nnodes


def size_problems(cfg: FulcrumConfig) -> list[Finding]:
    """Every size finding ([] = the sizes can run)."""
    return _micro_batch_pairs(cfg) + _batch_divisibility(cfg) + _token_budgets(cfg)


def _micro_batch_pairs(cfg: FulcrumConfig) -> list[Finding]:
    """verl's check_mutually_exclusive: exactly one of the deprecated global and the per-device size."""
    arr, critic, rm = cfg.actor_rollout_ref, cfg.critic, cfg.reward_model
    pairs: list[tuple[Section, str, bool]] = [  # (section, the global size's name, whether it is needed)
        (arr.actor, "ppo_micro_batch_size", not arr.actor.use_dynamic_bsz),
        (arr.rollout, "log_prob_micro_batch_size", not arr.rollout.log_prob_use_dynamic_bsz),
        (arr.ref, "log_prob_micro_batch_size", uses_reference(cfg) and not arr.ref.log_prob_use_dynamic_bsz),
        (critic, "ppo_micro_batch_size", uses_critic(cfg) and not critic.use_dynamic_bsz),
        # verl's reward loop serves the model without this size; here it then defaults to 8 rows
        (rm, "micro_batch_size", rm.enable and not rm.use_dynamic_bsz and not rm.use_reward_loop),
    ]
    problems = []
    for section, name, needed in pairs:
        if not needed:
            continue
        global_key, per_gpu_key = section.key(name), section.key(f"{name}_per_gpu")
        global_value, per_gpu_value = getattr(section, name), getattr(section, f"{name}_per_gpu")
        if global_value is None and per_gpu_value is None:
            problems.append(
                Finding((per_gpu_key,), "must be set (responses per forward/backward per device)")
            )
        elif global_value is not None and per_gpu_value is not None:
            problems.append(
                Finding(
                    (global_key, per_gpu_key),
                    f"both are set; remove {global_key} (deprecated, only the per-device size is used)",
                )
            )
    return problems


def _batch_divisibility(cfg: FulcrumConfig) -> list[Finding]:
    """Sizes count prompts (x rollout.n responses); per-device sizes count responses (as in verl)."""
    problems = []
    n = cfg.actor_rollout_ref.rollout.n
    n_gpus = world_size(cfg)
    train = cfg.data.train_batch_size
    if n_gpus <= 0 or n <= 0 or train <= 0:
        return problems  # reported by domain_problems
    if (train * n) % n_gpus:
        problems.append(
            Finding(
                ("data.train_batch_size", "actor_rollout_ref.rollout.n", "trainer.n_gpus_per_node"),
                f"train_batch_size x n = {train * n} responses must be divisible by the {n_gpus} device(s)",
            )
        )
    roles: list[ActorConfig | CriticConfig] = [cfg.actor_rollout_ref.actor]
    if uses_critic(cfg):
        roles.append(cfg.critic)
    for role in roles:
        if role.use_dynamic_bsz:
            continue
        # Each data-parallel group (sp ranks with sequence parallelism) takes one share of a mini-batch.
        sp = int(role.ulysses_sequence_parallel_size)
        dp = n_gpus // sp if n_gpus % sp == 0 else n_gpus
        devices = f"{dp} device(s)" if sp == 1 else f"{dp} data-parallel group(s) of {sp}"
        mini = role.ppo_mini_batch_size
        if mini is None or mini <= 0:
            continue
        if mini > train:
            problems.append(
                Finding(
                    (role.key("ppo_mini_batch_size"), cfg.data.key("train_batch_size")),
                    f"mini-batch of {mini} prompts is larger than the {train} prompts of a step",
                )
            )
            continue
        if (mini * n) % dp:
            problems.append(
                Finding(
                    (role.key("ppo_mini_batch_size"), cfg.trainer.key("n_gpus_per_node")),
                    f"ppo_mini_batch_size x n = {mini * n} responses must be divisible by the {devices}",
                )
            )
            continue
        per_device = mini * n // dp
        micro = role.ppo_micro_batch_size_per_gpu
        if micro is not None and micro > 0 and per_device % micro:
            problems.append(
                Finding(
                    (role.key("ppo_mini_batch_size"), role.key("ppo_micro_batch_size_per_gpu")),
                    f"a mini-batch gives {per_device} responses per device, not divisible by the "
                    f"micro-batch of {micro}; pick a micro-batch that divides {per_device}",
                )
            )
        global_micro = role.ppo_micro_batch_size
        if global_micro is not None and global_micro > 0:
            if (mini * n) % global_micro:
                problems.append(
                    Finding(
                        (role.key("ppo_mini_batch_size"), role.key("ppo_micro_batch_size")),
                        f"{mini * n} responses per mini-batch not divisible by micro-batch {global_micro}",
                    )
                )
            if global_micro < dp:
                problems.append(Finding((role.key("ppo_micro_batch_size"),), f"must be >= the {devices}"))
    return problems


def _token_budgets(cfg: FulcrumConfig) -> list[Finding]:
    """With dynamic batching a micro-batch holds at most its budget of tokens: below one full-length
    sequence, that sequence runs alone over the budget, which then no longer bounds the memory."""
    arr, critic = cfg.actor_rollout_ref, cfg.critic
    # The rollout's lengths follow data's: the loader resolves them, a FulcrumConfig built in code leaves null.
    prompt = arr.rollout.prompt_length or cfg.data.max_prompt_length
    longest = prompt + (arr.rollout.response_length or cfg.data.max_response_length)
    budgets = [
        (
            arr.actor.key("ppo_max_token_len_per_gpu"),
            arr.actor.use_dynamic_bsz,
            arr.actor.ppo_max_token_len_per_gpu,
        ),
        (
            arr.rollout.key("log_prob_max_token_len_per_gpu"),
            bool(arr.rollout.log_prob_use_dynamic_bsz),
            arr.rollout.log_prob_max_token_len_per_gpu,
        ),
    ]
    if uses_reference(cfg):
        budgets.append(
            (
                arr.ref.key("log_prob_max_token_len_per_gpu"),
                bool(arr.ref.log_prob_use_dynamic_bsz),
                arr.ref.log_prob_max_token_len_per_gpu,
            )
        )
    if uses_critic(cfg):
        dynamic = bool(critic.use_dynamic_bsz)
        budgets += [
            (critic.key("ppo_max_token_len_per_gpu"), dynamic, critic.ppo_max_token_len_per_gpu),
            (critic.key("forward_max_token_len_per_gpu"), dynamic, critic.forward_max_token_len_per_gpu),
        ]
    lengths = (cfg.data.key("max_prompt_length"), cfg.data.key("max_response_length"))
    return [
        Finding(
            (key, *lengths),
            f"{key}={limit} is below one sequence of up to {longest} tokens ({lengths[0]} + response_length)",
            why="with dynamic batching a micro-batch holds at most this many tokens, the bound its memory "
            "is sized for: a full-length sequence would run alone over it",
            fix=f"{key}>={longest}; a budget of several sequences (e.g. {4 * longest}) lets short ones share "
            "a micro-batch",
        )
        for key, dynamic, limit in budgets
        if dynamic and limit is not None and limit < longest
    ]


def uneven_mini_batches(cfg: FulcrumConfig) -> list[Finding]:
    """A mini-batch size that does not divide the step's prompts leaves a smaller last mini-batch each
    epoch (verl splits the same way): an optimiser step over fewer responses."""
    train = cfg.data.train_batch_size
    roles: list[ActorConfig | CriticConfig] = [cfg.actor_rollout_ref.actor]
    if uses_critic(cfg):
        roles.append(cfg.critic)
    return [
        Finding(
            (cfg.data.key("train_batch_size"), role.key("ppo_mini_batch_size")),
            f"train_batch_size={train} is not a multiple of {role.key('ppo_mini_batch_size')}="
            f"{role.ppo_mini_batch_size}: the last mini-batch of a step is smaller",
        )
        for role in roles
        if role.ppo_mini_batch_size
        and 0 < role.ppo_mini_batch_size <= train
        and train % role.ppo_mini_batch_size
    ]
