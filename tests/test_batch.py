"""`Batch.select` and `Batch.split`: the rows asked for, in that order, for every tensor and per-sample value."""

from __future__ import annotations

import pytest
import torch

from fulcrum.batch import Batch, assemble_batch


def batch_of(rows: int = 6) -> Batch:
    return Batch(
        {
            "input_ids": torch.arange(rows * 4).view(rows, 4),
            "logits": torch.randn(rows, 3, 2),
            "scores": torch.arange(rows, dtype=torch.float32),
        },
        {"uid": [f"u{i}" for i in range(rows)]},
    )


def test_select_takes_rows_in_the_given_order_from_a_list_or_a_tensor() -> None:
    batch = batch_of()
    for index in ([4, 0, 4, 2], torch.tensor([4, 0, 4, 2])):
        picked = batch.select(index)
        rows = [4, 0, 4, 2]
        for key, tensor in batch.tensors.items():
            assert torch.equal(picked[key], torch.stack([tensor[r] for r in rows])), key
            assert picked[key].dtype == tensor.dtype and picked[key].is_contiguous()
        assert picked.non_tensors["uid"] == ["u4", "u0", "u4", "u2"]


def test_select_of_no_rows_is_an_empty_batch_of_the_same_fields() -> None:
    empty = batch_of().select([])
    assert len(empty) == 0 and empty["logits"].shape == (0, 3, 2) and empty.non_tensors["uid"] == []


def test_split_covers_every_row_once_in_order() -> None:
    parts = batch_of(7).split(3)
    assert [len(p) for p in parts] == [3, 3, 1]
    assert torch.equal(torch.cat([p["input_ids"] for p in parts]), batch_of(7)["input_ids"])


def test_assemble_batch_lays_out_rows_as_verl_does() -> None:
    """Prompts left-padded (a long one keeps its last tokens), responses right-padded and cut at the
    response length with their log-probs and loss masks; an empty response is all padding."""
    items = [{"input_ids": [1, 2, 3, 4, 5, 6]}, {"input_ids": [7]}, {"input_ids": [8, 9]}]
    token_ids = [[11, 12, 13, 14, 15], [21], [], [31, 32]]
    logprobs = [[-0.1, -0.2, -0.3, -0.4, -0.5], [-1.0], [], [-2.0, -3.0]]
    masks = [[1, 0, 1, 1, 1], [1], [], [0, 1]]
    P, R = 4, 3
    batch = assemble_batch(items, token_ids, logprobs, [0, 1, 2, 2], P, R, 0, "u", loss_masks=masks)
    assert batch["prompts"].tolist() == [[3, 4, 5, 6], [0, 0, 0, 7], [0, 0, 8, 9], [0, 0, 8, 9]]
    assert batch["responses"].tolist() == [[11, 12, 13], [21, 0, 0], [0, 0, 0], [31, 32, 0]]
    assert batch["attention_mask"].tolist() == [
        [1, 1, 1, 1, 1, 1, 1],
        [0, 0, 0, 1, 1, 0, 0],
        [0, 0, 1, 1, 0, 0, 0],
        [0, 0, 1, 1, 1, 1, 0],
    ]
    assert batch["response_mask"].tolist() == [[1, 0, 1], [1, 0, 0], [0, 0, 0], [0, 1, 0]]
    expected = torch.tensor([[-0.1, -0.2, -0.3], [-1.0, 0, 0], [0, 0, 0], [-2.0, -3.0, 0]])
    torch.testing.assert_close(batch["rollout_log_probs"], expected, atol=0, rtol=0)
    assert batch["input_ids"].tolist()[1] == [0, 0, 0, 7, 21, 0, 0]
    assert batch["position_ids"].tolist()[1] == [0, 0, 0, 0, 1, 1, 1]
    assert batch.non_tensors["uid"] == ["u-0", "u-1", "u-2", "u-2"]
    single_turn = assemble_batch(items, token_ids, logprobs, [0, 1, 2, 2], P, R, 0, "u")
    assert single_turn["response_mask"].tolist() == [[1, 1, 1], [1, 0, 0], [0, 0, 0], [1, 1, 0]]
    assert single_turn["rollout_log_probs"].dtype == torch.float32
    with pytest.raises(ValueError, match="one log-prob per response token"):
        assemble_batch(items, [[1, 2]], [[-0.5]], [0], P, R, 0, "u")
