"""Rule-based rewards: pick the scorer by `data_source`, or load a user's function from a Python file.

A reward function has verl's signature
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

RewardFn = Callable[..., Any]

# Exact data_source names → scorer. Names that merely contain "gsm8k" go to the GSM8K scorer too
# (verl users rename their copies: "gsm8k", "my_org/gsm8k_clean", ...).
_SCORERS: dict[str, Callable[[str, str], float]] = {
    "openai/gsm8k": gsm8k.compute_score,
    # The project's built-in arithmetic task writes GSM8K-format answers (`#### n`).
    "synthetic/arithmetic": gsm8k.compute_score,
}


def scorer_for(data_source: str) -> Callable[[str, str], float]:
    """The rule-based scorer for `data_source`; a ValueError naming it when there is none."""
    if data_source in _SCORERS:
        return _SCORERS[data_source]
    if "gsm8k" in data_source.lower() or data_source.startswith("synthetic/"):
        return gsm8k.compute_score
    known = ", ".join(sorted(_SCORERS))
    raise ValueError(
        f"no reward function for data_source {data_source!r}: built-in scorers cover {known} and names "
        "containing 'gsm8k'; set custom_reward_function.path and custom_reward_function.name to score it"
    )


def default_compute_score(
    data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None, **kwargs: Any
) -> float:
    """Score one response with the built-in scorer of its data_source (verl's `default_compute_score`)."""
    return float(scorer_for(data_source)(solution_str, ground_truth))


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


__all__ = ["default_compute_score", "describe", "gsm8k", "load_custom_reward_fn", "scorer_for"]
