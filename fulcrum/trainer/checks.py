"""The whole check of a resolved configuration, which `fulcrum train` and `fulcrum doctor` both run
before any model loads: the configuration's own rules (fulcrum.config.validate) and the names only the
algorithm package knows (its registries are the one list; a user's `policy_loss.path` adds to it when
imported). Here, above both, because the configuration sits below the algorithm package."""

from __future__ import annotations

from fulcrum.algo import rollout_correction
from fulcrum.algo.advantages import adv_estimator_names
from fulcrum.algo.kl import KL_PENALTY_NAMES
from fulcrum.algo.losses import LOSS_AGG_MODES
from fulcrum.algo.policy_losses import policy_loss_names
from fulcrum.config import ConfigError, Finding, FulcrumConfig, validate
from fulcrum.config.keys import get_path
from fulcrum.reward.coverage import unscored_problems


def algorithm_findings(cfg: FulcrumConfig) -> list[Finding]:
    """Estimator, KL, loss-aggregation and policy-loss names the algorithm package implements, and the
    rollout-correction thresholds as its parsers read them."""
    findings = []
    actor, algo = cfg.actor_rollout_ref.actor, cfg.algorithm
    try:  # the user's own losses (policy_loss.path) are registered when their module is imported
        loss_modes = policy_loss_names(actor.policy_loss.path)
    except ImportError as err:
        findings.append(Finding((actor.key("policy_loss.path"),), str(err)))
        loss_modes = policy_loss_names()
    kl, agg = "unknown KL estimator {value!r}; one of {names}", "expected one of {names}, got {value!r}"
    choices = [  # (key, the names it takes, the message when it takes another)
        (algo.key("adv_estimator"), adv_estimator_names(), "unknown estimator {value!r}; one of {names}"),
        (actor.key("loss_agg_mode"), LOSS_AGG_MODES, agg),
        (cfg.critic.key("loss_agg_mode"), LOSS_AGG_MODES, agg),
        (algo.key("kl_penalty"), KL_PENALTY_NAMES, kl),
        (actor.key("kl_loss_type"), KL_PENALTY_NAMES, kl),
        (actor.key("policy_loss.loss_mode"), loss_modes, "{value!r} is not implemented; one of {names}"),
    ]
    for key, names, message in choices:
        if (value := get_path(cfg, key)) not in names:
            findings.append(Finding((key,), message.format(value=value, names=list(names))))
    return findings + _rollout_correction(cfg)


def _rollout_correction(cfg: FulcrumConfig) -> list[Finding]:
    rc, findings = cfg.algorithm.rollout_correction, []

    def key(name: str) -> str:
        return cfg.algorithm.key(f"rollout_correction.{name}")

    if rc.rollout_is is not None:
        if rc.rollout_is not in rollout_correction.IS_LEVELS:
            findings.append(Finding((key("rollout_is"),), f"{rc.rollout_is!r}: one of null, token, sequence"))
        try:
            rollout_correction.parse_is_threshold(rc.rollout_is_threshold)
        except ValueError as err:
            findings.append(Finding((key("rollout_is_threshold"),), str(err)))
    if rc.rollout_rs is not None:
        try:
            rollout_correction.parse_rs_options(rc.rollout_rs, rc.rollout_rs_threshold)
        except ValueError as err:
            findings.append(Finding((key("rollout_rs"), key("rollout_rs_threshold")), str(err)))
    return findings


def reward_findings(cfg: FulcrumConfig) -> list[Finding]:
    """A data source of the training or validation files that nothing scores, a scorer's missing extra,
    a ground truth that is no answer string (fulcrum.reward.coverage): each file and source named."""
    return [Finding((key,), message) for key, message in unscored_problems(cfg)]


def configuration_findings(cfg: FulcrumConfig, n_devices: int | None = None) -> list[Finding]:
    """Findings that make the run fail or waste compute ([] = can run); `n_devices` as validate()'s."""
    return validate(cfg, n_devices) + algorithm_findings(cfg) + reward_findings(cfg)


def check(cfg: FulcrumConfig, n_devices: int | None = None) -> None:
    """Raise ConfigError listing every finding of configuration_findings(), one a line."""
    findings = configuration_findings(cfg, n_devices)
    if findings:
        lines = "\n".join(f"  {f}" for f in findings)
        raise ConfigError(
            f"invalid configuration ({len(findings)} problem(s)):\n{lines}", findings[0].keys[0]
        )
