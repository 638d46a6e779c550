"""fulcrum's configuration: verl's key tree as typed dataclasses, verl-style overrides, validation.

from fulcrum.config import load_config, save_config, validate
cfg = load_config(["data.train_batch_size=256", "actor_rollout_ref.rollout.n=4"])
problems = validate(cfg, n_devices=1)   # [] when its own rules hold (the algorithms' names: trainer.checks)
save_config(cfg, run_dir / "config.yaml")
"""

from fulcrum.config.compat import NO_EFFECT_KEYS, UNSUPPORTED, is_no_effect
from fulcrum.config.finding import Finding
from fulcrum.config.keys import ConfigError
from fulcrum.config.listing import KeyInfo, describe, format_keys
from fulcrum.config.loader import (
    DERIVED,
    apply_override,
    load_config,
    load_config_file,
    load_structured,
    load_yaml,
    resolve,
    save_config,
    to_dict,
    unresolve,
)
from fulcrum.config.schema import FulcrumConfig
from fulcrum.config.validate import advise, uses_critic, uses_reference, validate, world_size

__all__ = [
    "DERIVED",
    "NO_EFFECT_KEYS",
    "UNSUPPORTED",
    "ConfigError",
    "Finding",
    "FulcrumConfig",
    "KeyInfo",
    "advise",
    "apply_override",
    "describe",
    "format_keys",
    "is_no_effect",
    "load_config",
    "load_config_file",
    "load_structured",
    "load_yaml",
    "resolve",
    "save_config",
    "to_dict",
    "unresolve",
    "uses_critic",
    "uses_reference",
    "validate",
    "world_size",
]
