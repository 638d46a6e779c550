"""`Batch.select` and `Batch.split`: the rows asked for, in that order, for every tensor and per-sample value."""

from __future__ import annotations

import torch

from fulcrum.batch import Batch


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
