"""Every key with its type, domain, default and one-line help: `fulcrum doctor --keys` and
docs/configuration.md."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from fulcrum.config.compat import is_no_effect
from fulcrum.config.domains import domain_of
from fulcrum.config.keys import field_types, is_group, type_name
from fulcrum.config.schema import FulcrumConfig


@dataclass(frozen=True)
class KeyInfo:
    key: str
    type: str
    default: Any
    help: str
    no_effect: bool
    domain: str | None = None  # the values a number accepts (fulcrum.config.domains); None: not a number


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
            domain = domain_of(f)
            infos.append(
                KeyInfo(
                    key,
                    type_name(tp),
                    value,
                    f.metadata.get("help", ""),
                    is_no_effect(key),
                    None if domain is None else str(domain),
                )
            )
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
    """describe() as text, one key a line: `key = default  # help  [type, domain]`."""
    lines = []
    for info in infos if infos is not None else describe():
        note = " (no effect)" if info.no_effect and "no effect" not in info.help else ""
        kind = info.type if info.domain is None else f"{info.type}, {info.domain}"
        lines.append(f"{info.key} = {_show(info.default)}  # {info.help}{note}  [{kind}]")
    return "\n".join(lines)


def markdown_rows(keys: list[str]) -> str:
    """`| key | default | domain | meaning |` rows for docs/configuration.md, from the schema (the one place)."""
    infos = {info.key: info for info in describe()}
    rows = []
    for key in keys:
        info = infos[key]
        shown = _show(info.default)
        domain = "" if info.domain is None else f"`{info.domain}`"
        meaning = info.help + (" (no effect)" if info.no_effect and "no effect" not in info.help else "")
        rows.append(f"| `{key}` | `{shown}` | {domain} | {meaning.replace('|', '/')} |")
    return "\n".join(rows)
