"""The key tree as data: field types, every key path, readable type names, "did you mean" suggestions.

Works on any tree of config dataclasses (fulcrum's PPO keys, `fulcrum sft`'s keys).
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import types
import typing
from typing import Any, ClassVar, Literal, Union

from fulcrum.config.domains import DOMAIN, Domain


class ConfigError(ValueError):
    """A configuration problem; the message starts with the key it is about."""

    def __init__(self, message: str, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key


class Section:
    """A group of keys with one place in the tree, given as `class ActorConfig(Section,
    path="actor_rollout_ref.actor")`: `key("name")` is the full path of one of its keys, so a message or
    an override names a key without retyping where it lives."""

    PATH: ClassVar[str] = ""

    def __init_subclass__(cls, path: str = "", **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.PATH = path

    @classmethod
    def key(cls, name: str) -> str:
        """'ppo_micro_batch_size_per_gpu' -> 'actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu' (a
        dotted name reaches into a nested group, and any sub-key of a free-form mapping); KeyError for a
        name the section does not hold, at any depth."""
        node: Any = cls
        for part in name.split("."):
            if is_free_dict(node):
                break
            if not is_group(node) or part not in field_types(node):
                raise KeyError(f"{cls.PATH} has no key {name!r}")
            node = non_null(field_types(node)[part])
        return f"{cls.PATH}.{name}"


def opt(default: Any, help: str, domain: Domain | None = None) -> Any:
    """A config field with its default, one-line help and, for a number, the values it accepts
    (mutable defaults are copied per instance)."""
    metadata = {"help": help} if domain is None else {"help": help, DOMAIN: domain}
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda: copy.deepcopy(default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def sub(cls: type, help: str) -> Any:
    """A nested group of keys."""
    return dataclasses.field(default_factory=cls, metadata={"help": help})


@functools.cache
def field_types(cls: type) -> dict[str, Any]:
    """Field name -> resolved type of a config dataclass (string annotations evaluated once)."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def type_name(tp: Any) -> str:
    """A readable name for a field type: 'int', 'float or null', 'one of [fixed, adaptive]', 'list of str'."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of [" + ", ".join(str(a) for a in typing.get_args(tp)) + "]"
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        names = [type_name(a) for a in args if a is not type(None)]
        if type(None) in args:
            names.append("null")
        return " or ".join(names)
    if origin is list:
        (elem,) = typing.get_args(tp) or (Any,)
        return f"list of {type_name(elem)}"
    if origin is dict:
        return "mapping"
    if tp is Any:
        return "any value"
    return getattr(tp, "__name__", str(tp))


def non_null(tp: Any) -> Any:
    """`int | None` -> int; any other type unchanged."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if typing.get_origin(tp) in (Union, types.UnionType) and len(args) == 1:
        return args[0]
    return tp


def is_group(tp: Any) -> bool:
    """True for a nested dataclass group of keys."""
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def is_free_dict(tp: Any) -> bool:
    """True for a free-form mapping field (`dict[str, Any]`, optionally `| None`)."""
    if typing.get_origin(tp) is dict:
        return True
    args = typing.get_args(tp)
    return bool(args) and any(typing.get_origin(a) is dict for a in args)


@functools.cache
def all_keys(cls: type, prefix: str = "") -> tuple[str, ...]:
    """Every dotted key path under `cls`, groups included (depth-first, declaration order)."""
    keys: list[str] = []
    for name, tp in field_types(cls).items():
        path = f"{prefix}{name}"
        keys.append(path)
        if is_group(tp):
            keys.extend(all_keys(tp, path + "."))
    return tuple(keys)


# Names users reach for from other frameworks -> fulcrum's (verl's) leaf name; used only for suggestions.
SYNONYMS = {
    "learning_rate": "lr",
    "tp_size": "tensor_model_parallel_size",
    "tp": "tensor_model_parallel_size",
    "batch_size": "train_batch_size",
    "epochs": "total_epochs",
    "num_epochs": "total_epochs",
    "max_steps": "total_training_steps",
    "num_samples": "n",
    "num_generations": "n",
}


def suggest(key: str, root_cls: type) -> str | None:
    """The known key closest to an unknown `key`: its synonym, a path missing its leading groups,
    the closest full path, else the closest last segment."""
    known = all_keys(root_cls)
    parent, _, leaf = key.rpartition(".")
    if leaf in SYNONYMS:
        candidates = [k for k in known if k.endswith("." + SYNONYMS[leaf]) and k.startswith(parent)]
        if candidates:
            return candidates[0]
    # `actor.ppo_epochs` or a bare `ppo_mini_batch_size`: the first (actor before critic) known tail.
    tails = [k for k in known if k.endswith("." + key)]
    if tails:
        return tails[0]
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    if close:
        return close[0]
    leaves = {k.rpartition(".")[2] for k in known}
    near = difflib.get_close_matches(leaf, sorted(leaves), n=1, cutoff=0.75)
    if near:
        by_leaf = [k for k in known if k.rpartition(".")[2] == near[0]]
        by_leaf.sort(key=lambda k: -difflib.SequenceMatcher(None, k, key).ratio())
        return by_leaf[0]
    return None


def unknown_key_error(key: str, root_cls: type, hint: str = "") -> ConfigError:
    guess = suggest(key, root_cls)
    message = f"{key}: unknown key"
    if guess:
        message += f"; did you mean {guess}?"
    return ConfigError(message + hint, key)


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested dict (e.g. `to_dict(cfg)`) as {"a.b.c": value}; lists, scalars and empty dicts are leaves."""
    flat: dict[str, Any] = {}
    for name, value in tree.items():
        if isinstance(value, dict) and value:
            flat.update(flatten(value, f"{prefix}{name}."))
        else:
            flat[f"{prefix}{name}"] = value
    return flat


def get_path(cfg: Any, key: str) -> Any:
    """cfg.a.b.c for key 'a.b.c' (mappings included); raises ConfigError for an unknown key."""
    node = cfg
    for part in key.split("."):
        if dataclasses.is_dataclass(node) and part in field_types(type(node)):
            node = getattr(node, part)
        elif isinstance(node, dict) and part in node:
            node = node[part]
        else:
            raise unknown_key_error(key, type(cfg))
    return node
