"""Diagnosis rules over a run's metrics rows: which signal says the run is going wrong, each with the lever to
pull, beside the rules about where the step's time and memory go (`fulcrum.trainer.diagnosis_resources`).

Pure functions over `rows` (one dict per `metrics.jsonl` line, oldest first; values may be the strings
"nan"/"inf" the JSON logger writes: `fulcrum.trainer.metric_rows`). No torch, no I/O: `fulcrum report` calls `diagnose(rows)` on a
finished run, and the trainer calls `LiveDiagnosis.observe(row)` after each step to print a one-line
diagnosis the first time a rule fires. docs/metrics.md and docs/levers.md explain the metrics and levers.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence

from fulcrum.config.finding import Finding
from fulcrum.trainer.diagnosis_resources import (
    bottleneck,
    host_loaded,
    kv_recompute,
    long_prefill,
    long_tail,
    memory_creep,
    partial_rollout_costs,
)
from fulcrum.trainer.metric_rows import Row, as_float, finite_series, series, step_of, training_rows

NON_FINITE_KEYS = (
    "actor/pg_loss",
    "actor/kl_loss",
    "actor/entropy",
    "actor/grad_norm",
    "critic/vf_loss",
    "critic/grad_norm",
)
KL_KEYS = ("actor/ppo_kl", "actor/kl_loss", "actor/reward_kl_penalty")

KL_SPIKE_FACTOR = 10.0  # a value this many times its running median is a spike
# ... and above this absolute value (tiny KLs jitter by large factors). actor/ppo_kl's is higher: a healthy
# run's ppo_kl can jump tenfold near 1e-3 and stays below about 0.012; a runaway one starts near 0.04.
KL_SPIKE_FLOORS = {"actor/ppo_kl": 5e-3, "actor/kl_loss": 1e-3, "actor/reward_kl_penalty": 1e-3}
KL_MIN_HISTORY = 5
# A policy that moves this far, steadily (median of KL_HIGH_STEPS steps), is running away from the start;
# the spike rule cannot see it, as its running median is high too. The limits sit between a policy that
# keeps its task (ppo_kl <= ~0.02, kl_loss <= ~0.1) and one whose learning rate is too high for it
# (ppo_kl >= 0.04 and kl_loss >= 2 from the first steps, the task lost).
# GRPO's signal: most groups of n alike for ALIKE_STEPS steps. When a policy's samples agree (training reward
# high, entropy near zero) GRPO's advantages vanish and its validation accuracy flattens, while PPO's (one
# sample a prompt, a critic) can still rise.
ALIKE_LIMIT = 0.5
ALIKE_STEPS = 5
# With DAPO's filter on, the trained batch has signal by construction; what alike groups cost is generation:
# each kept group takes 1 / (1 - share) generated ones: above 0.75 a kept group costs 4 or more.
FILTERED_ALIKE_LIMIT = 0.75
KL_HIGH_LIMITS = {"actor/ppo_kl": 0.02, "actor/kl_loss": 1.0, "actor/reward_kl_penalty": 1.0}
KL_HIGH_STEPS = 3
REWARD_WINDOW = 5  # steps per median of the training reward
REWARD_COLLAPSE_SHARE = 0.5  # a reward or validation score below this share of its best so far
# A best 5-step median below this is a few lucky samples (on GSM8K's strict reward a base model scores
# 0.002: one answer in 512), not a skill the policy could lose.
REWARD_COLLAPSE_MIN_BEST = 0.02
LENGTH_CLIP_LIMIT = 0.2  # share of responses at the length limit
ADV_DRIFT_LIMIT = 0.1  # |mean advantage| ...
ADV_DRIFT_STEPS = 3  # ... for this many steps in a row
CRITIC_MIN_STEPS = 10
# A step whose samples all score alike (critic/score/max = min) teaches nothing; most steps of a window so:
# the reward is out of the policy's reach. A run whose rare rewarded answers come every other step can
# still find the task; one with a reward in a step of four or fewer drifts on the critic's errors.
UNREACHED_WINDOW = 20
UNREACHED_SHARE = 0.75


# ------------------------------------------------------------------------------------------ rules
def kl_spikes(rows: Sequence[Row]) -> list[Finding]:
    """A KL value above KL_SPIKE_FACTOR × the median of the values before it (and above KL_SPIKE_FLOOR)."""
    findings = []
    for key in KL_KEYS:
        points = finite_series(rows, key)
        for i in range(KL_MIN_HISTORY, len(points)):
            step, value = points[i]
            median = statistics.median(abs(v) for _, v in points[:i])
            if abs(value) > KL_SPIKE_FLOORS[key] and abs(value) > KL_SPIKE_FACTOR * median:
                findings.append(
                    Finding(
                        (),
                        f"{key} = {value:.3g}, {abs(value) / max(median, 1e-12):.0f}x its running median {median:.3g}",
                        "warning",
                        fix="a smaller actor.optim.lr, fewer actor.ppo_epochs, a larger ppo_mini_batch_size, a lower "
                        "actor.grad_clip, or a stronger KL (kl_loss_coef / kl_ctrl.kl_coef)",
                        rule="kl_spike",
                        step=step,
                    )
                )
                break
    return findings


def kl_high(rows: Sequence[Row]) -> list[Finding]:
    """A KL whose median over KL_HIGH_STEPS steps in a row is above its KL_HIGH_LIMITS value: each update
    (`actor/ppo_kl`) or the policy as a whole (the KL to the reference) moves too far, step after step."""
    findings = []
    for key, limit in KL_HIGH_LIMITS.items():
        points = finite_series(rows, key)
        for i in range(KL_HIGH_STEPS, len(points) + 1):
            window = [abs(v) for _, v in points[i - KL_HIGH_STEPS : i]]
            median = statistics.median(window)
            if median > limit:
                findings.append(
                    Finding(
                        (),
                        f"{key} = {median:.4g} (median of {KL_HIGH_STEPS} steps), above {limit:g}: the "
                        "policy moves too far, step after step",
                        "warning",
                        fix="a smaller actor.optim.lr first (3x smaller is a good step), then a lower "
                        "actor.grad_clip or a larger ppo_mini_batch_size; for the KL to the reference, a "
                        "stronger kl_loss_coef / kl_ctrl.kl_coef",
                        rule="kl_high",
                        step=points[i - 1][0],
                    )
                )
                break
    return findings


def reward_collapse(rows: Sequence[Row]) -> list[Finding]:
    """The median `critic/score/mean` of REWARD_WINDOW steps below REWARD_COLLAPSE_SHARE × the best such
    median before them (which was at least REWARD_COLLAPSE_MIN_BEST): the policy unlearns the task."""
    points = finite_series(rows, "critic/score/mean")
    values = [v for _, v in points]
    best = -math.inf
    for end in range(2 * REWARD_WINDOW, len(values) + 1):
        best = max(best, statistics.median(values[end - 2 * REWARD_WINDOW : end - REWARD_WINDOW]))
        recent = statistics.median(values[end - REWARD_WINDOW : end])
        if best >= REWARD_COLLAPSE_MIN_BEST and recent < REWARD_COLLAPSE_SHARE * best:
            return [
                Finding(
                    (),
                    f"critic/score/mean {recent:.3g} (median of the last {REWARD_WINDOW} steps), below half "
                    f"of its best {REWARD_WINDOW}-step median {best:.3g}",
                    "warning",
                    fix="a smaller actor.optim.lr (see kl_high and kl_spike), and a restart from a checkpoint "
                    "saved before the fall (trainer.resume_mode=resume_path trainer.resume_from_path=...)",
                    rule="reward_collapse",
                    step=points[end - 1][0],
                )
            ]
    return []


def validation_drop(rows: Sequence[Row]) -> list[Finding]:
    """A validation score (`val-core/.../mean@N`, verl's main validation metrics) below
    REWARD_COLLAPSE_SHARE × its best earlier value (above 0)."""
    keys = sorted({k for row in rows for k in row if k.startswith("val-core/") and "/mean@" in k})
    for key in keys:
        best = -math.inf
        for step, value in series(rows, key):
            if not math.isfinite(value):
                continue
            if best > 0 and value < REWARD_COLLAPSE_SHARE * best:
                return [
                    Finding(
                        (),
                        f"{key} = {value:.3g}, below half of its best {best:.3g}",
                        "warning",
                        fix="a smaller actor.optim.lr (see kl_high and kl_spike); the checkpoint saved at the "
                        "best validation is the one to keep or restart from",
                        rule="validation_drop",
                        step=step,
                    )
                ]
            best = max(best, value)
    return []


def critic_not_learning(rows: Sequence[Row]) -> list[Finding]:
    """After CRITIC_MIN_STEPS steps: the median vf_explained_var of the last 5 steps <= 0 and vf_loss not
    below 80% of its median over the first 5 (the critic predicts returns no better than their mean)."""
    train = training_rows(rows)
    explained = series(train, "critic/vf_explained_var")
    loss = finite_series(train, "critic/vf_loss")
    if len(explained) < CRITIC_MIN_STEPS or len(loss) < CRITIC_MIN_STEPS:
        return []
    recent_ev = statistics.median(v for _, v in explained[-5:])
    early_loss = statistics.median(v for _, v in loss[:5])
    recent_loss = statistics.median(v for _, v in loss[-5:])
    if recent_ev > 0.0 or recent_loss < 0.8 * early_loss:
        return []
    return [
        Finding(
            (),
            f"critic/vf_explained_var {recent_ev:.2f} (median of the last 5 steps) and critic/vf_loss "
            f"{recent_loss:.3g}, not below its early {early_loss:.3g}",
            "warning",
            fix="a larger critic.optim.lr, more critic.ppo_epochs, trainer.critic_warmup steps before the actor "
            "moves, or a looser critic.cliprange_value",
            rule="critic_not_learning",
            step=explained[-1][0],
        )
    ]


def advantage_drift(rows: Sequence[Row]) -> list[Finding]:
    """|critic/advantages/mean| above ADV_DRIFT_LIMIT for ADV_DRIFT_STEPS steps in a row (whitened or
    group-normalised advantages stay near 0)."""
    run = 0
    for step, value in series(training_rows(rows), "critic/advantages/mean"):
        run = run + 1 if math.isfinite(value) and abs(value) > ADV_DRIFT_LIMIT else 0
        if run >= ADV_DRIFT_STEPS:
            return [
                Finding(
                    (),
                    f"critic/advantages/mean = {value:.3g}, away from 0 for {run} steps",
                    "warning",
                    fix="check the reward's scale and sign, the critic (critic.optim.lr, critic_warmup), "
                    "algorithm.gamma / lam, and algorithm.norm_adv_by_std_in_grpo for GRPO",
                    rule="advantage_drift",
                    step=step,
                )
            ]
    return []


def length_limit(rows: Sequence[Row]) -> list[Finding]:
    """response_length/clip_ratio: the mean over the last 3 steps at or above LENGTH_CLIP_LIMIT."""
    points = finite_series(rows, "response_length/clip_ratio")
    if not points:
        return []
    recent = [v for _, v in points[-3:]]
    share = sum(recent) / len(recent)
    if share < LENGTH_CLIP_LIMIT:
        return []
    first = next(s for s, v in points if v >= LENGTH_CLIP_LIMIT)
    return [
        Finding(
            (),
            f"{share:.0%} of responses hit the length limit (response_length/clip_ratio): their reward is "
            "for a cut-off answer",
            "warning",
            fix="a larger data.max_response_length (costs generation time and memory), or a reward that "
            "favours shorter answers",
            rule="length_limit",
            step=first,
        )
    ]


def non_finite(rows: Sequence[Row]) -> list[Finding]:
    """NaN/Inf in a loss or gradient norm, and steps the trainer skipped for it (training/nan_skipped_steps)."""
    for i, row in enumerate(training_rows(rows)):
        bad = [k for k in NON_FINITE_KEYS if (v := as_float(row.get(k))) is not None and not math.isfinite(v)]
        skipped = as_float(row.get("training/nan_skipped_steps")) or 0.0
        if bad or skipped > 0:
            total_skipped = max(as_float(r.get("training/nan_skipped_steps")) or 0.0 for r in rows)
            what = f"non-finite {', '.join(bad)}" if bad else "a skipped update"
            return [
                Finding(
                    (),
                    f"{what}; {int(total_skipped)} step(s) skipped in the run (training/nan_skipped_steps)",
                    "warning",
                    fix="a smaller actor.optim.lr / critic.optim.lr, a lower grad_clip, and check the reward "
                    "function's output for NaN",
                    rule="non_finite",
                    step=step_of(row, i + 1),
                )
            ]
    return []


def reward_out_of_reach(rows: Sequence[Row]) -> list[Finding]:
    """In UNREACHED_SHARE or more of the last UNREACHED_WINDOW steps, every sample of the step scored alike
    at 0 or below (critic/score/max = critic/score/min <= 0, verl's scorers' failing scores): the reward
    almost never separates one answer from another."""
    train = training_rows(rows)
    highs, lows = (
        dict(finite_series(train, "critic/score/max")),
        dict(finite_series(train, "critic/score/min")),
    )
    steps = [step for step in highs if step in lows][-UNREACHED_WINDOW:]
    if len(steps) < UNREACHED_WINDOW:
        return []
    alike = sum(highs[step] == lows[step] <= 0.0 for step in steps)  # all failed (all solved: too easy)
    if alike < UNREACHED_SHARE * UNREACHED_WINDOW:
        return []
    entropy = finite_series(train, "actor/entropy")
    drift = f"; actor/entropy {entropy[0][1]:.2f} -> {entropy[-1][1]:.2f}" if len(entropy) > 1 else ""
    return [
        Finding(
            (),
            f"every sample scored {lows[steps[-1]]:.3g} alike in {alike} of the last {len(steps)} steps "
            f"(critic/score/max = min): the reward gives the policy nothing to learn from, and its updates "
            f"follow the advantages' noise{drift}",
            "warning",
            fix="bring the reward within reach: a prompt that asks for what the scorer reads (GSM8K's "
            "strict score needs '#### N'; `fulcrum eval` of the model shows its format rate), a reward with "
            "partial credit (custom_reward_function), a warm start that writes the format (fulcrum sft), "
            "or more samples a prompt (actor_rollout_ref.rollout.n) so that rare rewarded answers come "
            "every step",
            rule="reward_out_of_reach",
            step=steps[-1],
        )
    ]


def groups_without_signal(rows: Sequence[Row]) -> list[Finding]:
    """critic/score/groups_alike: the median over the last ALIKE_STEPS steps at or above ALIKE_LIMIT (most
    prompt groups score alike, so most of a GRPO-style step teaches nothing). With algorithm.filter_groups on,
    the share before the filter (training/filter_groups/groups_alike) at or above FILTERED_ALIKE_LIMIT: the
    filter keeps the step's signal, paid for in generation rounds."""
    train = training_rows(rows)
    filtered = finite_series(train, "training/filter_groups/groups_alike")
    points = filtered or finite_series(train, "critic/score/groups_alike")
    if len(points) < ALIKE_STEPS:
        return []
    recent = statistics.median(v for _, v in points[-ALIKE_STEPS:])
    if recent < (FILTERED_ALIKE_LIMIT if filtered else ALIKE_LIMIT):
        return []
    if filtered:
        rounds = finite_series(train, "train/num_gen_batches")
        cost = f", {rounds[-1][1]:.0f} generation rounds the last step" if rounds else ""
        message = (
            f"training/filter_groups/groups_alike {recent:.2f} (median of the last {ALIKE_STEPS} steps): "
            "algorithm.filter_groups drops that share of the generated prompt groups, so each trained group "
            f"costs {1 / max(1 - recent, 1e-6):.1f} generated ones{cost}"
        )
        fix = (
            "a larger actor_rollout_ref.rollout.n or rollout.temperature (more groups with varied answers), prompts "
            "nearer the model's level, or PPO with a critic, which learns from every sample"
        )
    else:
        scores = finite_series(train, "critic/score/mean")
        side = ""
        if scores:
            mean = scores[-1][1]
            side = f" (critic/score/mean {mean:.2f}: {'mostly solved groups' if mean >= 0.5 else 'mostly failed groups'})"
        message = (
            f"critic/score/groups_alike {recent:.2f} (median of the last {ALIKE_STEPS} steps): that share of the "
            f"prompt groups scored alike, so their advantages are 0{side}"
        )
        fix = (
            "a larger actor_rollout_ref.rollout.n or rollout.temperature (more varied answers), "
            "algorithm.filter_groups.enable=True (DAPO's dynamic sampling: only groups with signal are trained), "
            "or prompts nearer the model's level; PPO with a critic learns from every sample"
        )
    return [Finding((), message, "warning", fix=fix, rule="groups_without_signal", step=points[-1][0])]


RULES: list[Callable[[Sequence[Row]], list[Finding]]] = [
    bottleneck,
    non_finite,
    kl_spikes,
    kl_high,
    reward_collapse,
    reward_out_of_reach,
    validation_drop,
    critic_not_learning,
    advantage_drift,
    length_limit,
    memory_creep,
    host_loaded,
    long_tail,
    partial_rollout_costs,
    long_prefill,
    kv_recompute,
    groups_without_signal,
]


def diagnose(rows: Sequence[Row]) -> list[Finding]:
    """Every rule's findings over the run's rows (oldest first)."""
    return [finding for rule in RULES for finding in rule(rows)]


class LiveDiagnosis:
    """Feed it each step's metrics; it returns the one-line diagnosis of each rule the first time it fires.

    It keeps the first KEEP_FIRST rows (the rules' early baselines) and the last KEEP_LAST."""

    KEEP_FIRST = 10
    KEEP_LAST = 200

    def __init__(self, min_steps_for_bottleneck: int = 3) -> None:
        self.rows: list[Row] = []
        self.fired: set[str] = set()
        # The bottleneck is always there: name it once the warm steps say which phase it is.
        self.min_steps_for_bottleneck = min_steps_for_bottleneck

    def observe(self, metrics: Row, step: int) -> list[str]:
        self.rows.append({"step": step, **metrics})
        if len(self.rows) > self.KEEP_FIRST + self.KEEP_LAST:  # bounded work per step in a long run
            self.rows = self.rows[: self.KEEP_FIRST] + self.rows[-self.KEEP_LAST :]
        lines = []
        for finding in diagnose(self.rows):
            if finding.rule in self.fired:
                continue
            if finding.rule == "bottleneck" and len(training_rows(self.rows)) < self.min_steps_for_bottleneck:
                continue
            self.fired.add(finding.rule)
            lines.append(finding.one_line())
        return lines
