"""Turn override text (`1.5e-6`, `[console,tensorboard]`, `null`, `'a b'`) or YAML values into typed values.

Coercion is directed by the dataclass field's type, so `1e-5` is a float in a float field and a
string in a string field, and an error can say what the key expected and what it was given.
"""

from __future__ import annotations

import re
import types
import typing
from typing import Any, Literal, Union

import yaml


class ConfigError(ValueError):
    """A configuration problem; the message starts with the key it is about."""

    def __init__(self, message: str, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key


NULL_WORDS = frozenset({"null", "None", "~", "NULL", "Null"})
# What OmegaConf (and so verl) takes for a bool, compared lower-cased.
TRUE_WORDS = frozenset({"true", "yes", "on", "y", "1"})
FALSE_WORDS = frozenset({"false", "no", "off", "n", "0"})
_INT_RE = re.compile(r"^[-+]?\d+$")
_FLOAT_RE = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$|^[-+]?inf$", re.IGNORECASE)


def unquote(text: str) -> str:
    """'a b' or "a b" -> a b (one layer of matching quotes); anything else unchanged."""
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        return text[1:-1]
    return text


def split_list(text: str) -> list[str]:
    """'[a, "b,c", [1,2]]' -> ['a', '"b,c"', '[1,2]']: split on commas outside quotes and brackets."""
    inner = text.strip()[1:-1]
    items: list[str] = []
    depth, quote, start = 0, "", 0
    for i, ch in enumerate(inner):
        if quote:
            if ch == quote:
                quote = ""
        elif ch in "'\"":
            quote = ch
        elif ch in "[{":
            depth += 1
        elif ch in "]}":
            depth -= 1
        elif ch == "," and depth == 0:
            items.append(inner[start:i].strip())
            start = i + 1
    last = inner[start:].strip()
    if last or items:
        items.append(last)
    return items


def parse_free(text: str) -> Any:
    """Value of a free-form key (type Any) from override text: null, bool, int, float, list, dict or str."""
    text = text.strip()
    if text in NULL_WORDS:
        return None
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    if _INT_RE.match(text):
        return int(text)
    if _FLOAT_RE.match(text):
        return float(text)
    if text.startswith("[") and text.endswith("]"):
        return [parse_free(item) for item in split_list(text)]
    if text.startswith("{") and text.endswith("}"):
        try:
            return yaml.safe_load(text)
        except yaml.YAMLError:
            return text
    return unquote(text)


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


def _fail(key: str, tp: Any, value: Any) -> ConfigError:
    shown = "null" if value is None else repr(value)
    return ConfigError(f"{key}: expected {type_name(tp)}, got {shown}", key)


def coerce(value: Any, tp: Any, key: str, from_cli: bool = False) -> Any:
    """Convert `value` (override text when `from_cli`, else a YAML/python value) to field type `tp`.

    Raises ConfigError naming `key`, the expected type and the given value.
    """
    if isinstance(value, str) and from_cli:
        value = value.strip()
    origin = typing.get_origin(tp)

    if tp is Any:
        return parse_free(value) if (from_cli and isinstance(value, str)) else value

    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None or (isinstance(value, str) and from_cli and value in NULL_WORDS):
            if type(None) in args:
                return None
            raise _fail(key, tp, None)
        # '[a,b]' becomes a list in a `str | list[str]` field and a bare path stays a string:
        # containers first for bracketed text, scalars first otherwise; str always last of its kind.
        options = [a for a in args if a is not type(None)]
        bracketed = not isinstance(value, str) or value.startswith(("[", "{"))

        def rank(arg: Any) -> tuple[bool, bool]:
            container = typing.get_origin(arg) in (list, dict)
            return (container != bracketed, arg is str)

        ordered = sorted(options, key=rank)
        for arg in ordered:
            try:
                return coerce(value, arg, key, from_cli)
            except ConfigError:
                continue
        raise _fail(key, tp, value)

    if value is None or (from_cli and isinstance(value, str) and value in NULL_WORDS):
        raise _fail(key, tp, None)

    if origin is Literal:
        choices = typing.get_args(tp)
        text = unquote(value) if isinstance(value, str) else value
        if text in choices:
            return text
        raise ConfigError(f"{key}: expected one of [{', '.join(map(str, choices))}], got {value!r}", key)

    if tp is bool:
        if isinstance(value, bool):
            return value
        word = unquote(value).lower() if isinstance(value, str) else value
        if isinstance(word, int) and word in (0, 1):
            return bool(word)
        if isinstance(word, str) and word in TRUE_WORDS | FALSE_WORDS:
            return word in TRUE_WORDS
        raise _fail(key, tp, value)

    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str) and _INT_RE.match(unquote(value)):
            return int(unquote(value))
        raise _fail(key, tp, value)

    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str) and _FLOAT_RE.match(unquote(value)):
            return float(unquote(value))
        raise _fail(key, tp, value)

    if tp is str:
        if isinstance(value, str):
            return unquote(value) if from_cli else value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)  # a YAML `experiment_name: 123`
        raise _fail(key, tp, value)

    if origin is list:
        (elem,) = typing.get_args(tp) or (Any,)
        if isinstance(value, str) and from_cli:
            if value.startswith("[") and value.endswith("]"):
                return [coerce(item, elem, f"{key}[{i}]", True) for i, item in enumerate(split_list(value))]
            return [coerce(value, elem, key, True)]  # `trainer.logger=console` means [console]
        if isinstance(value, (list, tuple)):
            return [coerce(item, elem, f"{key}[{i}]") for i, item in enumerate(value)]
        raise _fail(key, tp, value)

    if origin is dict:
        if isinstance(value, str) and from_cli:
            parsed = parse_free(value)
            if isinstance(parsed, dict):
                return parsed
        if isinstance(value, dict):
            return dict(value)
        raise ConfigError(
            f"{key}: expected a mapping, got {value!r}; set its entries as {key}.NAME=VALUE or {key}={{a: 1}}",
            key,
        )

    raise ConfigError(f"{key}: cannot set a value of type {type_name(tp)} from {value!r}", key)
