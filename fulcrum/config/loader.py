"""Build a configuration with OmegaConf: the typed dataclasses, then a YAML base, then verl-style overrides,
then the keys that follow other keys while null (as `${...}` interpolations), resolved into dataclasses.

One API for every command: `load_config` (PPO keys, `fulcrum.config.schema`) and `fulcrum sft`
(`load_structured(SFTConfig, overrides)`) read overrides the same way and fail the same way: an unknown
key names the closest known one, a wrong value names the key and the type it expected.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import logging
import math
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException

from fulcrum.config.compat import ROLLOUT_NAME_ALIASES, reward_section_key
from fulcrum.config.keys import (
    ConfigError,
    field_types,
    get_path,
    is_free_dict,
    is_group,
    non_null,
    type_name,
    unknown_key_error,
)
from fulcrum.config.schema import FulcrumConfig, RolloutConfig

log = logging.getLogger("fulcrum.config")
T = TypeVar("T")

# key -> the key it follows while unset (null), like verl's `${oc.select:...}` interpolations. Each is
# written into the tree as the interpolation `${source}` when null, so chains resolve in any order.
DERIVED: dict[str, str] = {
    "data.seed": "trainer.seed",
    "actor_rollout_ref.rollout.seed": "trainer.seed",
    "actor_rollout_ref.rollout.prompt_length": "data.max_prompt_length",
    "actor_rollout_ref.rollout.response_length": "data.max_response_length",
    "actor_rollout_ref.actor.clip_ratio_low": "actor_rollout_ref.actor.clip_ratio",
    "actor_rollout_ref.actor.clip_ratio_high": "actor_rollout_ref.actor.clip_ratio",
    "actor_rollout_ref.actor.use_remove_padding": "actor_rollout_ref.model.use_remove_padding",
    "actor_rollout_ref.actor.use_fused_kernels": "actor_rollout_ref.model.use_fused_kernels",
    "actor_rollout_ref.actor.checkpoint.load_contents": "actor_rollout_ref.actor.checkpoint.save_contents",
    "actor_rollout_ref.ref.strategy": "actor_rollout_ref.actor.strategy",
    "actor_rollout_ref.ref.use_torch_compile": "actor_rollout_ref.actor.use_torch_compile",
    "actor_rollout_ref.ref.cuda_graphs": "actor_rollout_ref.actor.cuda_graphs",
    "critic.cuda_graphs": "actor_rollout_ref.actor.cuda_graphs",
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
    "trainer.default_local_dir": "checkpoints/${trainer.project_name}/${trainer.experiment_name}",
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


def _interpolation(source: str) -> str:
    return source if "${" in source else "${" + source + "}"


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
    key, eq, value = raw.lstrip("+").partition("=")
    key = key.strip()
    if not eq or not key:
        raise ConfigError(f"override {text!r} is not KEY=VALUE (e.g. data.train_batch_size=256)", key or None)
    return key, value.strip(), add


def _unquote(text: str) -> str:
    """'a b' or "a b" -> a b (one layer of matching quotes); anything else unchanged."""
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        return text[1:-1]
    return text


def _field_type(root_cls: type, key: str, hint: str = "") -> Any:
    """The declared type of `key` (None inside a free-form mapping). Raises ConfigError naming the key
    for an unknown key, a group given a value, or a key below a single value."""
    cls: Any = root_cls
    parts = key.split(".")
    for i, part in enumerate(parts):
        types_ = field_types(cls)
        if part not in types_:
            raise unknown_key_error(key, root_cls, hint)
        tp = types_[part]
        path = ".".join(parts[: i + 1])
        if i == len(parts) - 1:
            if is_group(tp):
                raise ConfigError(f"{key}: is a group of keys; set one of them, e.g. {key}.NAME=VALUE", key)
            return tp
        if is_free_dict(tp):
            return None
        if not is_group(tp):
            raise ConfigError(
                f"{path}: is a single value ({type_name(tp)}), not a group; cannot set {key}", key
            )
        cls = tp
    return None


def _typed_value(text: str, tp: Any, key: str) -> Any:
    """Override text -> the value to store: OmegaConf's dot-list reader (YAML) reads it (`1.5e-6`,
    `[a,b]`, `null`, `'quoted'`, `{a: 1}`); a text key keeps the text as written; stricter rules on top."""
    try:
        value = OmegaConf.to_container(OmegaConf.from_dotlist([f"v={text}"]))["v"]  # type: ignore[index]
    except (OmegaConfBaseException, yaml.YAMLError) as err:
        raise ConfigError(f"{key}: cannot read {text!r}: {str(err).splitlines()[0]}", key) from None
    if value is None or tp is None:
        return value
    base = non_null(tp)
    if base is str or typing.get_origin(base) is typing.Literal:
        return _unquote(text)  # `experiment_name=001` stays "001"
    # OmegaConf takes any integer as a bool and nan as a float; verl's users mean neither.
    if (base is bool and type(value) is int and value not in (0, 1)) or (base is float and _is_nan(value)):
        raise ConfigError(f"{key}: expected {type_name(tp)}, got {text!r}", key)
    if typing.get_origin(base) is list and not isinstance(value, list):
        return [value]  # `trainer.logger=console` means [console]
    return value


def _is_nan(value: Any) -> bool:
    try:
        return math.isnan(float(value))
    except (TypeError, ValueError):
        return False


def _alias_rollout_name(value: Any) -> Any:
    if isinstance(value, str) and value in ROLLOUT_NAME_ALIASES:
        log.warning(
            "%s=%s: fulcrum has no %s backend; using %s",
            RolloutConfig.key("name"),
            value,
            value,
            ROLLOUT_NAME_ALIASES[value],
        )
        return ROLLOUT_NAME_ALIASES[value]
    return value


def apply_override(node: DictConfig, text: str, root_cls: type = FulcrumConfig) -> None:
    """Apply one verl-style override (`a.b=1`, `+a.b=1`, `a.b=[x,y]`, `a.b=null`) to `node` in place.

    `+` adds a key only inside a free-form mapping (e.g. `+reward_model.reward_kwargs.k=1`); for a
    key the tree already has, `+` is accepted and means the same as no `+`.
    """
    key, text_value, add = parse_override(text)
    if key == "reward" or key.startswith("reward."):  # verl 0.9's reward section: the same settings
        try:
            mapped = reward_section_key(key, text_value)
        except ValueError as err:
            raise ConfigError(str(err), key) from None
        if mapped is None:
            return
        key = mapped
    hint = " (+ adds keys only inside free-form mappings such as reward_model.reward_kwargs)" if add else ""
    tp = _field_type(root_cls, key, hint)
    value = _typed_value(text_value, tp, key)
    if key == RolloutConfig.key("name"):
        value = _alias_rollout_name(value)
    parts = key.split(".")
    for i in range(1, len(parts)):  # a null free-form mapping becomes {} before a sub-key is set in it
        path = ".".join(parts[:i])
        if OmegaConf.select(node, path, throw_on_resolution_failure=False) is None:
            OmegaConf.update(node, path, {}, merge=False, force_add=True)
    try:
        OmegaConf.update(node, key, value, merge=False, force_add=tp is None)
    except OmegaConfBaseException:
        shown = "null" if value is None else repr(text_value)
        hint = f"; set its entries as {key}.NAME=VALUE or {key}={{a: 1}}" if is_free_dict(tp) else ""
        raise ConfigError(f"{key}: expected {type_name(tp)}, got {shown}{hint}", key) from None


@functools.cache
def _schema(root_cls: type) -> DictConfig:
    """OmegaConf's typed tree of the defaults, built once (it takes ~0.1 s); callers copy it."""
    return OmegaConf.structured(root_cls)


