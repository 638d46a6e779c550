"""DAPO's dynamic sampling (algorithm.filter_groups): keep only prompt groups whose responses differ in a
metric, and generate more rounds until the step has data.train_batch_size such prompts.

A group whose n responses all score alike gives every response advantage 0 under GRPO-style
estimators: it costs a backward pass and teaches nothing. As in verl's DAPO trainer, a round is
generated and scored, the groups without signal are dropped, and rounds are added until enough
prompts remain (then the batch is cut to train_batch_size prompts), or `max_num_gen_batches` rounds
(<= 0: no limit) have not sufficed, which stops the run with an error that says why.
Metrics: `train/num_gen_batches` (rounds this step, verl's DAPO name),
`training/filter_groups/evicted_samples` (groups dropped this step, verl's v1 name) and
`training/filter_groups/groups_alike` (the dropped share of all groups generated this step: what
`critic/score/groups_alike` would read without the filter, which reads 0 on the kept batch).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np
import torch

# filter_groups.metric names computed from the batch; any other name is a reward extra key.
SEQ_REWARD_METRICS = ("reward", "seq_reward", "seq_final_reward")
NOTE_EVERY_ROUNDS = 10  # rounds of one step between progress lines on the console


def group_metric_values(
    metric: str, token_level_scores: torch.Tensor, scores: Sequence[float], extra: dict[str, list[Any]]
) -> list[float]:
    """One value per response for `metric`: reward / seq_reward / seq_final_reward = the response's
    summed token-level scores (the KL penalty is applied after filtering, so seq_final_reward equals
    seq_reward here); score = the reward function's score; acc and any other name = that key of the
    reward function's dict (acc falls back to the score, as verl's managers record it)."""
    if metric in SEQ_REWARD_METRICS:
        return token_level_scores.sum(dim=-1).tolist()
    if metric == "score" or (metric == "acc" and "acc" not in extra):
        return [float(s) for s in scores]
    if metric not in extra:
        raise KeyError(
            f"algorithm.filter_groups.metric={metric!r}: the reward function returned no {metric!r} "
            f"(it returned {sorted(extra) or 'plain scores'}); use reward, score, or a key of its dict"
        )
    return [float(v) for v in extra[metric]]


def rows_with_signal(values: Sequence[float], uids: Sequence[Hashable]) -> tuple[list[int], int, int]:
    """(rows to keep, groups kept, groups dropped): a group is kept when its values are not all equal
    (std > 0) or it has a single response (verl)."""
    groups: dict[Hashable, list[int]] = {}
    for row, uid in enumerate(uids):
        groups.setdefault(uid, []).append(row)
    keep: list[int] = []
    dropped = 0
    for rows in groups.values():
        if len(rows) == 1 or float(np.std([values[r] for r in rows])) > 0:
            keep.extend(rows)
        else:
            dropped += 1
    return sorted(keep), len(groups) - dropped, dropped


class GroupFilter:
    """Accumulates rounds of (batch, metric values) until `prompts_needed` prompt groups with signal."""

    def __init__(self, prompts_needed: int, max_num_gen_batches: int) -> None:
        self.prompts_needed = prompts_needed
        self.max_num_gen_batches = max_num_gen_batches
        self.kept: list[Any] = []  # Batches of kept rows, one per round
        self.num_prompts = 0
        self.num_gen_batches = 0
        self.evicted = 0

    def add(self, batch: Any, values: Sequence[float]) -> None:
        """Add one generated and scored round; `batch.non_tensors['uid']` groups its rows."""
        self.num_gen_batches += 1
        rows, kept, dropped = rows_with_signal(values, batch.non_tensors["uid"])
        self.evicted += dropped
        self.num_prompts += kept
        if rows:
            self.kept.append(batch.select(torch.tensor(rows, dtype=torch.long)))

    @property
    def enough(self) -> bool:
        return self.num_prompts >= self.prompts_needed

    @property
    def alike_share(self) -> float:
        """The share of the prompt groups generated so far that scored alike (and were dropped)."""
        return self.evicted / max(self.num_prompts + self.evicted, 1)

    def may_generate_more(self) -> bool:
        """False once max_num_gen_batches rounds were generated (<= 0: never)."""
        return self.max_num_gen_batches <= 0 or self.num_gen_batches < self.max_num_gen_batches

    def progress_note(self, step: int) -> str | None:
        """Every NOTE_EVERY_ROUNDS rounds of one step, a line saying how far the step is from enough prompts:
        with no round limit (max_num_gen_batches <= 0) a policy whose groups all score alike would otherwise
        generate round after round with nothing on the console."""
        if self.num_gen_batches % NOTE_EVERY_ROUNDS or self.enough:
            return None
        limit = (
            f"max_num_gen_batches={self.max_num_gen_batches}"
            if self.max_num_gen_batches > 0
            else "no round limit"
        )
        return (
            f"step {step}: algorithm.filter_groups has generated {self.num_gen_batches} rounds ({limit}) and holds "
            f"{self.num_prompts} of the {self.prompts_needed} prompts it needs: {self.alike_share:.0%} of the "
            f"{self.num_prompts + self.evicted} prompt groups scored alike. A larger rollout.n or temperature, or prompts nearer "
            "the model's level, give more groups with signal"
        )

    def too_many_rounds(self) -> RuntimeError:
        return RuntimeError(
            f"algorithm.filter_groups: {self.num_gen_batches} generation rounds (max_num_gen_batches="
            f"{self.max_num_gen_batches}) gave {self.num_prompts} of the {self.prompts_needed} prompts needed with "
            "responses that differ; the data may be too easy or too hard for the policy (every response of a "
            "prompt scores the same). Raise max_num_gen_batches (<= 0: no limit) or rollout.n, or filter the data"
        )

    def metrics(self) -> dict[str, float]:
        return {
            "train/num_gen_batches": float(self.num_gen_batches),
            "training/filter_groups/evicted_samples": float(self.evicted),
            "training/filter_groups/groups_alike": self.alike_share,
        }

    def take(self) -> Any:
        """The kept rows of all rounds, cut to the first `prompts_needed` prompt groups (verl aligns the
        batch to train_batch_size x n the same way)."""
        if not self.kept:
            raise self.too_many_rounds()
        batch = type(self.kept[0]).concat(self.kept)
        chosen: dict[Hashable, None] = {}
        for uid in batch.non_tensors["uid"]:
            if len(chosen) == self.prompts_needed:
                break
            chosen.setdefault(uid, None)
        rows = [i for i, uid in enumerate(batch.non_tensors["uid"]) if uid in chosen]
        return batch.select(torch.tensor(rows, dtype=torch.long))
