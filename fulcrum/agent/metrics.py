"""The counters one tool call reports, and how calls add up.

Each call returns a flat dict of numbers: `tools/calls` = 1, `tools/errors` = 1 when anything went wrong
(else 0), and `tools/errors/<kind>` = 1 for each kind that happened. The agent loop sums the dicts of a
conversation's calls (`sum_metrics`) and the trainer averages them over the batch, so a dashboard shows
calls per conversation and the share of each failure. A call can have two kinds at once (a program that
printed megabytes and then raised is both `output_truncated` and `exception`) but counts as one error.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

CALLS = "tools/calls"
ERRORS = "tools/errors"

# Why a call did not give the model a clean answer. The first five come from the Python sandbox.
ERROR_KINDS: dict[str, str] = {
    "timeout": "ran past its wall-clock or CPU time limit and was killed",
    "memory": "ran out of its memory limit",
    "output_truncated": "printed more than the output limit; the rest was cut",
    "refused": "tried something the sandbox refuses (files outside its directory, processes, network, ctypes)",
    "exception": "the model's code raised an exception",
    "invalid_call": "the model's call could not be run: malformed JSON, arguments not an object, unknown tool",
    "tool_failed": "the tool itself raised (a bug or an outage in the tool, not the model's fault)",
}


def error_key(kind: str) -> str:
    """`tools/errors/<kind>`; a KeyError for a kind not in ERROR_KINDS, so that typos cannot hide."""
    if kind not in ERROR_KINDS:
        raise KeyError(f"unknown tool error kind {kind!r}; known: {', '.join(ERROR_KINDS)}")
    return f"{ERRORS}/{kind}"


def call_metrics(kinds: Iterable[str] = ()) -> dict[str, float]:
    """The counters of one call whose failures are `kinds` (empty: a clean call). A user's tool may
    report kinds of its own (`tools/errors/<its kind>`); they are counted like fulcrum's."""
    kinds = sorted(set(kinds))
    out: dict[str, float] = {CALLS: 1.0, ERRORS: 1.0 if kinds else 0.0}
    for kind in kinds:
        out[f"{ERRORS}/{kind}"] = 1.0
    return out


def error_kinds(metrics: Mapping[str, float]) -> set[str]:
    """The kinds a call's counters report."""
    prefix = f"{ERRORS}/"
    return {key[len(prefix) :] for key, value in metrics.items() if key.startswith(prefix) and value}


def sum_metrics(all_metrics: Iterable[Mapping[str, float]]) -> dict[str, float]:
    """Key-wise sum of several calls' counters (keys missing from a call count as 0)."""
    total: dict[str, float] = {}
    for metrics in all_metrics:
        for key, value in metrics.items():
            total[key] = total.get(key, 0.0) + float(value)
    return total