@functools.cache
def _free_dicts(cls: type, prefix: str = "") -> tuple[str, ...]:
    """Every free-form mapping key under `cls` (e.g. reward_model.reward_kwargs)."""
    keys: list[str] = []
    for name, tp in field_types(cls).items():
        if is_group(tp):
            keys.extend(_free_dicts(tp, f"{prefix}{name}."))
        elif is_free_dict(tp):
            keys.append(f"{prefix}{name}")
    return tuple(keys)


def _typed_tree(root_cls: type, data: dict[str, Any] | None = None) -> DictConfig:
    """The defaults of `root_cls` as an OmegaConf tree, with the nested mapping `data` merged in.

    A mapping given for a free-form key replaces its default (OmegaConf's merge would add to it),
    so a saved configuration reloads to exactly itself.
    """
    node = copy.deepcopy(_schema(root_cls))
    if data:
        for key in _free_dicts(root_cls):
            given: Any = data
            for part in key.split("."):
                given = given.get(part) if isinstance(given, dict) else None
            if isinstance(given, dict):
                OmegaConf.update(node, key, {}, merge=False)
        node.merge_with(data)
    return node


def overridden(base: type[T] | T, overrides: list[str] | tuple[str, ...] = ()) -> DictConfig:
    """OmegaConf's typed tree of dataclass `base` (a class: its defaults) with each override applied."""
    if isinstance(overrides, str):
        raise ConfigError("overrides are a list of KEY=VALUE strings, not one string")
    root_cls = base if isinstance(base, type) else type(base)
    node = _typed_tree(root_cls, None if isinstance(base, type) else dataclasses.asdict(base))
    for text in overrides:
        apply_override(node, text, root_cls)
    return node


