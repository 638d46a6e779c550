"""`fulcrum export`: the exported folders load offline in transformers and give the trained models' outputs."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModel, AutoModelForCausalLM, AutoModelForTokenClassification, AutoTokenizer

from fulcrum.models.tiny import build_tiny_model
from fulcrum.models.value_head import CriticModel
from fulcrum.tools.export import main as export_main
from fulcrum.trainer.checkpoint import CheckpointManager

TINY = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1}


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def trained_run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """A run folder with one checkpoint of an actor and a critic that took one AdamW step each."""
    arch = request.param
    model_dir = build_tiny_model(
        tmp_path_factory.mktemp(f"tiny-{arch}"), arch=arch, intermediate_size=64, **TINY
    )
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    torch.manual_seed(0)
    actor = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    actor.config.use_cache = False  # as training with gradient checkpointing leaves it
    critic = CriticModel(AutoModel.from_pretrained(model_dir, dtype=torch.float32))
    ids = torch.randint(0, 200, (2, 9))
    roles = {}
    for name, model in (("actor", actor), ("critic", critic)):
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        out = model(input_ids=ids)
        (out.logits if name == "actor" else out).pow(2).mean().backward()
        optimizer.step()
        roles[name] = SimpleNamespace(model=model.eval(), optimizer=optimizer, tokenizer=tokenizer)
    run_dir = tmp_path_factory.mktemp(f"run-{arch}")
    CheckpointManager(run_dir, None).save(5, roles, {"epoch": 0})
    return run_dir, roles, ids


def test_actor_export_loads_offline_with_equal_logits(trained_run, tmp_path: Path) -> None:
    run_dir, roles, ids = trained_run
    assert export_main([str(run_dir / "global_step_5"), "--out", str(tmp_path / "hf")]) == 0
    assert not (tmp_path / "hf" / "optimizer.pt").exists()
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["use_cache"] is True
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", local_files_only=True, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "hf", local_files_only=True)
    assert tokenizer.decode(tokenizer.encode("Natalia sold 48 clips.")) == "Natalia sold 48 clips."
    with torch.no_grad():
        expected = roles["actor"].model(input_ids=ids).logits
        got = model.eval()(input_ids=ids).logits
    assert torch.equal(got, expected)


def test_critic_export_is_a_token_classification_model_giving_the_values(trained_run, tmp_path: Path) -> None:
    run_dir, roles, ids = trained_run
    # A run folder resolves to its newest complete checkpoint.
    assert export_main([str(run_dir), "--out", str(tmp_path / "critic"), "--role", "critic"]) == 0
    model = AutoModelForTokenClassification.from_pretrained(tmp_path / "critic", local_files_only=True)
    assert model.config.num_labels == 1
    with torch.no_grad():
        expected = roles["critic"].model(input_ids=ids)  # (B, T)
        got = model.eval()(input_ids=ids).logits[..., 0]  # (B, T)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)


def test_export_casts_dtype_and_reports_bad_input(trained_run, tmp_path: Path, capsys) -> None:
    run_dir, roles, ids = trained_run
    out = tmp_path / "bf16"
    assert export_main([str(run_dir / "global_step_5"), "--out", str(out), "--dtype", "bfloat16"]) == 0
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    model = AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    assert model.dtype == torch.bfloat16
    with torch.no_grad():
        expected = roles["actor"].model(input_ids=ids).logits
        got = model.eval()(input_ids=ids).logits.float()
    assert (got - expected).abs().max() < 0.1  # bf16 rounding of weights, not a different model

    assert export_main([str(run_dir / "global_step_5"), "--out", str(out)]) == 1
    assert "pass --force" in capsys.readouterr().err
    assert export_main([str(run_dir / "global_step_6"), "--out", str(tmp_path / "x")]) == 1
    assert "global_step_6: no such checkpoint folder" in capsys.readouterr().err
    (run_dir / "global_step_9.tmp-1").mkdir(exist_ok=True)  # a run folder's temp folders are never exported
    assert export_main([str(run_dir), "--out", str(tmp_path / "y"), "--role", "critic"]) == 0


def test_export_never_deletes_its_source_or_other_folders(trained_run, tmp_path: Path, capsys) -> None:
    run_dir, _, _ = trained_run
    before = sorted(p.relative_to(run_dir) for p in run_dir.rglob("*"))
    # --out equal to, inside, or containing the source run: refused, even with --force.
    for out in (run_dir, run_dir / "global_step_5" / "hf", run_dir.parent):
        assert export_main([str(run_dir), "--out", str(out), "--force"]) == 1
        assert "source run" in capsys.readouterr().err
    assert sorted(p.relative_to(run_dir) for p in run_dir.rglob("*")) == before
    # A non-empty folder that no export wrote (say a sibling run) is never replaced.
    sibling = tmp_path / "other_run"
    sibling.mkdir()
    (sibling / "metrics.jsonl").write_text("{}\n")
    assert export_main([str(run_dir), "--out", str(sibling), "--force"]) == 1
    assert "not written by fulcrum export" in capsys.readouterr().err
    assert (sibling / "metrics.jsonl").read_text() == "{}\n"
    # A previous export is replaced with --force, and only with it.
    out = tmp_path / "hf"
    assert export_main([str(run_dir), "--out", str(out)]) == 0
    assert export_main([str(run_dir), "--out", str(out)]) == 1
    assert "pass --force" in capsys.readouterr().err
    assert export_main([str(run_dir), "--out", str(out), "--dtype", "bfloat16", "--force"]) == 0
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "other_run"]  # no temp folders left


def test_export_refuses_a_damaged_checkpoint(trained_run, tmp_path: Path, capsys) -> None:
    run_dir, _, _ = trained_run
    damaged = tmp_path / "run" / "global_step_5"
    shutil.copytree(run_dir / "global_step_5", damaged)
    weights = damaged / "actor" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF  # same size, other bytes
    weights.write_bytes(bytes(data))
    assert export_main([str(damaged), "--out", str(tmp_path / "hf")]) == 1
    err = capsys.readouterr().err
    assert "model.safetensors" in err and "SHA-256" in err
    assert not (tmp_path / "hf").exists()
