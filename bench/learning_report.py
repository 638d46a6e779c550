"""bench/learning.py's results: curves from run directories, the summary, its markdown and the plot.

One code path for both modes: the algorithms x seeds grid (per run, then mean +/- std per algorithm)
and `--variants` (one run per variant, labelled by its name, with the KL at the end and its peak; no
averages, since each variant is one seed).

python bench/learning.py --plot SUMMARY.json     # draws learning_curves.png beside it (matplotlib)
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from learning_variants import without_seed

# The validation-accuracy curve's name; a run's own key is `val-core/<data_source>/reward/mean@1` (the
# multi-step task's or GSM8K's), found by `val_key_of`.
VAL_KEY = "val-core/synthetic/multistep/reward/mean@1"


def val_key_of(row: dict) -> str | None:
    """The row's greedy validation accuracy key, whatever the data source (one source per run here)."""
    return next((k for k in row if k.startswith("val-core/") and k.endswith("/reward/mean@1")), None)


# (metric, title) per curve panel; the KL is the actor's KL loss to the reference (both algorithms).
CURVES = [
    ("critic/score/mean", "reward (train samples)"),
    (VAL_KEY, "greedy validation accuracy"),
    ("actor/kl_loss", "KL(actor || reference)"),
    ("actor/entropy", "entropy"),
    ("response_length/mean", "response length"),
    ("critic/vf_explained_var", "critic explained variance (PPO)"),
]


@dataclass
class RunResult:
    algo: str
    seed: int
    exit_code: int | None
    stopped_by_budget: bool
    curves: dict[str, list[list[float]]] = field(default_factory=dict)  # metric -> [[minutes, step, value]]
    val: list[list[float]] = field(default_factory=list)  # [[minutes, step, accuracy]]
    last_step: int = 0  # the last training step it logged
    error: str = ""  # the run's own last words when it died (e.g. out of device memory)
    variant: str = ""  # its --variants name; "" in the algorithms x seeds grid
    # strict/flexible accuracy, format rate, response length of its first and last validation
    # (`trainer.validation_data_dir` dumps), {"first": {...}, "last": {...}}; {} when none
    generations: dict[str, dict[str, float]] = field(default_factory=dict)

    @property
    def label(self) -> str:
        """Its name in the summary and the curves, and its folder under `rl/`."""
        return self.variant or f"{self.algo}-s{self.seed}"

    @property
    def failed(self) -> bool:
        """Ended on its own with an error, not stopped by the budget: its figures are not a result."""
        return not self.stopped_by_budget and self.exit_code not in (0, None)


def curves_of(rows: list[dict]) -> tuple[dict[str, list[list[float]]], list[list[float]]]:
    """Per metric [[minutes of RL, step, value]]; minutes are the sum of `timing_s/step` (validation included)."""
    curves: dict[str, list[list[float]]] = {k: [] for k, _ in CURVES}
    val: list[list[float]] = []
    seconds = 0.0
    for row in rows:
        step = int(row.get("training/global_step", 0))
        seconds += float(row.get("timing_s/step", 0.0))
        for key in curves:
            if key in row and key != VAL_KEY:
                curves[key].append([seconds / 60, step, float(row[key])])
        key = val_key_of(row)
        if key is not None:
            val.append([seconds / 60, step, float(row[key])])
    curves[VAL_KEY] = val
    return curves, val


def _spread(values: list[float]) -> dict[str, float]:
    return {
        "mean": statistics.fmean(values),
        "std": statistics.stdev(values) if len(values) > 1 else 0.0,
        "min": min(values),
        "max": max(values),
    }


def _tail_mean(points: list[list[float]]) -> float | None:
    """Mean of the last 5 values of a curve ([[minutes, step, value]]): its level at the end."""
    return statistics.fmean(v for _, _, v in points[-5:]) if points else None


def _run_row(r: RunResult) -> dict:
    """One run's summary row; a variant's also has its name and its KL at the end and at its peak."""
    if r.failed or not r.val:
        row: dict[str, Any] = {
            "algo": r.algo,
            "seed": r.seed,
            "exit_code": r.exit_code,
            "failed_at_step": r.last_step,
            "error": r.error or "no validation",
        }
    else:
        row = {
            "algo": r.algo,
            "seed": r.seed,
            "steps": int(r.val[-1][1]),
            "minutes": r.val[-1][0],
            "step0_accuracy": r.val[0][2],
            "final_accuracy": r.val[-1][2],
            "best_accuracy": max(v for _, _, v in r.val),
            "gain": r.val[-1][2] - r.val[0][2],
            "final_explained_variance": _tail_mean(r.curves.get("critic/vf_explained_var", [])),
        }
        if r.generations:
            row["generations"] = r.generations
        if r.variant:  # the grid's rows keep their keys
            kl = r.curves.get("actor/kl_loss", [])
            row["final_kl"] = _tail_mean(kl)
            row["peak_kl"] = max((v for _, _, v in kl), default=None)
    return {"variant": r.variant, **row} if r.variant else row