def load_structured(base: type[T] | T, overrides: list[str] | tuple[str, ...] = ()) -> T:
    """Config dataclass `base` with verl-style overrides applied (no derived keys: see load_config)."""
    return OmegaConf.to_object(overridden(base, overrides))  # type: ignore[return-value]


# -------------------------------------------------------------------------------- derived keys
def _follow(node: DictConfig) -> DictConfig:
    """Point each null key of DERIVED at the key it follows (an interpolation), in place."""
    for key, source in DERIVED.items():
        partner = EXCLUSIVE.get(key)
        if OmegaConf.select(node, key) is None and (
            partner is None or OmegaConf.select(node, partner) is None
        ):
            OmegaConf.update(node, key, _interpolation(source), merge=False)
    return node


def _older_names_win(cfg: FulcrumConfig) -> FulcrumConfig:
    """verl's older spellings (optim.warmup_style, optim.clip_grad) win when set; both then agree."""
    for role in (cfg.actor_rollout_ref.actor, cfg.critic):
        optim = role.optim
        if optim.warmup_style is not None:
            optim.lr_scheduler_type = optim.warmup_style
        optim.warmup_style = optim.lr_scheduler_type
        if optim.clip_grad is not None:
            role.grad_clip = optim.clip_grad
        optim.clip_grad = role.grad_clip
    return cfg


def resolve(node: DictConfig | FulcrumConfig) -> FulcrumConfig:
    """The resolved configuration: keys that follow other keys (DERIVED) take their value, older names
    win. Idempotent, so a saved and reloaded configuration resolves to itself."""
    node = node if isinstance(node, DictConfig) else _typed_tree(FulcrumConfig, dataclasses.asdict(node))
    try:
        cfg: FulcrumConfig = OmegaConf.to_object(_follow(node))  # type: ignore[assignment]
    except OmegaConfBaseException as err:
        key = getattr(err, "full_key", None)
        raise ConfigError(f"{key}: {str(err).splitlines()[0]}", key) from None
    return _older_names_win(cfg)


def unresolve(cfg: FulcrumConfig) -> FulcrumConfig:
    """Undo resolve() where a saved value equals what it would follow, in place.

    So `load_config_file(saved, ["data.max_response_length=1024"])` moves rollout.response_length
    too, as it would have moved on the original command line. (A key set by hand to exactly the
    value it follows is indistinguishable and follows again.)
    """
    resolved = OmegaConf.create({**to_dict(cfg), "_follows": None})  # values before any is cleared
    for key, source in DERIVED.items():
        resolved._follows = _interpolation(source)
        if get_path(cfg, key) is not None and get_path(cfg, key) == resolved._follows:
            parent, _, leaf = key.rpartition(".")
            setattr(get_path(cfg, parent), leaf, None)
    for role in (cfg.actor_rollout_ref.actor, cfg.critic):
        if role.optim.warmup_style == role.optim.lr_scheduler_type:
            role.optim.warmup_style = None
        if role.optim.clip_grad == role.grad_clip:
            role.optim.clip_grad = None
    return cfg


