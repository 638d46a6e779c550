"""`fulcrum data gsm8k`: verl's schema and prompt text, row counts, clear errors."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from gsm8k_data import FIXTURE_DIR, RELEASE_DIR, SOURCE_IDS, SOURCES, expected_rows
from gsm8k_data import rows as gsm8k_rows

from fulcrum.data.cli import main
from fulcrum.data.gsm8k import GSM8KError, extract_ground_truth, make_row, prepare_gsm8k
from fulcrum.reward.gsm8k import compute_score

INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'


@pytest.fixture(scope="module", params=SOURCES, ids=SOURCE_IDS)
def converted(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the GSM8K source folder, the folder `fulcrum data gsm8k` wrote from it)."""
    out = tmp_path_factory.mktemp("gsm8k")
    assert main(["gsm8k", "--src", str(request.param), "--out", str(out)]) == 0
    return request.param, out


def test_row_counts_and_columns(converted: tuple[Path, Path]) -> None:
    source, out = converted
    train, test = pq.read_table(out / "train.parquet"), pq.read_table(out / "test.parquet")
    assert (train.num_rows, test.num_rows) == (expected_rows(source, "train"), expected_rows(source, "test"))
    assert test.column_names == ["data_source", "prompt", "ability", "reward_model", "extra_info"]


def test_rows_are_verls_byte_for_byte(converted: tuple[Path, Path]) -> None:
    source_dir, out = converted
    source = gsm8k_rows(source_dir, "test")
    rows = pq.read_table(out / "test.parquet").to_pylist()
    for index, (row, raw) in enumerate(zip(rows, source, strict=True)):
        # verl: question_raw + " " + instruction, no stripping; ground truth after "#### " without commas.
        assert row["prompt"] == [{"role": "user", "content": raw["question"] + " " + INSTRUCTION}]
        assert row["data_source"] == "openai/gsm8k" and row["ability"] == "math"
        truth = raw["answer"].split("#### ")[-1].replace(",", "")
        assert row["reward_model"] == {"style": "rule", "ground_truth": truth}
        assert row["extra_info"] == {
            "split": "test",
            "index": index,
            "answer": raw["answer"],
            "question": raw["question"],
        }
        assert compute_score(row["extra_info"]["answer"], row["reward_model"]["ground_truth"]) == 1.0
    # the first test problem, a non-ASCII apostrophe kept: the release's, or the fixture's made-up one
    start, truth = FIRST_TEST_ROW[source_dir]
    assert rows[0]["prompt"][0]["content"].startswith(start)
    assert rows[0]["reward_model"]["ground_truth"] == truth


FIRST_TEST_ROW = {
    RELEASE_DIR: ("Janet\u2019s ducks lay 16 eggs per day.", "18"),
    FIXTURE_DIR: ("Ravi\u2019s shop gets 5 deliveries of a carton of eggs.", "61"),
}


def test_ground_truth_extraction() -> None:
    assert extract_ground_truth("so 1,000 + 2 = 1,002\n#### 1,002") == "1002"
    assert extract_ground_truth("#### -3.5") == "-3.5"
    assert extract_ground_truth("no final line") is None
    with pytest.raises(GSM8KError, match="no '#### <number>'"):
        make_row("q", "no final line", "train", 0)


