"""RLHFDataset (chat template, max_prompt_length as verl, errors naming file/column), left_pad, PromptLoader."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from gsm8k_data import SOURCE_IDS, SOURCES, expected_rows
from gsm8k_data import rows as gsm8k_rows

from fulcrum.data.dataset import DatasetError, PromptLoader, RLHFDataset, left_pad, truncate
from fulcrum.data.gsm8k import prepare_gsm8k
from fulcrum.models.tiny import build_tokenizer


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return build_tokenizer()


def _row(question: str, index: int, truth: str = "1", source: str = "openai/gsm8k") -> dict[str, Any]:
    return {
        "data_source": source,
        "prompt": [{"role": "user", "content": question}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": truth},
        "extra_info": {"split": "train", "index": index},
    }


def _write(path: Path, rows: list[dict[str, Any]]) -> Path:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def test_items_carry_templated_ids_and_row_fields(tmp_path: Path, tokenizer: Any) -> None:
    a = _write(tmp_path / "a.parquet", [_row("What is 2 + 3?", 0, "5"), _row("And 4 + 4?", 1, "8")])
    b = _write(tmp_path / "b.parquet", [_row("Then 1 + 1?", 7, "2", "synthetic/arithmetic")])
    dataset = RLHFDataset([str(a), str(b)], tokenizer, max_prompt_length=64)
    assert len(dataset) == 3
    item = dataset[0]
    text = "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n"
    assert item["input_ids"] == tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(item["input_ids"]) == text
    assert (item["ground_truth"], item["data_source"], item["index"]) == ("5", "openai/gsm8k", 0)
    assert item["raw_prompt"] == [{"role": "user", "content": "What is 2 + 3?"}]
    assert dataset[2]["data_source"] == "synthetic/arithmetic" and dataset[2]["index"] == 7
    assert dataset[2]["extra_info"] == {"split": "train", "index": 7}


def test_max_prompt_length_filter_and_truncation(tmp_path: Path, tokenizer: Any, caplog) -> None:
    long_question = "How many apples " * 20
    path = _write(tmp_path / "d.parquet", [_row("Short?", 0), _row(long_question, 1), _row("Tiny?", 2)])
    full = tokenizer.apply_chat_template(
        [{"role": "user", "content": long_question}], add_generation_prompt=True, tokenize=False
    )
    full_ids = tokenizer(full, add_special_tokens=False)["input_ids"]
    limit = 20
    assert len(full_ids) > limit

    with caplog.at_level(logging.WARNING, logger="fulcrum.data.dataset"):
        filtered = RLHFDataset(path, tokenizer, max_prompt_length=limit)
    assert [it["index"] for it in filtered] == [0, 2] and filtered.num_filtered == 1
    assert "dropped 1 of 3 prompts" in caplog.text

    with pytest.raises(
        DatasetError, match=rf"d.parquet, row 1: prompt is {len(full_ids)} tokens, longer than"
    ):
        RLHFDataset(path, tokenizer, max_prompt_length=limit, filter_overlong_prompts=False)
    left = RLHFDataset(path, tokenizer, limit, truncation="left", filter_overlong_prompts=False)
    right = RLHFDataset(path, tokenizer, limit, truncation="right", filter_overlong_prompts=False)
    middle = RLHFDataset(path, tokenizer, limit, truncation="middle", filter_overlong_prompts=False)
    assert left[1]["input_ids"] == full_ids[-limit:]  # keeps the generation prompt at the end
    assert right[1]["input_ids"] == full_ids[:limit]
    assert middle[1]["input_ids"] == full_ids[:10] + full_ids[-10:]
    assert left[0]["input_ids"] == filtered[0]["input_ids"]  # short prompts untouched
    with pytest.raises(DatasetError, match=r"data\.truncation must be one of"):
        RLHFDataset(path, tokenizer, limit, truncation="top")


def test_truncate_edges() -> None:
    assert truncate([1, 2, 3], 3, "left") == [1, 2, 3]
    assert truncate([1, 2, 3, 4, 5], 3, "middle") == [1, 4, 5]


def test_errors_name_the_file_and_column(tmp_path: Path, tokenizer: Any) -> None:
    with pytest.raises(DatasetError, match=r"data file not found: .*missing.parquet"):
        RLHFDataset(tmp_path / "missing.parquet", tokenizer, 64)
    junk = tmp_path / "junk.parquet"
    junk.write_bytes(b"this is not parquet")
    with pytest.raises(DatasetError, match=r"junk.parquet: not a readable parquet file"):
        RLHFDataset(junk, tokenizer, 64)
    rows = [_row("q", 0)]
    del rows[0]["reward_model"]
    no_reward = _write(tmp_path / "no_reward.parquet", rows)
    with pytest.raises(DatasetError, match=r"no_reward.parquet: missing column 'reward_model'"):
        RLHFDataset(no_reward, tokenizer, 64)
    good = _write(tmp_path / "good.parquet", [_row("q", 0)])
    with pytest.raises(DatasetError, match=r"good.parquet: missing column 'question'"):
        RLHFDataset(good, tokenizer, 64, prompt_key="question")
    plain = _write(tmp_path / "plain.parquet", [{**_row("q", 0), "prompt": "just a string"}])
    with pytest.raises(DatasetError, match=r"plain.parquet, row 0: column 'prompt' must be a non-empty list"):
        RLHFDataset(plain, tokenizer, 64)


@pytest.mark.parametrize("source", SOURCES, ids=SOURCE_IDS)
def test_gsm8k_test_split_tokenises_quickly(source: Path, tmp_path: Path, tokenizer: Any) -> None:
    paths = prepare_gsm8k(source, tmp_path)
    dataset = RLHFDataset(paths["test"], tokenizer, max_prompt_length=512)
    assert len(dataset) == expected_rows(source, "test") and dataset.num_filtered == 0
    first = gsm8k_rows(source, "test")[0]["answer"]
    assert dataset[0]["ground_truth"] == first.split("#### ")[-1].replace(",", "")
    assert all(len(it["input_ids"]) <= 512 for it in dataset)


def test_left_pad() -> None:
    input_ids, mask = left_pad([[5, 6, 7], [8], []], pad_id=0)
    assert input_ids.tolist() == [[5, 6, 7], [0, 0, 8], [0, 0, 0]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1], [0, 0, 0]]
    assert input_ids.dtype == mask.dtype == torch.long


def _indices(batches: list[list[dict[str, Any]]]) -> list[list[int]]:
    return [[item["index"] for item in batch] for batch in batches]


def test_prompt_loader_epochs_shuffle_and_drop_last() -> None:
    items = [{"index": i} for i in range(10)]
    loader = PromptLoader(items, batch_size=3, shuffle=True, seed=1)
    assert len(loader) == 3
    first, second = _indices(list(loader)), _indices(list(loader))
    assert [len(b) for b in first] == [3, 3, 3]
    assert len({i for b in first for i in b}) == 9  # no repeats within an epoch
    assert first != second and loader.epoch == 2
    assert _indices(list(PromptLoader(items, 3, shuffle=True, seed=1))) == first  # a function of the seed
    assert _indices(list(PromptLoader(items, 3, shuffle=False))) == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    assert [len(b) for b in PromptLoader(items, 3, shuffle=False, drop_last=False)] == [3, 3, 3, 1]
    with pytest.raises(ValueError, match="10 prompts, fewer than the batch size 11"):
        PromptLoader(items, 11)


def test_prompt_loader_resumes_exactly() -> None:
    items = [{"index": i} for i in range(12)]
    reference = PromptLoader(items, batch_size=4, seed=3)
    expected = _indices(list(reference) + list(reference) + list(reference))

    loader = PromptLoader(items, batch_size=4, seed=3)
    seen: list[list[dict[str, Any]]] = []
    for batch in loader:  # stop mid-epoch 0 after two batches, as a checkpoint would
        seen.append(batch)
        if len(seen) == 2:
            break
    state = loader.state_dict()
    assert state == {"epoch": 0, "position": 2, "prompts": 8, "seed": 3}
    assert all(type(v) is int for v in state.values())

    resumed = PromptLoader(items, batch_size=4, seed=99)
    resumed.load_state_dict(state)
    seen += list(resumed)
    # a checkpoint right after an epoch's last batch, before the loop asks for more
    iterator = iter(resumed)
    seen.append(next(iterator))
    seen.append(next(iterator))
    seen.append(next(iterator))
    again = PromptLoader(items, batch_size=4)
    again.load_state_dict(resumed.state_dict())
    assert again.state_dict() == {"epoch": 1, "position": 3, "prompts": 12, "seed": 3}
    seen += list(again)
    assert _indices(seen) == expected
