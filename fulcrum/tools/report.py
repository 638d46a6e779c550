"""`fulcrum report RUN_DIR [--compare OTHER_RUN] [--out FILE]`: one self-contained `report.html`.

Reads `RUN_DIR/metrics.jsonl` (and `config.yaml` when there), plots every metric group as a PNG embedded
in the page (base64 `data:` URIs, inline CSS, no script, nothing fetched from the network), and writes
the diagnosis of `fulcrum.trainer.diagnosis` (the rules the trainer also applies live) with the lever for
each finding. With `--compare`, the other run is drawn dashed on every plot and diagnosed beside it.
The page replaces an earlier report; any other existing file only with `--force`, and never the run's
own metrics, configurations, checkpoints or inputs (`fulcrum.tools.report_files`).
Over 400 lines because the page is one file by design: its layout, inline styles and every plot group
live together so a change to one section is seen with the rest.
"""

from __future__ import annotations

import argparse
import base64
import html
import io
import math
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fulcrum.config.finding import Finding
from fulcrum.tools.report_files import ReportError, Run, check_out_file, load_run, write_report
from fulcrum.trainer.diagnosis import diagnose
from fulcrum.trainer.diagnosis_resources import PHASE_LEVERS, phase_shares
from fulcrum.trainer.metric_rows import as_float, series, training_rows

USAGE = "fulcrum report RUN_DIR [--compare OTHER_RUN] [--out FILE [--force]]"


@dataclass(frozen=True)
class Panel:
    """One plot: `keys` on the left axis, `right_keys` on a right axis; `lever` says what it points to."""

    title: str
    keys: tuple[str, ...]
    lever: str
    right_keys: tuple[str, ...] = ()
    log_y: bool = False
    prefix: str | None = None  # plot every key starting with this (validation data sources)
    section_optional: bool = False  # a feature's section: left out of runs that do not use it


SECTIONS: list[tuple[str, list[Panel]]] = [
    (
        "Learning",
        [
            Panel(
                "Reward (training) and validation accuracy",
                ("critic/score/mean", "critic/rewards/mean"),
                "flat at 0: the task is too hard for the model (SFT first, a larger rollout.n); falling: "
                "the policy unlearns it (a smaller actor lr)",
                prefix="val-core/",
            ),
            Panel(
                "Advantages, and prompt groups scored alike",
                ("critic/advantages/mean", "critic/advantages/max", "critic/advantages/min"),
                "the mean stays near 0 after whitening; drifting: reward scale, critic; groups_alike "
                "(right axis) high: GRPO learns from few groups (a larger rollout.n or temperature, filter_groups); "
                "with filter_groups on, its dropped share is what generation pays for",
                right_keys=("critic/score/groups_alike", "training/filter_groups/groups_alike"),
            ),
        ],
    ),
    (
        "Stability",
        [
            Panel(
                "KL and its coefficient",
                ("actor/ppo_kl", "actor/kl_loss", "actor/reward_kl_penalty"),
                "spikes: smaller actor lr, fewer ppo_epochs; kl_loss_coef / kl_ctrl.kl_coef",
                right_keys=("actor/reward_kl_penalty_coeff", "actor/kl_coef"),
            ),
            Panel(
                "Policy and value losses",
                ("actor/pg_loss",),
                "vf_loss not falling: critic.optim.lr, critic.ppo_epochs",
                right_keys=("critic/vf_loss",),
            ),
            Panel(
                "Clip fractions",
                ("actor/pg_clipfrac", "actor/pg_clipfrac_lower", "critic/vf_clipfrac"),
                "pg_clipfrac > 0.2: lower actor lr, fewer ppo_epochs, larger ppo_mini_batch_size",
            ),
            Panel(
                "Gradient norms (before clipping)",
                ("actor/grad_norm", "critic/grad_norm"),
                "often above grad_clip: clipping does the work; consider a lower lr",
                log_y=True,
            ),
            Panel(
                "Entropy and critic explained variance",
                ("actor/entropy",),
                "entropy collapsing: entropy_coeff, temperature; explained var <= 0: the critic does not learn",
                right_keys=("critic/vf_explained_var",),
            ),
        ],
    ),
    (
        "Lengths",
        [
            Panel(
                "Response length and clip ratio",
                ("response_length/mean", "response_length/max", "response_length/min"),
                "clip_ratio high: raise data.max_response_length or reward shorter answers",
                right_keys=("response_length/clip_ratio",),
            ),
        ],
    ),
    (
        "Multi-turn and tools",
        [
            Panel(
                "Tool calls and errors per conversation",
                ("tools/calls", "tools/errors"),
                "errors high: read tools/errors/<kind> (docs/multi-turn.md); a call rate near 0: the model "
                "does not use the tools (warm start with traces that call them)",
                right_keys=("tools/call_rate",),
                prefix="tools/errors/",
                section_optional=True,
            ),
            Panel(
                "Turns per conversation",
                ("num_turns/mean", "num_turns/max", "num_turns/min"),
                "max at 2 x max_assistant_turns: conversations end at the turn limit, not on their own",
                section_optional=True,
            ),
        ],
    ),
    (
        "Speed and memory",
        [
            Panel(
                "Throughput (tokens / s / device) and actor MFU",
                ("perf/throughput",),
                "the headline speed; `fulcrum tune` probes the levers that raise it",
                right_keys=("perf/mfu/actor",),
            ),
            Panel(
                "Memory (GiB)",
                (
                    "perf/max_memory_allocated_gb",
                    "perf/max_memory_reserved_gb",
                    "perf/cpu_memory_peak_rss_gb",
                ),
                "near the device's size: gradient checkpointing, smaller micro-batches, gpu_memory_utilization",
            ),
            Panel(
                "Host load (runnable tasks per CPU)",
                ("perf/cpu_load",),
                "at 1 or above, other processes hold the CPUs that launch the training passes' kernels: free "
                "them, or larger micro-batches (diagnosis rule host_loaded)",
            ),
        ],
    ),
]
LINE_STYLES = ("-", "--")


