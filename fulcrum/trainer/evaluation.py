"""Validation metrics as verl computes them, shared by the trainer's validation and `fulcrum eval`.

Per data source and per scored variable ("reward": each response's score; the reward function's other
numeric keys, e.g. math_dapo's "acc"; "flexible": GSM8K's flexible-extraction score beside the strict
one), over the N responses of each prompt (verl's `process_validation_metrics`):

- `mean@N`, `std@N`: the mean and standard deviation over a prompt's N responses;
- `best@n/mean`, `worst@n/mean` (and `/std`), n = 2, 4, 8, ... < N and N: the best and worst of n
  responses drawn with replacement, averaged over 1000 bootstrap draws (numpy seed 42, as verl);
- `maj@n/mean` (and `/std`) when the responses carry a "pred": the value of the most voted prediction;

each then averaged over prompts. Named `val-core/<source>/<var>/<metric>` for the core variable ("acc"
when present, else "reward") at n = N and mean/maj/best, `val-aux/...` otherwise, as verl names them.
Beside them, `val-aux/<source>/<var>/pass@k` for k = 1, 2, 4, ... N: the unbiased estimate
1 - C(N - c, k) / C(N, k) with c the responses scoring above 0 (Chen et al. 2021), averaged over prompts.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from math import comb
from typing import Any

import numpy as np

N_BOOTSTRAP = 1000
SEED = 42


def sample_sizes(n: int) -> list[int]:
    """verl's n for best@n / maj@n: 2, 4, 8, ... below N, then N itself; [] for N <= 1."""
    if n <= 1:
        return []
    sizes, k = [], 2
    while k < n:
        sizes.append(k)
        k *= 2
    return [*sizes, n]


def bootstrap(
    data: Sequence[Any], size: int, reduce_fns: list[Callable[[np.ndarray], float]], seed: int = SEED
) -> list[tuple[float, float]]:
    """(mean, std) of each reduction over N_BOOTSTRAP draws of `size` items with replacement; the draws
    are numpy's global generator seeded with `seed`, one (N_BOOTSTRAP, size) matrix, as verl draws them."""
    np.random.seed(seed)
    items = np.array(data, dtype=object)
    draws = np.random.choice(len(items), size=(N_BOOTSTRAP, size), replace=True)
    out = []
    for fn in reduce_fns:
        values = np.array([fn(items[row]) for row in draws], dtype=np.float64)
        out.append((float(values.mean()), float(values.std())))
    return out


def majority_value(votes: np.ndarray) -> float:
    """The value of the first response with the most common prediction (items are (pred, value))."""
    by_pred: dict[Any, list[float]] = defaultdict(list)
    for pred, value in votes:
        by_pred[pred].append(value)
    top = max(by_pred, key=lambda p: len(by_pred[p]))
    return by_pred[top][0]


def pass_at_k(n: int, c: int, k: int) -> float:
    """1 - C(n - c, k) / C(n, k): the chance that k of n responses, c of them correct, hold a correct one."""
    return 1.0 if n - c < k else 1.0 - comb(n - c, k) / comb(n, k)


def prompt_metrics(values: list[float], preds: list[Any] | None) -> dict[str, float]:
    """mean@N, std@N, best/worst@n and maj@n of one prompt's N values (see the module docstring)."""
    n = len(values)
    out = {f"mean@{n}": float(np.mean(values))}
    if n <= 1:
        return out
    out[f"std@{n}"] = float(np.std(values))
    for k in sample_sizes(n):
        (best, best_std), (worst, worst_std) = bootstrap(values, k, [np.max, np.min])
        out.update({f"best@{k}/mean": best, f"best@{k}/std": best_std})
        out.update({f"worst@{k}/mean": worst, f"worst@{k}/std": worst_std})
        if preds is not None:
            [(maj, maj_std)] = bootstrap(list(zip(preds, values, strict=True)), k, [majority_value])
            out.update({f"maj@{k}/mean": maj, f"maj@{k}/std": maj_std})
    return out


