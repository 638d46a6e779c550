"""Registering functions or classes by the name a configuration key gives them (as verl's
`register_policy_loss` and `register_adv_est`): `algo.policy_losses`, `algo.advantages` and
`reward.managers` each keep one table."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

F = TypeVar("F", bound=Callable[..., object])


def registrar(table: dict[str, F], what: str) -> Callable[[str], Callable[[F], F]]:
    """A decorator factory that adds functions to `table` under a name. A second, different function
    under a taken name is an error, so a user's module cannot silently replace a built-in one."""

    def register(name: str) -> Callable[[F], F]:
        def add(fn: F) -> F:
            if table.get(name, fn) is not fn:
                raise ValueError(f"{what} {name!r} is already registered by {table[name].__module__}")
            table[name] = fn
            return fn

        return add

    return register
