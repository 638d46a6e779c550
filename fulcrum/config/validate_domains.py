"""Each number of a configuration inside the domain its key declares (fulcrum.config.domains): one walk
over the tree of config dataclasses, shared by `fulcrum train` and `fulcrum doctor` through
fulcrum.config.validate."""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Union

from fulcrum.config.domains import Domain, domain_of
from fulcrum.config.finding import Finding
from fulcrum.config.keys import field_types


def _outside(value: Any, domain: Domain) -> bool:
    """True when a number (or any number of a list) lies outside `domain`; null and non-numbers pass."""
    if isinstance(value, list):
        return any(_outside(item, domain) for item in value)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    return value not in domain


def describe_domain(domain: Domain, tp: Any) -> str:
    """The domain as shown to users, `or null` added when the key's type allows null."""
    nullable = typing.get_origin(tp) in (Union, types.UnionType) and type(None) in typing.get_args(tp)
    return f"{domain} or null" if nullable else str(domain)


def domain_problems(node: Any, prefix: str = "") -> list[Finding]:
    """A finding for every value of the config dataclass `node` outside its key's domain."""
    problems: list[Finding] = []
    hints = field_types(type(node))
    for field in dataclasses.fields(node):
        value = getattr(node, field.name)
        key = f"{prefix}{field.name}"
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            problems += domain_problems(value, key + ".")
            continue
        domain = domain_of(field)
        if domain is not None and _outside(value, domain):
            each = " (each value)" if isinstance(value, list) else ""
            shown = describe_domain(domain, hints[field.name])
            problems.append(Finding((key,), f"{value} is outside its domain{each}: {shown}"))
    return problems