def summarise(
    warm: dict, results: list[RunResult], plan: Any, variants: dict[str, list[str]] | None = None
) -> dict:
    """Per run: accuracy at step 0, at the last validation and the best; per algorithm mean ± std and
    range; with `variants` (name -> its overrides; one run each) the variants listed, and averages only
    over variants that are seeds of one setting (`seeds_of_settings`)."""
    runs = [_run_row(r) for r in results]
    by_algo = {}
    for algo in () if variants else plan.algos:
        spread = seed_spread([r for r in runs if r["algo"] == algo])
        if spread:
            by_algo[algo] = spread
    curves = {r.label: r.curves for r in results}
    summary = {"plan": asdict(plan), "warm_start": warm, "runs": runs, "by_algo": by_algo, "curves": curves}
    if not variants:
        return summary
    return {**summary, "variants": variants, "by_setting": seeds_of_settings(runs, variants)}


def seeds_of_settings(runs: list[dict], variants: dict[str, list[str]]) -> dict[str, dict]:
    """Variants whose overrides differ only in trainer.seed are seeds of one setting: per such setting
    (two runs or more, named by its variants joined with ", ") the spread of their final, best accuracy
    and gain, and how many seeds; failed runs counted apart, as in the grid."""
    settings: dict[tuple[str, ...], list[str]] = {}
    for name, overrides in variants.items():
        settings.setdefault(without_seed(overrides), []).append(name)
    out: dict[str, dict] = {}
    for names in (n for n in settings.values() if len(n) > 1):
        spread = seed_spread([r for r in runs if r.get("variant") in names])
        if spread:
            out[", ".join(names)] = spread
    return out


def seed_spread(group: list[dict]) -> dict | None:
    """Over the runs of one algorithm or setting: mean ± std and range of the final, best accuracy and
    gain, how many seeds, and how many failed (not averaged in: a dead run's gain of 0 would hide it);
    None when every run failed."""
    mine = [r for r in group if "gain" in r]
    if not mine:
        return None
    spread: dict = {k: _spread([r[k] for r in mine]) for k in ("final_accuracy", "best_accuracy", "gain")}
    return {**spread, "seeds": len(mine), "failed": len(group) - len(mine)}


