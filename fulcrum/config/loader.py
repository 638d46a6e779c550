"""Build a FulcrumConfig: defaults, then a YAML base, then verl-style dotted overrides, then derived keys."""

from __future__ import annotations

import copy
import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from fulcrum.config.coerce import ConfigError, coerce, parse_free, type_name
from fulcrum.config.compat import ROLLOUT_NAME_ALIASES, is_no_effect
from fulcrum.config.schema import FulcrumConfig
from fulcrum.config.tree import field_types, is_free_dict, is_group, unknown_key_error

log = logging.getLogger("fulcrum.config")

# libyaml's C loader/dumper when PyYAML was built with it (same output, ~10x faster).
_YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
_YAML_DUMPER = getattr(yaml, "CSafeDumper", yaml.SafeDumper)

# key -> the key it follows while unset (null), like verl's `${oc.select:...}` interpolations.
# Order matters: a source is resolved before the keys that follow it.
DERIVED: dict[str, str] = {
    "data.seed": "trainer.seed",
    "actor_rollout_ref.rollout.prompt_length": "data.max_prompt_length",
    "actor_rollout_ref.rollout.response_length": "data.max_response_length",
    "actor_rollout_ref.actor.clip_ratio_low": "actor_rollout_ref.actor.clip_ratio",
    "actor_rollout_ref.actor.clip_ratio_high": "actor_rollout_ref.actor.clip_ratio",
    "actor_rollout_ref.actor.use_remove_padding": "actor_rollout_ref.model.use_remove_padding",
    "actor_rollout_ref.actor.use_fused_kernels": "actor_rollout_ref.model.use_fused_kernels",
    "actor_rollout_ref.actor.checkpoint.load_contents": "actor_rollout_ref.actor.checkpoint.save_contents",
    "actor_rollout_ref.ref.strategy": "actor_rollout_ref.actor.strategy",
    "actor_rollout_ref.ref.use_torch_compile": "actor_rollout_ref.actor.use_torch_compile",
    "actor_rollout_ref.ref.log_prob_use_dynamic_bsz": "actor_rollout_ref.actor.use_dynamic_bsz",
    "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu": "actor_rollout_ref.actor.ppo_max_token_len_per_gpu",
    "actor_rollout_ref.ref.ulysses_sequence_parallel_size": "actor_rollout_ref.actor.ulysses_sequence_parallel_size",
    "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz": "actor_rollout_ref.actor.use_dynamic_bsz",
    "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu": "actor_rollout_ref.actor.ppo_max_token_len_per_gpu",
    # Unset log-prob micro-batches take the actor's training micro-batch (verl requires them; a
    # forward-only pass fits at least as many rows as a training one). See EXCLUSIVE below.
    "actor_rollout_ref.rollout.log_prob_micro_batch_size": "actor_rollout_ref.actor.ppo_micro_batch_size",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
    "actor_rollout_ref.ref.log_prob_micro_batch_size": "actor_rollout_ref.actor.ppo_micro_batch_size",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
    "critic.rollout_n": "actor_rollout_ref.rollout.n",
    "critic.model.tokenizer_path": "actor_rollout_ref.model.path",
    "critic.model.external_lib": "actor_rollout_ref.model.external_lib",
    "critic.model.trust_remote_code": "actor_rollout_ref.model.trust_remote_code",
    "critic.ppo_mini_batch_size": "actor_rollout_ref.actor.ppo_mini_batch_size",
    "critic.forward_micro_batch_size": "critic.ppo_micro_batch_size",
    "critic.forward_micro_batch_size_per_gpu": "critic.ppo_micro_batch_size_per_gpu",
    "critic.use_dynamic_bsz": "actor_rollout_ref.actor.use_dynamic_bsz",
    "critic.forward_max_token_len_per_gpu": "critic.ppo_max_token_len_per_gpu",
    "critic.ppo_epochs": "actor_rollout_ref.actor.ppo_epochs",
    "critic.shuffle": "actor_rollout_ref.actor.shuffle",
    "critic.loss_agg_mode": "actor_rollout_ref.actor.loss_agg_mode",
    "critic.checkpoint.load_contents": "critic.checkpoint.save_contents",
    "reward_model.model.input_tokenizer": "actor_rollout_ref.model.path",
    "reward_model.use_dynamic_bsz": "critic.use_dynamic_bsz",
    "reward_model.forward_max_token_len_per_gpu": "critic.forward_max_token_len_per_gpu",
}