# ------------------------------------------------------------------------------------------ plots
def _png(fig: Any) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _keys_of(panel: Panel, run: Run) -> list[str]:
    keys = list(panel.keys)
    if panel.prefix:
        keys += sorted({k for row in run.rows for k in row if k.startswith(panel.prefix)})
    return keys


def plot_panel(panel: Panel, runs: list[Run]) -> str | None:
    """The panel as a base64 PNG; None when no run logged any of its metrics. A key keeps its colour
    across runs; the first run is solid, the compared one dashed."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(7.0, 3.2))
    ax = fig.add_subplot()
    right = ax.twinx() if panel.right_keys else None
    colours: dict[str, str] = {}
    drawn = {"left": 0, "right": 0}
    for run_index, run in enumerate(runs):
        style = LINE_STYLES[run_index % len(LINE_STYLES)]
        label_suffix = f" [{run.name}]" if len(runs) > 1 else ""
        for side, axis, keys in (("left", ax, _keys_of(panel, run)), ("right", right, panel.right_keys)):
            if axis is None:
                continue
            for key in keys:
                points = series(run.rows, key)
                if not points:
                    continue
                colour = colours.setdefault(key, f"C{len(colours) % 10}")
                steps, values = zip(*points, strict=True)
                axis.plot(
                    steps,
                    values,
                    style,
                    color=colour,
                    marker="o" if key.startswith("val-") or len(points) < 12 else None,
                    markersize=4,
                    label=("(right) " if side == "right" else "") + key + label_suffix,
                )
                drawn[side] += 1
    if not drawn["left"] + drawn["right"]:
        return None
    if right is not None and not drawn["right"]:
        right.set_axis_off()
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_title(panel.title, fontsize=10)
    ax.grid(alpha=0.3)
    if panel.log_y and all(v > 0 for run in runs for k in panel.keys for _, v in series(run.rows, k)):
        ax.set_yscale("log")
    handles, labels = ax.get_legend_handles_labels()
    if right is not None:
        more_handles, more_labels = right.get_legend_handles_labels()
        handles, labels = handles + more_handles, labels + more_labels
    ax.legend(handles, labels, fontsize=7, loc="upper left", bbox_to_anchor=(1.12 if right else 1.01, 1.0))
    return _png(fig)


def plot_step_time(runs: list[Run]) -> str | None:
    """Step time stacked by phase, one subplot per run (warm and first steps alike)."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    phases = [p for p in PHASE_LEVERS if any(series(training_rows(r.rows), f"timing_s/{p}") for r in runs)]
    if not phases:
        return None
    fig = Figure(figsize=(7.0, 3.2 * len(runs)), layout="constrained")
    colours = {p: f"C{i % 10}" for i, p in enumerate(phases)}
    for index, run in enumerate(runs):
        ax = fig.add_subplot(len(runs), 1, index + 1)
        train = training_rows(run.rows)
        steps = [int(as_float(r.get("step")) or i + 1) for i, r in enumerate(train)]
        bottom = [0.0] * len(train)
        for phase in phases:
            values = [as_float(r.get(f"timing_s/{phase}")) or 0.0 for r in train]
            values = [v if math.isfinite(v) else 0.0 for v in values]
            ax.bar(steps, values, bottom=bottom, color=colours[phase], label=phase, width=0.8)
            bottom = [b + v for b, v in zip(bottom, values, strict=True)]
        total = [as_float(r.get("timing_s/step")) or 0.0 for r in train]
        ax.plot(steps, total, "k.", label="timing_s/step")
        ax.set_ylabel("seconds")
        ax.set_xlabel("step")
        ax.set_title(f"Step time by phase [{run.name}]", fontsize=10)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return _png(fig)


