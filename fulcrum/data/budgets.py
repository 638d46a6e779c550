"""Per-request response budgets: a data row may cap its own response length.

A row whose `extra_info` holds `max_response_length` (a positive integer, in tokens) is sampled with
at most min(that, data.max_response_length) response tokens, by the synchronous sampler and by partial
rollouts alike; rows without it get data.max_response_length. Long-tailed benchmarks draw these
per row (bench/long_tail.py). Multi-turn conversations keep the run's budget.
"""

from __future__ import annotations

from typing import Any

BUDGET_KEY = "max_response_length"


def budget_problem(extra_info: Any) -> str | None:
    """Why a row's `extra_info.max_response_length` is not usable (None when it is, or is absent)."""
    if not isinstance(extra_info, dict) or extra_info.get(BUDGET_KEY) is None:
        return None
    value = extra_info[BUDGET_KEY]
    # A parquet column of budgets may be float (pandas writes one where any row lacks a value): 8.0 is 8.
    whole = isinstance(value, int) or (isinstance(value, float) and value.is_integer())
    if isinstance(value, bool) or not whole or value < 1:
        return f"extra_info.{BUDGET_KEY} must be a positive integer (tokens), got {value!r}"
    return None


def response_budget(item: dict[str, Any], cap: int) -> int:
    """A prompt's response budget in tokens: min(extra_info.max_response_length, cap), else cap."""
    value = (item.get("extra_info") or {}).get(BUDGET_KEY)
    return cap if value is None else min(int(value), cap)