# verl's global (deprecated) and per-device spellings of one size: a key is not derived while its
# partner is set, so that setting either one never makes both set.
EXCLUSIVE: dict[str, str] = {
    f"actor_rollout_ref.{role}.log_prob_micro_batch_size{suffix}": (
        f"actor_rollout_ref.{role}.log_prob_micro_batch_size{other}"
    )
    for role in ("rollout", "ref")
    for suffix, other in (("", "_per_gpu"), ("_per_gpu", ""))
}


def _split(key: str) -> tuple[str, str]:
    parent, _, leaf = key.rpartition(".")
    return parent, leaf


def _get(cfg: Any, key: str) -> Any:
    node = cfg
    for part in key.split("."):
        node = getattr(node, part)
    return node


def _set(cfg: Any, key: str, value: Any) -> None:
    parent, leaf = _split(key)
    setattr(_get(cfg, parent) if parent else cfg, leaf, value)


# ------------------------------------------------------------------------------------- overrides
def parse_override(text: str) -> tuple[str, str, bool]:
    """'+a.b=1' -> ('a.b', '1', True). Raises ConfigError for text that is not KEY=VALUE."""
    raw = text.strip()
    if raw.startswith("-"):
        raise ConfigError(
            f"{raw.split('=')[0]}: flags are not overrides; write KEY=VALUE (a YAML base: load_config_file)"
        )
    if raw.startswith("~"):
        raise ConfigError(f"{raw[1:].split('=')[0]}: deleting keys (~KEY) is not supported; set KEY=null")
    add = raw.startswith("+")
    raw = raw.lstrip("+")
    key, eq, value = raw.partition("=")
    key = key.strip()
    if not eq or not key:
        raise ConfigError(f"override {text!r} is not KEY=VALUE (e.g. data.train_batch_size=256)", key or None)
    return key, value, add


def apply_override(cfg: FulcrumConfig, text: str) -> None:
    """Apply one verl-style override (`a.b=1`, `+a.b=1`, `a.b=[x,y]`, `a.b=null`) to `cfg` in place.

    `+` adds a key only inside a free-form mapping (e.g. `+reward_model.reward_kwargs.k=1`); for a
    key the tree already has, `+` is accepted and means the same as no `+`.
    """
    key, value, add = parse_override(text)
    hint = " (+ adds keys only inside free-form mappings such as reward_model.reward_kwargs)" if add else ""
    node: Any = cfg
    parts = key.split(".")
    for i, part in enumerate(parts):
        path = ".".join(parts[: i + 1])
        last = i == len(parts) - 1
        if dataclasses.is_dataclass(node):
            types_ = field_types(type(node))
            if part not in types_:
                raise unknown_key_error(key, FulcrumConfig, hint)
            tp = types_[part]
            if last:
                if is_group(tp):
                    raise ConfigError(
                        f"{key}: is a group of keys; set one of them, e.g. {key}.NAME=VALUE", key
                    )
                if key == "actor_rollout_ref.rollout.name":
                    value = _alias_rollout_name(value)
                setattr(node, part, coerce(value, tp, key, from_cli=True))
                return
            child = getattr(node, part)
            if child is None and is_free_dict(tp):
                child = {}
                setattr(node, part, child)
            if not (is_group(tp) or is_free_dict(tp)):
                raise ConfigError(
                    f"{path}: is a single value ({type_name(tp)}), not a group; cannot set {key}", key
                )
            node = child
        else:  # inside a free-form mapping: any sub-key may be created
            if last:
                node[part] = parse_free(value)
                return
            child = node.get(part)
            if not isinstance(child, dict):
                child = node[part] = {}
            node = child


