"""DAPO dynamic sampling: groups whose responses all score alike are dropped; rounds add up to the batch."""

import pytest
import torch

from fulcrum.batch import Batch
from fulcrum.trainer.dynamic_sampling import GroupFilter, group_metric_values, rows_with_signal


def round_batch(prefix: str, scores: list[list[float]]) -> tuple[Batch, list[float]]:
    """One generation round: len(scores) prompts, each with its responses' scores."""
    uids = [f"{prefix}-{p}" for p, group in enumerate(scores) for _ in group]
    values = [s for group in scores for s in group]
    batch = Batch({"x": torch.tensor(values).unsqueeze(-1)}, {"uid": uids})
    return batch, values


def test_groups_without_signal_are_dropped() -> None:
    rows, kept, dropped = rows_with_signal([1, 1, 0, 1, 0, 0, 5], ["a", "a", "b", "b", "c", "c", "d"])
    assert rows == [2, 3, 6]  # b varies; a and c are constant; d is a single response (kept, as verl)
    assert (kept, dropped) == (2, 2)


def test_rounds_accumulate_until_enough_prompts_then_cut_to_the_batch() -> None:
    gate = GroupFilter(prompts_needed=3, max_num_gen_batches=0)
    gate.add(*round_batch("r1", [[1, 1], [0, 1], [0, 0]]))  # 1 prompt with signal
    assert not gate.enough and gate.may_generate_more()
    gate.add(*round_batch("r2", [[1, 0], [0, 1], [1, 0]]))  # 3 more
    assert gate.enough
    batch = gate.take()
    assert batch.non_tensors["uid"] == ["r1-1", "r1-1", "r2-0", "r2-0", "r2-1", "r2-1"]
    assert gate.metrics() == {
        "train/num_gen_batches": 2.0,
        "training/filter_groups/evicted_samples": 2.0,
        "training/filter_groups/groups_alike": 2 / 6,  # 2 of the 6 groups generated scored alike
    }


def test_too_many_rounds_stops_with_the_reason() -> None:
    gate = GroupFilter(prompts_needed=2, max_num_gen_batches=2)
    gate.add(*round_batch("r1", [[1, 1], [0, 0]]))
    gate.add(*round_batch("r2", [[1, 1], [0, 0]]))
    assert not gate.may_generate_more()
    with pytest.raises(
        RuntimeError, match=r"2 generation rounds .*max_num_gen_batches=2.*0 of the 2 prompts"
    ):
        raise gate.too_many_rounds()


def test_metric_values_by_name() -> None:
    scores = torch.tensor([[0.0, 1.0], [0.5, 0.0]])
    assert group_metric_values("reward", scores, [9, 9], {}) == [1.0, 0.5]
    assert group_metric_values("seq_final_reward", scores, [9, 9], {}) == [1.0, 0.5]
    assert group_metric_values("score", scores, [1, 0], {}) == [1.0, 0.0]
    assert group_metric_values("acc", scores, [1, 0], {}) == [1.0, 0.0]  # no acc key: the score
    assert group_metric_values("acc", scores, [1, 0], {"acc": [0, 1]}) == [0.0, 1.0]
    with pytest.raises(KeyError, match="metric='pass'"):
        group_metric_values("pass", scores, [1, 0], {"acc": [0, 1]})


def test_a_step_that_keeps_drawing_rounds_says_so_every_ten() -> None:
    gate = GroupFilter(prompts_needed=4, max_num_gen_batches=0)
    notes = []
    for r in range(20):
        gate.add(*round_batch(f"r{r}", [[1, 1], [0, 0]] if r != 3 else [[1, 0], [0, 0]]))
        notes.append(gate.progress_note(step=7))
    assert [i + 1 for i, n in enumerate(notes) if n] == [10, 20]
    assert notes[9] is not None
    assert "step 7" in notes[9] and "10 rounds (no round limit)" in notes[9]
    assert "holds 1 of the 4 prompts" in notes[9] and "95% of the 20 prompt groups" in notes[9]
    assert "rollout.n" in notes[9]
    enough = GroupFilter(prompts_needed=1, max_num_gen_batches=0)
    for r in range(10):
        enough.add(*round_batch(f"e{r}", [[1, 0]]))
    assert enough.progress_note(step=1) is None  # nothing to say once the step has its prompts
