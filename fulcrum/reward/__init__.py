"""Rule-based rewards: pick the scorer by `data_source`, or load a user's function from a Python file.

The built-in dispatch (`fulcrum.reward.sources`) is verl's `default_compute_score`: every data source
verl scores gets verl's score. A reward function has verl's signature
`fn(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None, **kwargs)`
and returns a float (or a dict with a "score" key, as verl allows).
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fulcrum.reward import gsm8k
from fulcrum.reward.sources import (
    BuiltinScorer,
    GroundTruthError,
    UnscoredSource,
    default_compute_score,
    family_of,
    scorer_name,
)

RewardFn = Callable[..., Any]


def scorer_for(data_source: str) -> Callable[[str, Any], Any]:
    """`fn(solution_str, ground_truth)` scoring as the built-in scorer of `data_source` does; an
    UnscoredSource (a ValueError) naming it when no built-in scorer covers it."""
    family_of(data_source)
    return functools.partial(default_compute_score, data_source)


def describe(fn: Any) -> str:
    """`name in file` of a reward function (or callable object, or partial), for error messages."""
    target = fn.func if isinstance(fn, functools.partial) else fn
    name = getattr(target, "__qualname__", None) or type(target).__qualname__
    for owner in (target, type(target)):
        try:
            return f"{name} in {inspect.getfile(owner)}"
        except TypeError:  # built-in: no file
            continue
    return name


def load_custom_reward_fn(
    path: str | Path, name: str = "compute_score", reward_kwargs: dict[str, Any] | None = None
) -> RewardFn:
    """Import function `name` from the Python file `path` (verl's `custom_reward_function.{path,name}`).

    `reward_kwargs` are bound as keyword arguments, as verl's `custom_reward_function.reward_kwargs`.
    Errors name the file and the function.
    """
    file = Path(path).expanduser()
    if not file.is_file():
        raise FileNotFoundError(f"custom_reward_function.path: reward function file not found: {file}")
    module_name = f"fulcrum_custom_reward_{abs(hash(str(file.resolve())))}"
    spec = importlib.util.spec_from_file_location(module_name, file)
    if spec is None or spec.loader is None:
        raise ImportError(f"custom_reward_function.path: cannot import {file} as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as err:
        del sys.modules[module_name]
        raise ImportError(f"custom_reward_function.path: importing {file} failed: {err!r}") from err
    fn = getattr(module, name, None)
    if fn is None or not callable(fn):
        functions = sorted(
            n for n, v in vars(module).items() if inspect.isfunction(v) and not n.startswith("_")
        )
        what = "is not callable" if fn is not None else "is not defined"
        raise AttributeError(
            f"custom_reward_function.name: {name!r} {what} in {file} (functions there: {', '.join(functions) or 'none'})"
        )
    return functools.partial(fn, **reward_kwargs) if reward_kwargs else fn


__all__ = [
    "BuiltinScorer",
    "GroundTruthError",
    "UnscoredSource",
    "default_compute_score",
    "describe",
    "family_of",
    "gsm8k",
    "load_custom_reward_fn",
    "scorer_for",
    "scorer_name",
]