def _alias_rollout_name(value: Any) -> Any:
    if isinstance(value, str) and value.strip().strip("'\"") in ROLLOUT_NAME_ALIASES:
        name = value.strip().strip("'\"")
        log.warning(
            "actor_rollout_ref.rollout.name=%s: fulcrum has no %s backend; using %s",
            name,
            name,
            ROLLOUT_NAME_ALIASES[name],
        )
        return ROLLOUT_NAME_ALIASES[name]
    return value


# -------------------------------------------------------------------------------- dict <-> config
def to_dict(cfg: Any) -> dict[str, Any]:
    """The configuration as plain nested dicts/lists/scalars (what config.yaml holds)."""
    return dataclasses.asdict(cfg)


def from_dict(data: dict[str, Any], cls: type = FulcrumConfig, prefix: str = "") -> Any:
    """Build config dataclass `cls` from a (possibly partial) nested mapping; missing keys take defaults.

    verl yaml artefacts are skipped: `_target_` keys, Hydra's top-level `defaults`/`hydra`, `???` and `${...}` interpolations,
    which leave the default in place (fulcrum's defaults follow the same keys, see DERIVED).
    """
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix.rstrip('.') or '<root>'}: expected a mapping of keys, got {data!r}")
    types_ = field_types(cls)
    kwargs: dict[str, Any] = {}
    for name, value in data.items():
        key = f"{prefix}{name}"
        if name == "_target_" or (isinstance(value, str) and (value == "???" or "${" in value)):
            continue
        if not prefix and name in ("defaults", "hydra"):  # Hydra's composition lists, not keys
            continue
        if name not in types_:
            raise unknown_key_error(key, FulcrumConfig)
        tp = types_[name]
        if is_group(tp):
            kwargs[name] = from_dict(value or {}, tp, key + ".")
        else:
            if key == "actor_rollout_ref.rollout.name":
                value = _alias_rollout_name(value)
            kwargs[name] = coerce(value, tp, key)
    return cls(**kwargs)


def load_yaml(path: str | Path) -> FulcrumConfig:
    """A FulcrumConfig from a YAML file (a saved config.yaml, or a partial one), unresolved (see unresolve)."""
    path = Path(path)
    try:
        data = yaml.load(path.read_text(), Loader=_YAML_LOADER)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path} is not valid YAML: {exc}") from None
    try:
        return unresolve(from_dict(data or {}))
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}", exc.key) from None


