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
INTERACTION_ERRORS = "interaction/errors"  # and interaction/errors/{failed,timeout}: see fulcrum.agent.loop

# Why a call did not give the model a clean answer. The first four come from the Python tool's jail.
ERROR_KINDS: dict[str, str] = {
    "timeout": "ran past its wall-clock or CPU time limit and was killed",
    "memory": "ran out of its memory limit",
    "output_truncated": "printed more than the output limit; the rest was cut",
    "exception": "the model's code raised an exception, or was killed by a signal",
    "invalid_call": "the model's call could not be run: malformed JSON, arguments not an object, unknown tool",
    "tool_failed": "the tool itself raised (a bug or an outage in the tool, not the model's fault)",
    "call_timeout": "a call into the tool ran past multi_turn.call_timeout and was abandoned",
    "invalid_response": "the tool returned something that is not an answer (text not a string, reward not a number)",
    "invalid_expression": "the calculator refused the expression (not arithmetic, division by zero, too large)",
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


def spread(name: str, values: list[float]) -> dict[str, float]:
    """`name/min`, `name/max`, `name/mean` of `values` (verl's triple; nothing for no values)."""
    if not values:
        return {}
    return {f"{name}/min": min(values), f"{name}/max": max(values), f"{name}/mean": sum(values) / len(values)}


def conversation_metrics(num_turns: list[int], per_sample: list[Mapping[str, float]]) -> dict[str, float]:
    """A batch's multi-turn metrics from each conversation's turn count and counters.

    verl's: `num_turns/{min,max,mean}`, `tool_call_counts/{min,max,mean}` (calls per conversation),
    `agent_loop/generate_sequences/*` and `agent_loop/tool_calls/*` (seconds a conversation waited for
    its turns and its tools). Ours: `tools/calls`, `tools/errors`, `tools/errors/<kind>` and
    `interaction/errors[/<kind>]` as means per conversation (a kind no call had is 0), and `tools/call_rate`, the share of conversations that
    called a tool at least once.
    """
    n = len(per_sample)
    if n == 0:
        return {}
    out = spread("num_turns", [float(t) for t in num_turns])
    calls = [float(m.get(CALLS, 0.0)) for m in per_sample]
    out.update(spread("tool_call_counts", calls))
    for timing in ("agent_loop/generate_sequences", "agent_loop/tool_calls"):
        out.update(spread(timing, [float(m.get(timing, 0.0)) for m in per_sample]))
    keys = {CALLS, ERRORS} | {
        k for m in per_sample for k in m if k.startswith(f"{ERRORS}/") or k.startswith(INTERACTION_ERRORS)
    }
    totals = sum_metrics({k: m.get(k, 0.0) for k in keys} for m in per_sample)
    out.update({key: totals[key] / n for key in sorted(keys)})
    out["tools/call_rate"] = sum(1.0 for c in calls if c > 0) / n
    return out
