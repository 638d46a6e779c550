"""Settings under which a run goes through its steps but no learning signal reaches the policy the
rollout engine samples from: refused before any model loads (`fulcrum train` and `fulcrum doctor` both
run these with fulcrum.config.validate's other rules).

- Greedy rollouts (`rollout.temperature=0`, `do_sample=False` or `top_k=1`) give every response to a
  prompt the same tokens, so a group baseline equals each score: every advantage, and the policy
  gradient, is 0 at every step.
- LoRA on the token embedding or the output head: the engine receives merged Linear weights only, so a
  trained embedding never reaches it (the samples come from the base embedding), and the actor's
  log-probs read the output head's weight directly, so an adapter on it gets no gradient.
"""

from __future__ import annotations

import re
from typing import Any

from fulcrum.config.finding import Finding
from fulcrum.config.schema import FulcrumConfig, RolloutConfig

# Estimators whose advantage is a score minus the mean (or another baseline) of the responses to the same
# prompt: with n identical responses it is 0. With n = 1 they fall back to the plain score.
GROUP_BASELINE_ESTIMATORS = frozenset(
    {"grpo", "rloo", "reinforce_plus_plus_baseline", "gpg", "optimal_token_baseline"}
)
# ReMax's baseline is the greedy response's score: a greedy sample is that response, whatever n.
GREEDY_BASELINE_ESTIMATORS = frozenset({"remax"})
# The module paths of a Hugging Face causal LM's token embedding and output head (every family the
# native engine serves spells them so), and why LoRA on each does nothing.
UNSYNCED_MODULES = {
    "model.embed_tokens": "the rollout engine receives merged Linear weights only, so the trained "
    "embedding never reaches the samples",
    "lm_head": "the actor's log-probs read the output head's weight directly, so its adapter gets no gradient",
}


def greedy_keys(rollout: RolloutConfig) -> list[str]:
    """The rollout keys that make training rollouts greedy (none: they sample)."""
    keys = []
    if not rollout.do_sample:
        keys.append(rollout.key("do_sample"))
    if rollout.temperature == 0:
        keys.append(rollout.key("temperature"))
    if rollout.top_k == 1:
        keys.append(rollout.key("top_k"))
    return keys


def greedy_groups(cfg: FulcrumConfig) -> list[Finding]:
    """A group-baseline estimator over greedy rollouts has advantage 0 for every response."""
    rollout, estimator = cfg.actor_rollout_ref.rollout, cfg.algorithm.adv_estimator
    greedy = greedy_keys(rollout)
    if not greedy:
        return []
    if estimator in GROUP_BASELINE_ESTIMATORS and rollout.n > 1:
        why = f"the {rollout.n} responses to a prompt are identical, so each equals its group's baseline"
    elif estimator in GREEDY_BASELINE_ESTIMATORS:
        why = "each response is the greedy response whose score is its baseline"
    else:
        return []
    return [
        Finding(
            (cfg.algorithm.key("adv_estimator"), *greedy, rollout.key("n")),
            f"{estimator} with greedy rollouts ({', '.join(f'{k}={_value(cfg, k)}' for k in greedy)}): {why}; "
            "every advantage and the policy gradient are 0 at every step. Sample (temperature > 0, do_sample=True)",
        )
    ]


def _value(cfg: FulcrumConfig, key: str) -> Any:
    return getattr(cfg.actor_rollout_ref.rollout, key.rsplit(".", 1)[1])


def peft_matches(path: str, names: Any) -> bool:
    """peft's rule for `target_modules`: a string is a regex over the whole module path ("all-linear":
    every Linear but the output head, never an embedding), a list of names matches the path or its last
    dotted parts."""
    if names is None:
        return False
    if isinstance(names, str):
        return names != "all-linear" and re.fullmatch(names, path) is not None
    return any(path == str(n) or path.endswith("." + str(n)) for n in names)


def unsynced_lora_targets(cfg: FulcrumConfig) -> list[Finding]:
    """The actor's LoRA `target_modules` naming the token embedding or the output head."""
    model = cfg.actor_rollout_ref.model
    if model.lora_rank <= 0 or model.lora_adapter_path:  # an adapter folder carries its own modules
        return []
    targets = model.target_modules if isinstance(model.target_modules, str) else list(model.target_modules)
    findings = []
    for path, why in UNSYNCED_MODULES.items():
        if peft_matches(path, targets) and not peft_matches(path, model.exclude_modules):
            findings.append(
                Finding(
                    (model.key("target_modules"),),
                    f"{targets!r} gives {path} an adapter: {why}. Adapt the attention and MLP Linears "
                    "('all-linear', or names such as q_proj, v_proj)",
                )
            )
    return findings


def signal_problems(cfg: FulcrumConfig) -> list[Finding]:
    return greedy_groups(cfg) + unsynced_lora_targets(cfg)