def process_validation_metrics(
    data_sources: Sequence[str], uids: Sequence[Any], infos: dict[str, list[Any]]
) -> dict[str, dict[str, dict[str, float]]]:
    """{source: {var: {metric: value averaged over prompts}}}, as verl's function of the same name;
    string-valued variables ("pred") only vote."""
    grouped: dict[str, dict[Any, dict[str, list[Any]]]] = defaultdict(
        lambda: defaultdict(lambda: defaultdict(list))
    )
    for i, source in enumerate(data_sources):
        for name, column in infos.items():
            grouped[source][uids[i]][name].append(column[i])
    collected: dict[str, dict[str, dict[str, list[float]]]] = defaultdict(
        lambda: defaultdict(lambda: defaultdict(list))
    )
    for source, prompts in grouped.items():
        for columns in prompts.values():
            preds = columns.get("pred")
            for name, values in columns.items():
                if not values or isinstance(values[0], str):
                    continue
                for metric, value in prompt_metrics([float(v) for v in values], preds).items():
                    collected[source][name][metric].append(value)
                c = sum(float(v) > 0 for v in values)
                for k in [1, *sample_sizes(len(values))]:
                    collected[source][name][f"pass@{k}"].append(pass_at_k(len(values), c, k))
    return {
        source: {
            name: {m: float(np.mean(v)) for m, v in metrics.items()} for name, metrics in variables.items()
        }
        for source, variables in collected.items()
    }


def named_metrics(by_source: dict[str, dict[str, dict[str, float]]]) -> dict[str, float]:
    """verl's names: val-core for the core variable's mean/maj/best at the largest n, val-aux else."""
    out = {}
    for source, variables in by_source.items():
        core = "acc" if "acc" in variables else "reward"
        for name, metrics in variables.items():
            n_max = max(int(m.split("@")[-1].split("/")[0]) for m in metrics if not m.startswith("pass@"))
            for metric, value in metrics.items():
                is_core = (
                    name == core and metric.split("@")[0] in ("mean", "maj", "best") and f"@{n_max}" in metric
                )
                out[f"{'val-core' if is_core else 'val-aux'}/{source}/{name}/{metric}"] = value
    return out


def validation_infos(
    scores: Sequence[float],
    extra: dict[str, list[Any]],
    texts: Sequence[str],
    ground_truths: Sequence[Any],
    data_sources: Sequence[str],
) -> dict[str, list[Any]]:
    """The variables verl validates: "reward" (the scores), the reward function's other keys whose values
    are numbers or bools (and "pred", for votes), and, for GSM8K sources, "flexible"."""
    from fulcrum.reward import family_of, gsm8k
    from fulcrum.reward.sources import GSM8K

    infos: dict[str, list[Any]] = {"reward": [float(s) for s in scores]}
    for key, column in extra.items():
        if key == "pred":
            infos[key] = [str(v) for v in column]
        elif all(isinstance(v, (bool, int, float)) for v in column):
            infos[key] = [float(v) for v in column]

    def is_gsm8k(source: str) -> bool:
        try:
            return family_of(source) is GSM8K
        except ValueError:
            return False

    if texts and all(is_gsm8k(s) for s in data_sources):
        infos["flexible"] = [
            gsm8k.compute_score(t, str(g), method="flexible")
            for t, g in zip(texts, ground_truths, strict=True)
        ]
    return infos


def validation_metrics(
    data_sources: Sequence[str], uids: Sequence[Any], infos: dict[str, list[Any]]
) -> dict[str, float]:
    """Every validation metric under verl's names (see the module docstring)."""
    return named_metrics(process_validation_metrics(data_sources, uids, infos))


def measure_generations(
    rows: list[dict[str, Any]], scores: Sequence[float], extra: dict[str, list[Any]], uids: Sequence[Any]
) -> dict[str, float]:
    """verl's validation metrics of scored generation rows (`output`, `gts`, `data_source` each), the
    responses of one prompt sharing a uid; each row gets its score and its other validated variables
    (GSM8K's "flexible", the reward function's numeric keys)."""
    sources = [row["data_source"] for row in rows]
    texts = [row["output"] for row in rows]
    infos = validation_infos(scores, extra, texts, [row["gts"] for row in rows], sources)
    for name, column in infos.items():
        for row, value in zip(rows, column, strict=True):
            row["score" if name == "reward" else name] = value
    return validation_metrics(sources, uids, infos)