def save_config(cfg: FulcrumConfig, path: str | Path) -> Path:
    """Write the (resolved) configuration as YAML; `load_config_file(path)` gives it back."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.dump(to_dict(cfg), Dumper=_YAML_DUMPER, sort_keys=False, default_flow_style=False))
    return path


# ---------------------------------------------------------------------------------- derived keys
def resolve(cfg: FulcrumConfig) -> FulcrumConfig:
    """Fill the keys that follow other keys (DERIVED) and the few computed defaults, in place.

    Idempotent, so a saved and reloaded configuration resolves to itself.
    """
    for key, source in DERIVED.items():
        partner = EXCLUSIVE.get(key)
        if _get(cfg, key) is None and (partner is None or _get(cfg, partner) is None):
            _set(cfg, key, copy.deepcopy(_get(cfg, source)))
    trainer = cfg.trainer
    if trainer.default_local_dir is None:
        trainer.default_local_dir = f"checkpoints/{trainer.project_name}/{trainer.experiment_name}"
    for role in (cfg.actor_rollout_ref.actor, cfg.critic):
        optim = role.optim
        if optim.warmup_style is not None:  # older verl name wins, as in verl
            optim.lr_scheduler_type = optim.warmup_style
        optim.warmup_style = optim.lr_scheduler_type
        if optim.clip_grad is not None:
            role.grad_clip = optim.clip_grad
        optim.clip_grad = role.grad_clip
    return cfg


def unresolve(cfg: FulcrumConfig) -> FulcrumConfig:
    """Undo resolve() where a saved value equals what it would follow, in place.

    So `load_config_file(saved, ["data.max_response_length=1024"])` moves rollout.response_length
    too, as it would have moved on the original command line. (A key set by hand to exactly the
    value it follows is indistinguishable and follows again.)
    """
    for key, source in reversed(DERIVED.items()):  # dependents before their sources are cleared
        if _get(cfg, key) is not None and _get(cfg, key) == _get(cfg, source):
            _set(cfg, key, None)
    trainer = cfg.trainer
    if trainer.default_local_dir == f"checkpoints/{trainer.project_name}/{trainer.experiment_name}":
        trainer.default_local_dir = None
    for role in (cfg.actor_rollout_ref.actor, cfg.critic):
        if role.optim.warmup_style == role.optim.lr_scheduler_type:
            role.optim.warmup_style = None
        if role.optim.clip_grad == role.grad_clip:
            role.optim.clip_grad = None
    return cfg


def load_config(
    overrides: list[str] | tuple[str, ...] = (), base: FulcrumConfig | None = None
) -> FulcrumConfig:
    """Defaults (or `base`), then each `KEY=VALUE` override in order, then derived keys.

    >>> cfg = load_config(["data.max_response_length=256", "trainer.logger=[console,tensorboard]"])
    >>> cfg.actor_rollout_ref.rollout.response_length, cfg.trainer.logger
    (256, ['console', 'tensorboard'])
    """
    if isinstance(overrides, str):
        raise ConfigError("load_config takes a list of KEY=VALUE strings, not one string")
    cfg = copy.deepcopy(base) if base is not None else FulcrumConfig()
    for text in overrides:
        apply_override(cfg, text)
    return resolve(cfg)


def load_config_file(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> FulcrumConfig:
    """A saved `config.yaml` (or any partial YAML in the same tree) plus overrides, resolved."""
    return load_config(overrides, base=load_yaml(path))


# ---------------------------------------------------------------------------------- key listing
@dataclass(frozen=True)
class KeyInfo:
    key: str
    type: str
    default: Any
    help: str
    no_effect: bool


def describe(root: Any = None, prefix: str = "") -> list[KeyInfo]:
    """Every settable key under `root` (default: a fresh FulcrumConfig) with type, default and help.

    Defaults are shown before derivation (a key that follows another shows null) and per group, so
    critic.optim.lr shows 1e-5 where actor_rollout_ref.actor.optim.lr shows 1e-6.
    """
    root = FulcrumConfig() if root is None else root
    infos: list[KeyInfo] = []
    cls = type(root)
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        tp = field_types(cls)[f.name]
        value = getattr(root, f.name)
        if is_group(tp):
            infos.extend(describe(value, key + "."))
        else:
            infos.append(KeyInfo(key, type_name(tp), value, f.metadata.get("help", ""), is_no_effect(key)))
    return infos


def _show(value: Any) -> str:
    """A default as it is written in an override: null, true, [a, b]."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return "[" + ", ".join(map(str, value)) + "]"
    return str(value)


def format_keys(infos: list[KeyInfo] | None = None) -> str:
    """describe() as text, one key a line: `key = default  # help  [type]`."""
    lines = []
    for info in infos if infos is not None else describe():
        note = " (no effect)" if info.no_effect and "no effect" not in info.help else ""
        lines.append(f"{info.key} = {_show(info.default)}  # {info.help}{note}  [{info.type}]")
    return "\n".join(lines)


def markdown_rows(keys: list[str]) -> str:
    """`| key | default | meaning |` rows for docs/configuration.md, from the schema (the one place)."""
    infos = {info.key: info for info in describe()}
    rows = []
    for key in keys:
        info = infos[key]
        shown = _show(info.default)
        meaning = info.help + (" (no effect)" if info.no_effect and "no effect" not in info.help else "")
        rows.append(f"| `{key}` | `{shown}` | {meaning.replace('|', '/')} |")
    return "\n".join(rows)