# -------------------------------------------------------------------------------- load and save
def load_config(
    overrides: list[str] | tuple[str, ...] = (), base: FulcrumConfig | None = None
) -> FulcrumConfig:
    """Defaults (or `base`), then each `KEY=VALUE` override in order, then derived keys.

    >>> cfg = load_config(["data.max_response_length=256", "trainer.logger=[console,tensorboard]"])
    >>> cfg.actor_rollout_ref.rollout.response_length, cfg.trainer.logger
    (256, ['console', 'tensorboard'])
    """
    return resolve(overridden(base if base is not None else FulcrumConfig, overrides))


def _drop_verl_artefacts(data: dict[str, Any], top: bool) -> dict[str, Any]:
    """verl yaml artefacts leave the default in place: `_target_` keys, Hydra's top-level
    `defaults`/`hydra`, `???` and `${...}` interpolations (fulcrum's defaults follow the same keys)."""
    kept = {}
    for name, value in data.items():
        if name == "_target_" or (top and name in ("defaults", "hydra")):
            continue
        if isinstance(value, str) and (value == "???" or "${" in value):
            continue
        kept[name] = _drop_verl_artefacts(value, False) if isinstance(value, dict) else value
    return kept


def _with_reward_section(data: dict[str, Any], path: Path) -> dict[str, Any]:
    """A verl 0.9 file's `reward:` section moved onto the keys of the same meaning (reward_section_key)."""
    section = data.pop("reward")

    def leaves(node: Any, prefix: str) -> list[tuple[str, Any]]:
        if isinstance(node, dict) and node and not prefix.endswith(("_kwargs", ".rollout")):
            return [kv for k, v in node.items() for kv in leaves(v, f"{prefix}.{k}")]
        return [(prefix, node)]

    for key, value in leaves(section, "reward"):
        try:
            mapped = reward_section_key(key, "null" if value is None else str(value))
        except ValueError as err:
            raise ConfigError(f"{path}: {err}", key) from None
        if mapped is None:
            continue
        node = data
        *parents, leaf = mapped.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return data


def load_yaml(path: str | Path, root_cls: type = FulcrumConfig) -> Any:
    """A config dataclass from a YAML file (a saved config.yaml, or a partial one); PPO configs come
    back unresolved (see unresolve)."""
    path = Path(path)
    try:
        data = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except (yaml.YAMLError, OmegaConfBaseException) as exc:
        raise ConfigError(f"config file {path} is not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of keys, got {data!r}")
    data = _drop_verl_artefacts(data, top=True)
    if root_cls is FulcrumConfig and isinstance(data.get("reward"), dict):
        data = _with_reward_section(data, path)
    rollout = data.get("actor_rollout_ref", {}).get("rollout") if root_cls is FulcrumConfig else None
    if isinstance(rollout, dict) and "name" in rollout:
        rollout["name"] = _alias_rollout_name(rollout["name"])
    try:
        cfg = OmegaConf.to_object(_typed_tree(root_cls, data))
    except (ConfigKeyError, ConfigAttributeError) as err:
        raise ConfigError(f"{path}: {unknown_key_error(str(err.full_key), root_cls)}", err.full_key) from None
    except OmegaConfBaseException as err:
        key = str(err.full_key)
        value = getattr(err, "value", None)
        shown = "null" if value is None else repr(value)
        expected = type_name(_field_type(root_cls, key)) if key else "a mapping of keys"
        raise ConfigError(f"{path}: {key}: expected {expected}, got {shown}", key) from None
    return unresolve(cfg) if root_cls is FulcrumConfig else cfg


def load_config_file(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> FulcrumConfig:
    """A saved `config.yaml` (or any partial YAML in the same tree) plus overrides, resolved."""
    return load_config(overrides, base=load_yaml(path))


def to_dict(cfg: Any) -> dict[str, Any]:
    """The configuration as plain nested dicts/lists/scalars (what config.yaml holds)."""
    return dataclasses.asdict(cfg)


def save_config(cfg: Any, path: str | Path) -> Path:
    """Write a (resolved) configuration dataclass as YAML; `load_config_file(path)` gives it back."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(OmegaConf.create(to_dict(cfg)), path)
    return path