def _number(value: float | None, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def markdown(summary: dict) -> str:
    warm, names = summary["warm_start"], {"gae": "PPO (GAE, critic)", "grpo": "GRPO"}
    step = f", step {warm['sft_step']}" if "sft_step" in warm else ""
    lines = [
        f"Warm start (`fulcrum sft`{step}), greedy on {warm['num_problems']} held-out problems: accuracy "
        f"**{warm['accuracy']:.3f}**, format accuracy {warm['format_accuracy']:.3f}.",
    ]
    base = summary.get("base_model_check")
    if base:
        lines.insert(
            0,
            f"Base model before SFT, greedy on {base['num_problems']} held-out problems: strict accuracy "
            f"**{base['accuracy']:.4f}**, flexible {base['flexible_accuracy']:.4f}, format "
            f"{base['format_accuracy']:.3f}, {base['response_length']:.0f} tokens a response.",
        )
    if "flexible_accuracy" in warm:
        lines.append(
            f"Warm start's flexible accuracy {warm['flexible_accuracy']:.4f}, {warm['response_length']:.0f} "
            "tokens a response."
        )
    if warm.get("dev_checks"):
        checks = ", ".join(
            f"{c['step']}: {c['accuracy']:.2f}/{c['format_accuracy']:.2f}" for c in warm["dev_checks"]
        )
        lines.append(f"SFT checkpoints on the dev set (step: accuracy/format): {checks}.")
    variants = summary.get("variants")
    if variants:
        listed = "; ".join(f"`{name}`: `{' '.join(o)}`" for name, o in variants.items())
        seed = summary.get("plan", {}).get("seeds", ["?"])[0]
        lines.append(
            f"Variants, one run each from this warm start (seed {seed} unless a variant sets trainer.seed), over "
            f"the plan's overrides: {listed}."
        )
    who = ["variant", "algorithm"] if variants else ["algorithm", "seed"]
    measures = ["steps", "RL minutes", "step 0", "final", "best", "gain"]
    measures += ["KL at the end", "KL peak"] if variants else []
    measures += ["critic explained variance"]
    lines += [
        "",
        "| " + " | ".join(who + measures) + " |",
        "| " + " | ".join(["---"] * len(who + measures)) + " |",
    ]
    for r in summary["runs"]:
        cells = (
            [r["variant"], algorithm_name(r["algo"], variants[r["variant"]], names)]
            if variants
            else [names[r["algo"]], str(r["seed"])]
        )
        if "gain" not in r:
            failed = (
                f"**failed** (exit {r['exit_code']}) at step {r.get('failed_at_step', 0)}: {r['error'][:160]}"
            )
            lines.append("| " + " | ".join([*cells, failed]) + " |" + " |" * (len(measures) - 1))
            continue
        accuracy = [f"{r[k]:.3f}" for k in ("step0_accuracy", "final_accuracy", "best_accuracy")]
        cells += [str(r["steps"]), f"{r['minutes']:.1f}", *accuracy, f"{r['gain']:+.3f}"]
        cells += [_number(r["final_kl"], ".3f"), _number(r["peak_kl"], ".3f")] if variants else []
        cells += [_number(r["final_explained_variance"], ".2f")]
        lines.append("| " + " | ".join(cells) + " |")
    lines += _answers_table(summary["runs"], names)
    if variants:  # averages only over variants that are seeds of one setting
        lines += _spread_table("variants (seeds of one setting)", summary.get("by_setting", {}))
        return "\n".join(lines) + "\n"
    lines += _spread_table("algorithm", summary["by_algo"], names)
    return "\n".join(lines) + "\n"


def algorithm_name(algo: str, overrides: list[str], names: dict[str, str]) -> str:
    """The algorithm's name in the tables, with DAPO's dynamic sampling when the overrides switch it on."""
    sampling = any(o.replace(" ", "").lower() == "algorithm.filter_groups.enable=true" for o in overrides)
    return names[algo] + (" + dynamic sampling" if sampling else "")


def _spread_table(who: str, spreads: dict[str, dict], names: dict[str, str] | None = None) -> list[str]:
    """Mean ± std (range) of the final accuracy and the gain, a row per algorithm or setting."""
    if not spreads:
        return []
    lines = [
        "",
        f"| {who} | seeds | final accuracy, mean ± std (range) | gain, mean ± std (range) |",
        "| --- | --- | --- | --- |",
    ]
    for key, s in spreads.items():
        f, g = s["final_accuracy"], s["gain"]
        seeds = f"{s.get('seeds', '?')}" + (f" (+{s['failed']} failed)" if s.get("failed") else "")
        lines.append(
            f"| {(names or {}).get(key, key)} | {seeds} | {f['mean']:.3f} ± {f['std']:.3f} ({f['min']:.3f}–{f['max']:.3f}) | "
            f"{g['mean']:+.3f} ± {g['std']:.3f} ({g['min']:+.3f} … {g['max']:+.3f}) |"
        )
    return lines


def _answers_table(runs: list[dict], names: dict[str, str]) -> list[str]:
    """Each run's first and last validation from its generations: strict, flexible, format, length, cut."""
    rows = [r for r in runs if r.get("generations")]
    if not rows:
        return []
    lines = [
        "",
        "| run | validation step | strict | flexible | format | tokens | cut at the limit |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        who = r.get("variant") or f"{names[r['algo']]} s{r['seed']}"
        first, last = r["generations"]["first"], r["generations"]["last"]
        shown = (first, last) if last["step"] != first["step"] else (first,)  # stopped at step 0: one row
        for g in shown:
            lines.append(
                f"| {who} | {g['step']} | {g['strict']:.4f} | {g['flexible']:.4f} | {g['format']:.3f} | "
                f"{g['response_length']:.0f} | {g['truncated']:.3f} |"
            )
    return lines


def _line_style(name: str, index: int, variants: bool) -> tuple[str, str]:
    """(colour, legend label) of run `name`: the grid colours by algorithm and labels `PPO s1`; variants
    each get their own colour and their name."""
    if variants:
        return f"C{index % 10}", name
    algo = name.split("-s")[0]
    return {"gae": "tab:blue", "grpo": "tab:orange"}[
        algo
    ], f"{'PPO' if algo == 'gae' else 'GRPO'} {name.split('-')[-1]}"


def plot(summary_file: Path) -> Path:
    """`learning_curves.png` beside the summary: one panel per CURVES entry, one line per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = json.loads(summary_file.read_text())
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    for ax, (key, title) in zip(axes.flat, CURVES, strict=True):
        for i, (name, curves) in enumerate(summary["curves"].items()):
            points = curves.get(key, [])
            if points:
                colour, label = _line_style(name, i, bool(summary.get("variants")))
                ax.plot([p[0] for p in points], [p[2] for p in points], color=colour, alpha=0.8, label=label)
        if key == "critic/vf_explained_var":  # it starts far below 0 while returns barely vary
            ax.set_ylim(-1.0, 1.0)
        ax.set_title(title)
        ax.set_xlabel("minutes of RL training")
    axes.flat[1].axhline(summary["warm_start"]["accuracy"], color="grey", linestyle=":", label="warm start")
    axes.flat[1].legend(fontsize=7)
    fig.tight_layout()
    out = summary_file.with_name("learning_curves.png")
    fig.savefig(out, dpi=110)
    return out