def test_missing_files_are_named(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "train.jsonl").write_text('{"question": "q", "answer": "#### 1"}\n')
    assert main(["gsm8k", "--src", str(tmp_path), "--out", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert str(tmp_path / "test.jsonl") in err and "train.jsonl" not in err.split("lacks")[1].split(";")[0]
    assert not (tmp_path / "out").exists()


def test_bad_rows_are_named_by_file_and_line(tmp_path: Path) -> None:
    (tmp_path / "train.jsonl").write_text('{"question": "q", "answer": "#### 1"}\n')
    (tmp_path / "test.jsonl").write_text('{"question": "q", "answer": "#### 1"}\n{"question": "q"}\n')
    with pytest.raises(GSM8KError, match=r"test.jsonl:2: missing or non-string field\(s\) answer"):
        prepare_gsm8k(tmp_path, tmp_path / "out")
    (tmp_path / "test.jsonl").write_text('{"question": "q", "answer": "#### 1"}\n{oops\n')
    with pytest.raises(GSM8KError, match=r"test.jsonl:2: not valid JSON"):
        prepare_gsm8k(tmp_path, tmp_path / "out")
    (tmp_path / "test.jsonl").write_text('{"question": "q", "answer": "the end"}\n')
    with pytest.raises(GSM8KError, match=r"test.jsonl, row 0: answer has no"):
        prepare_gsm8k(tmp_path, tmp_path / "out")


def test_unknown_source_and_hub_without_datasets_say_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(GSM8KError, match="not a folder, nor the hub name openai/gsm8k"):
        prepare_gsm8k(tmp_path / "nowhere", tmp_path / "out")
    try:
        import datasets  # noqa: F401

        pytest.skip("datasets is installed: the hub path would try the network")
    except ImportError:
        pass
    with pytest.raises(GSM8KError, match=r"pip install datasets.*pass that folder as --src"):
        prepare_gsm8k("openai/gsm8k", tmp_path / "out")


def test_hub_source_through_datasets(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`--src openai/gsm8k` reads both splits through `datasets.load_dataset(name, "main")`."""
    calls = []

    def load_dataset(name: str, config: str) -> dict:
        calls.append((name, config))
        example = {"question": "Q?", "answer": "so\n#### 1,234"}
        return {"train": [example] * 3, "test": [example]}

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    paths = prepare_gsm8k("openai/gsm8k", tmp_path)
    assert calls == [("openai/gsm8k", "main")]
    assert pq.read_table(paths["train"]).num_rows == 3
    assert pq.read_table(paths["test"]).to_pylist()[0]["reward_model"]["ground_truth"] == "1234"

    def offline(name: str, config: str) -> dict:
        raise ConnectionError("no network")

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=offline))
    with pytest.raises(
        GSM8KError, match=r"could not load openai/gsm8k .*no network.*pass that folder as --src"
    ):
        prepare_gsm8k("openai/gsm8k", tmp_path / "out")


def test_the_interaction_variant_is_verls_gsm8k_multiturn_w_interaction(tmp_path: Path) -> None:
    """verl's gsm8k_multiturn_w_interaction.py: its system message, the backquoted instruction, and
    interaction_kwargs naming the gsm8k interaction with the prompt and the ground truth."""
    raw = {"question": "Tom has 2 apples and buys 1,000 more. How many?", "answer": "2+1000=1002\n#### 1,002"}
    for split in ("train", "test"):
        (tmp_path / f"{split}.jsonl").write_text(json.dumps(raw) + "\n")
    assert (
        main(["gsm8k", "--src", str(tmp_path), "--out", str(tmp_path / "out"), "--multi-turn-interaction"])
        == 0
    )
    (row,) = pq.read_table(tmp_path / "out" / "train.parquet").to_pylist()
    query = raw["question"] + " Let's think step by step and output the final answer after `####`."
    assert row["prompt"] == [
        {
            "role": "system",
            "content": "You are a math expert. You are given a question and you need to solve it step by step. "
            "You should rethinking carefully if user point out your answer is wrong. "
            "Put your final answer in the format of `#### <answer>`.",
        },
        {"role": "user", "content": query},
    ]
    assert row["reward_model"] == {"style": "rule", "ground_truth": "1002"}
    assert row["extra_info"]["interaction_kwargs"] == {
        "name": "gsm8k",
        "query": query,
        "ground_truth": "1002",
    }
    assert "tools_kwargs" not in row["extra_info"]
    with pytest.raises(SystemExit):  # one variant at a time
        main(
            [
                "gsm8k",
                "--src",
                str(tmp_path),
                "--out",
                str(tmp_path / "x"),
                "--multi-turn-tool",
                "--multi-turn-interaction",
            ]
        )