# ------------------------------------------------------------------------------------------- html
CSS = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1100px; color: #222; }
h1 { font-size: 1.5em; } h2 { border-bottom: 1px solid #ccc; padding-bottom: .2em; margin-top: 1.6em; }
table { border-collapse: collapse; margin: .6em 0; font-size: .9em; }
td, th { border: 1px solid #ddd; padding: .3em .6em; text-align: left; vertical-align: top; }
th { background: #f4f4f4; }
.warning { background: #fff4e0; } .info { background: #eef5ff; }
.panel { margin: .4em 0; }
.panel img { max-width: 100%; }
.lever { color: #555; font-size: .85em; margin: 0 0 1em; }
.empty { color: #888; font-style: italic; }
"""


def _median(values: list[float]) -> float | None:
    finite = [v for v in values if math.isfinite(v)]
    return statistics.median(finite) if finite else None


def _fmt(value: float | None, spec: str = ".4g") -> str:
    return "—" if value is None else format(value, spec)


def summary_rows(run: Run) -> list[tuple[str, str]]:
    """Headline figures of a run: steps, warm medians of step time and throughput, last scores, peaks."""
    train = training_rows(run.rows)
    warm = train[1:] if len(train) > 1 else train

    def warm_median(key: str) -> float | None:
        return _median([v for _, v in series(warm, key)])

    def last(key: str) -> float | None:
        points = series(run.rows, key)
        return points[-1][1] if points else None

    peak = [v for _, v in series(run.rows, "perf/max_memory_reserved_gb")]
    shares = phase_shares(run.rows)
    out = [
        ("training steps", str(len(train))),
        ("step time, median of warm steps (s)", _fmt(warm_median("timing_s/step"), ".3g")),
        ("throughput, median of warm steps (tok/s/device)", _fmt(warm_median("perf/throughput"), ".4g")),
        ("bottleneck", ", ".join(f"{p} {s:.0%}" for p, s in list(shares.items())[:3]) or "—"),
        ("last critic/score/mean", _fmt(last("critic/score/mean"))),
    ]
    for key in sorted({k for row in run.rows for k in row if k.startswith("val-core/")}):
        out.append((f"last {key}", _fmt(last(key))))
    rss = [v for _, v in series(run.rows, "perf/cpu_memory_peak_rss_gb")]
    out.append(("peak reserved GPU memory (GiB)", _fmt(max(peak) if peak else None, ".3g")))
    out.append(("peak resident CPU memory of the trainer (GiB)", _fmt(max(rss) if rss else None, ".3g")))
    data = run.config.get("data", {}) if isinstance(run.config, dict) else {}
    if data:
        out.append(("data.train_batch_size", str(data.get("train_batch_size"))))
        out.append(("data.max_response_length", str(data.get("max_response_length"))))
    return out


def _findings_table(findings: list[Finding]) -> str:
    if not findings:
        return '<p class="empty">No rule fired.</p>'
    lines = ["<table><tr><th>severity</th><th>rule</th><th>step</th><th>what</th><th>lever to pull</th></tr>"]
    for f in findings:
        lines.append(
            f'<tr class="{html.escape(f.severity)}"><td>{html.escape(f.severity)}</td><td>{html.escape(f.rule)}</td>'
            f"<td>{'' if f.step is None else f.step}</td><td>{html.escape(f.message)}</td>"
            f"<td>{html.escape(f.fix)}</td></tr>"
        )
    lines.append("</table>")
    return "\n".join(lines)


def _img(png: str, alt: str) -> str:
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{png}">'


def render(runs: list[Run]) -> str:
    """The whole page as one HTML string."""
    title = "fulcrum report: " + " vs ".join(r.name for r in runs)
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{html.escape(title)}</title><style>{CSS}</style></head><body>",
        f"<h1>{html.escape(title)}</h1>",
    ]
    if len(runs) > 1:
        parts.append(
            "<p>"
            + "; ".join(
                f"<b>{html.escape(r.name)}</b> ({html.escape(str(r.path))}): {'solid' if i == 0 else 'dashed'} lines"
                for i, r in enumerate(runs)
            )
            + "</p>"
        )
    parts.append("<h2>Summary</h2>")
    per_run = [dict(summary_rows(run)) for run in runs]
    keys = list(dict.fromkeys(key for summary in per_run for key in summary))
    table = {key: [summary.get(key, "—") for summary in per_run] for key in keys}
    header = "".join(f"<th>{html.escape(r.name)}</th>" for r in runs)
    parts.append(f"<table><tr><th></th>{header}</tr>")
    for key, values in table.items():
        cells = "".join(f"<td>{html.escape(v)}</td>" for v in values)
        parts.append(f"<tr><th>{html.escape(key)}</th>{cells}</tr>")
    parts.append("</table>")
    parts.append("<h2>Diagnosis</h2>")
    for run in runs:
        if len(runs) > 1:
            parts.append(f"<h3>{html.escape(run.name)}</h3>")
        parts.append(_findings_table(diagnose(run.rows)))
    parts.append("<h2>Step time by phase</h2>")
    stacked = plot_step_time(runs)
    parts.append(
        f'<div class="panel">{_img(stacked, "step time stacked by phase")}</div>'
        if stacked
        else '<p class="empty">No timing_s/* metrics in this run.</p>'
    )
    for section, panels in SECTIONS:
        pngs = [plot_panel(panel, runs) for panel in panels]
        if all(png is None and panel.section_optional for png, panel in zip(pngs, panels, strict=True)):
            continue
        parts.append(f"<h2>{html.escape(section)}</h2>")
        for panel, png in zip(panels, pngs, strict=True):
            if png is None:
                parts.append(
                    f'<div class="panel"><p class="empty">{html.escape(panel.title)}: not logged in this run '
                    f"({html.escape(', '.join(panel.keys))})</p></div>"
                )
                continue
            parts.append(
                f'<div class="panel">{_img(png, panel.title)}<p class="lever">{html.escape(panel.lever)}</p></div>'
            )
    parts.append("</body></html>")
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fulcrum report", usage=USAGE, description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", help="a run directory (trainer.default_local_dir) holding metrics.jsonl")
    parser.add_argument("--compare", metavar="OTHER_RUN", help="a second run drawn dashed beside the first")
    parser.add_argument("--out", help="the HTML file to write (default RUN_DIR/report.html)")
    parser.add_argument(
        "--force", action="store_true", help="replace an existing --out file (never the run's own files)"
    )
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        runs = [load_run(args.run_dir)] + ([load_run(args.compare)] if args.compare else [])
        out = Path(args.out).expanduser() if args.out else runs[0].path / "report.html"
        check_out_file(out, runs, args.force, f"--out {out}" if args.out else str(out))
        write_report(out, render(runs), suggest_out=not args.out)
    except ReportError as exc:
        print(f"fulcrum report: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {out}")
    for run in runs:
        for finding in diagnose(run.rows):
            print(f"  [{run.name}] {finding.one_line()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
