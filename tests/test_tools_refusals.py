"""The tool commands (`report`, `export`, `tune`, `data`) never write over what is not theirs, and a
refusal, an interrupt (Ctrl-C, SIGTERM) or a full disk ends with one line, no traceback and nothing
partial left behind."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from fulcrum.cli import COMMANDS
from fulcrum.cli import main as fulcrum
from fulcrum.tools import export, report_files, tune, tune_trial
from fulcrum.trainer.checkpoint import CheckpointManager

# ------------------------------------------------------------------------------------------ helpers


def one_line(err: str) -> str:
    """stderr of a refused command: exactly one line, no traceback."""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def tree(root: Path) -> dict[str, bytes | None]:
    """Every path under `root` with its content (None for folders): to assert nothing changed."""
    return {
        str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None) for p in sorted(root.rglob("*"))
    }


@pytest.fixture
def run(tmp_path: Path) -> Path:
    """A run directory as the trainer leaves it (two metrics rows, its config naming its inputs, a
    checkpoint folder), beside its data file."""
    data = tmp_path / "data" / "train.parquet"
    data.parent.mkdir()
    data.write_bytes(b"PAR1 the user's data")
    run_dir = tmp_path / "run"
    (run_dir / "global_step_2" / "actor").mkdir(parents=True)
    (run_dir / "global_step_2" / "actor" / "model.safetensors").write_bytes(b"weights")
    rows = [{"training/global_step": s, "step": s, "critic/score/mean": 0.1 * s} for s in (1, 2)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run_dir / "config.yaml").write_text(f"data:\n  train_files: {data}\n  train_batch_size: 8\n")
    return run_dir


# ------------------------------------------------------------------------------------------- report


def test_report_never_writes_over_the_runs_own_files_even_with_force(run: Path, capsys) -> None:
    before = tree(run.parent)
    own = [
        (run / "metrics.jsonl", "the run's own metrics.jsonl"),
        (run / "config.yaml", "the run's own config.yaml"),
        (run / "global_step_2" / "actor" / "model.safetensors", "checkpoint global_step_2"),
        (run / "global_step_2" / "new.html", "checkpoint global_step_2"),  # not even a new file in it
        (run.parent / "data" / "train.parquet", "data.train_files"),
    ]
    for path, what in own:
        for force in ([], ["--force"]):
            assert fulcrum(["report", str(run), "--out", str(path), *force]) == 1
            line = one_line(capsys.readouterr().err)
            assert what in line and "even with --force" in line
    assert tree(run.parent) == before


def test_report_replaces_another_file_only_with_force(run: Path, tmp_path: Path, capsys) -> None:
    notes = tmp_path / "notes.html"
    notes.write_text("my notes")
    assert fulcrum(["report", str(run), "--out", str(notes)]) == 1
    assert "pass --force" in one_line(capsys.readouterr().err)
    assert notes.read_text() == "my notes"
    assert fulcrum(["report", str(run), "--out", str(notes), "--force"]) == 0
    assert report_files.is_earlier_report(notes)
    # A report it wrote is its own: the next report replaces it without --force.
    assert fulcrum(["report", str(run), "--out", str(notes)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "notes.html", "run"]  # no temp file


def test_a_users_report_html_in_the_run_is_not_replaced(run: Path, capsys) -> None:
    (run / "report.html").write_text("<html>the user's own page</html>")
    assert fulcrum(["report", str(run)]) == 1
    assert "not a report written by fulcrum report" in one_line(capsys.readouterr().err)
    assert (run / "report.html").read_text() == "<html>the user's own page</html>"


def test_report_output_folder_problems_are_one_line(run: Path, tmp_path: Path, capsys) -> None:
    assert fulcrum(["report", str(run), "--out", str(tmp_path)]) == 1
    assert "is a folder" in one_line(capsys.readouterr().err)
    assert fulcrum(["report", str(run), "--out", str(tmp_path / "missing" / "r.html")]) == 1
    assert f"{tmp_path / 'missing'} does not exist" in one_line(capsys.readouterr().err)
    assert not (tmp_path / "missing").exists()


def test_report_on_an_unparseable_config_names_the_file_and_line(run: Path, capsys) -> None:
    (run / "config.yaml").write_text("data:\n  train_batch_size: 8\n  train_files: [a, b\n  x: 1\n")
    assert fulcrum(["report", str(run)]) == 1
    line = one_line(capsys.readouterr().err)
    assert f"{run / 'config.yaml'} line 4: not valid YAML" in line
    assert not (run / "report.html").exists()


def test_report_into_a_run_directory_it_cannot_write(run: Path, monkeypatch, capsys) -> None:
    """A read-only run directory (simulated: the tests may run as root, whom chmod does not stop)."""
    real_write_text = Path.write_text

    def read_only(self: Path, *args: object, **kwargs: object) -> int:
        if self.parent == run:
            raise PermissionError(errno.EACCES, "Permission denied", str(self))
        return real_write_text(self, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", read_only)
    before = tree(run)
    assert fulcrum(["report", str(run)]) == 1
    line = one_line(capsys.readouterr().err)
    assert f"cannot write {run / 'report.html'}: permission denied" in line and "pass --out FILE" in line
    assert tree(run) == before


# ------------------------------------------------------------------------------------------- export


@pytest.fixture(scope="module")
def checkpoint(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run folder with one complete actor checkpoint, global_step_5."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    role = SimpleNamespace(
        model=model,
        optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
        tokenizer=AutoTokenizer.from_pretrained(tiny_model),
    )
    run_dir = tmp_path_factory.mktemp("run")
    CheckpointManager(run_dir, None).save(5, {"actor": role}, {"epoch": 0})
    return run_dir / "global_step_5"


def test_export_refuses_a_file_or_a_symbolic_link_as_out(checkpoint: Path, tmp_path: Path, capsys) -> None:
    file = tmp_path / "model.txt"
    file.write_text("a user's file")
    target = tmp_path / "real"
    target.mkdir()
    link = tmp_path / "linkout"
    link.symlink_to(target)
    for force in ([], ["--force"]):
        assert fulcrum(["export", str(checkpoint), "--out", str(file), *force]) == 1
        assert "is a file, not a folder" in one_line(capsys.readouterr().err)
        assert fulcrum(["export", str(checkpoint), "--out", str(link), *force]) == 1
        assert "is a symbolic link" in one_line(capsys.readouterr().err)
    assert file.read_text() == "a user's file"
    assert link.is_symlink() and not any(target.iterdir())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["linkout", "model.txt", "real"]


def test_export_copies_only_the_files_its_manifest_lists(checkpoint: Path, tmp_path: Path, capsys) -> None:
    planted = checkpoint / "actor" / "pytorch_model.bin"
    planted.write_bytes(b"not checked by any manifest")
    try:
        assert fulcrum(["export", str(checkpoint), "--out", str(tmp_path / "hf")]) == 0
    finally:
        planted.unlink()
    assert not (tmp_path / "hf" / "pytorch_model.bin").exists()
    assert (tmp_path / "hf" / "model.safetensors").is_file()
    assert (
        "left out 1 file(s) its manifest does not list (unchecked): pytorch_model.bin"
        in capsys.readouterr().out
    )


def interrupt_after_first_copy(monkeypatch: pytest.MonkeyPatch, interrupt: object) -> None:
    """Export's file copy: the first file is copied, then `interrupt()` runs (Ctrl-C, SIGTERM, a full disk)."""
    real_copy = shutil.copy2
    copied: list[str] = []

    def copy(src: Path, dst: Path) -> object:
        if copied:
            interrupt()  # type: ignore[operator]
        copied.append(str(src))
        return real_copy(src, dst)

    monkeypatch.setattr(export.shutil, "copy2", copy)


def ctrl_c() -> None:
    raise KeyboardInterrupt


def sigterm() -> None:
    """The real signal, to this process (where `fulcrum` must have a handler: SIGTERM's default action
    would end the process on the spot, its partial output left behind, and this test run with it)."""
    if signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
        pytest.fail("no SIGTERM handler: the process would die here, leaving its partial output")
    os.kill(os.getpid(), signal.SIGTERM)


def interrupted(args: list[str]) -> int:
    """`fulcrum ARGS`, where an interrupt that escapes is a failure (the user would see a traceback)."""
    try:
        return fulcrum(args)
    except KeyboardInterrupt:
        pytest.fail("the interrupt escaped `fulcrum` as a traceback")


@pytest.mark.parametrize(("interrupt", "code", "what"), [(ctrl_c, 130, "Ctrl-C"), (sigterm, 143, "SIGTERM")])
def test_an_interrupted_export_leaves_nothing_and_says_so_in_one_line(
    checkpoint: Path, tmp_path: Path, monkeypatch, capsys, interrupt, code: int, what: str
) -> None:
    out = tmp_path / "exports" / "hf"  # its parent folder is created by the export
    interrupt_after_first_copy(monkeypatch, interrupt)
    assert interrupted(["export", str(checkpoint), "--out", str(out)]) == code
    line = one_line(capsys.readouterr().err)
    assert line.startswith(f"fulcrum export: interrupted ({what}); removed the partial export {out}.tmp-")
    assert list(tmp_path.iterdir()) == []


def test_an_interrupted_force_export_keeps_the_previous_export(
    checkpoint: Path, tmp_path: Path, monkeypatch, capsys
) -> None:
    out = tmp_path / "hf"
    assert fulcrum(["export", str(checkpoint), "--out", str(out)]) == 0
    before = tree(out)
    interrupt_after_first_copy(monkeypatch, ctrl_c)
    assert (
        interrupted(["export", str(checkpoint), "--out", str(out), "--force", "--dtype", "bfloat16"]) == 130
    )
    assert tree(out) == before
    assert [p.name for p in tmp_path.iterdir()] == ["hf"]


def test_a_full_disk_during_export_names_the_path_and_leaves_nothing(
    checkpoint: Path, tmp_path: Path, monkeypatch, capsys
) -> None:
    def disk_full() -> None:
        raise OSError(
            errno.ENOSPC, "No space left on device", str(tmp_path / "hf.tmp-1" / "model.safetensors")
        )

    interrupt_after_first_copy(monkeypatch, disk_full)
    assert fulcrum(["export", str(checkpoint), "--out", str(tmp_path / "hf")]) == 1
    line = one_line(capsys.readouterr().err)
    assert "no space left on device" in line and "nothing was left behind" in line
    assert list(tmp_path.iterdir()) == []


# --------------------------------------------------------------------------------------------- tune


def fake_trial(base: list[str], trial: tune.Trial, work: Path, *args: object) -> tune.Trial:
    """A trial that 'ran' without training, in its own trial folder."""
    tune_trial.next_trial_dir(work).mkdir()
    trial.outcome, trial.throughput = "ran", 100.0
    return trial


TUNE_ARGS = ["trainer.device=cpu", "--levers", "checkpointing", "--max-trials", "2"]


def test_tune_refuses_a_work_dir_that_is_a_file(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.setattr(tune, "run_trial", fake_trial)
    file = tmp_path / "work"
    file.write_text("a user's file")
    assert fulcrum(["tune", *TUNE_ARGS, "--work-dir", str(file)]) == 1
    assert "is a file, not a folder" in one_line(capsys.readouterr().err)
    assert file.read_text() == "a user's file"


def test_a_trial_after_a_gap_in_the_trial_folders_takes_the_next_free_number(
    tmp_path: Path, monkeypatch
) -> None:
    """trial-1 was removed by hand: the next trial is trial-3, and trial-2 stays as it was."""
    for n in (0, 2):
        (tmp_path / f"trial-{n}").mkdir()
    (tmp_path / "trial-2" / "trial.log").write_text("an earlier trial")
    process = SimpleNamespace(pid=0, wait=lambda timeout=None: 1, poll=lambda: 1)
    monkeypatch.setattr(tune_trial.subprocess, "Popen", lambda *a, **k: process)
    trial = tune_trial.run_trial([], tune.Trial({}), tmp_path, steps=2, timeout=10.0)
    assert trial.log == tmp_path / "trial-3" / "trial.log"
    assert (tmp_path / "trial-2" / "trial.log").read_text() == "an earlier trial"


def test_tune_keeps_an_earlier_tunes_record_and_refuses_a_foreign_one(
    tmp_path: Path, monkeypatch, capsys
) -> None:
    monkeypatch.setattr(tune, "run_trial", fake_trial)
    assert fulcrum(["tune", *TUNE_ARGS, "--work-dir", str(tmp_path)]) == 0
    first = json.loads((tmp_path / "trials.json").read_text())
    assert fulcrum(["tune", *TUNE_ARGS, "--work-dir", str(tmp_path)]) == 0
    record = json.loads((tmp_path / "trials.json").read_text())
    assert record[: len(first)] == first and len(record) == 2 * len(first)
    assert sorted(p.name for p in tmp_path.glob("trial-*")) == [f"trial-{n}" for n in range(len(record))]
    capsys.readouterr()
    (tmp_path / "trials.json").write_text('{"a user": "file"}')
    assert fulcrum(["tune", *TUNE_ARGS, "--work-dir", str(tmp_path)]) == 1
    assert "did not write" in one_line(capsys.readouterr().err)
    assert (tmp_path / "trials.json").read_text() == '{"a user": "file"}'


# --------------------------------------------------------------------------------------------- data


@pytest.fixture
def gsm8k_src(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    src.mkdir()
    row = {"question": "What is 2 + 3?", "answer": "2 + 3 = 5\n#### 5"}
    for split in ("train", "test"):
        (src / f"{split}.jsonl").write_text(json.dumps(row) + "\n")
    return src


def fail_second_write(monkeypatch: pytest.MonkeyPatch, interrupt: object) -> None:
    """The parquet writer of `fulcrum data gsm8k`: the train split is written, then `interrupt()` runs."""
    import fulcrum.data.gsm8k as gsm8k

    real_write = gsm8k.pq.write_table
    written: list[object] = []

    def write(table: object, where: object, *args: object, **kwargs: object) -> None:
        if written:
            interrupt()  # type: ignore[operator]
        written.append(where)
        real_write(table, where, *args, **kwargs)

    monkeypatch.setattr(gsm8k.pq, "write_table", write)


@pytest.mark.parametrize(("interrupt", "code"), [(ctrl_c, 130), (sigterm, 143)])
def test_an_interrupted_data_command_leaves_nothing(
    gsm8k_src: Path, tmp_path: Path, monkeypatch, capsys, interrupt, code: int
) -> None:
    out = tmp_path / "new" / "gsm8k"
    fail_second_write(monkeypatch, interrupt)
    assert interrupted(["data", "gsm8k", "--src", str(gsm8k_src), "--out", str(out)]) == code
    assert f"nothing was written to {out}" in one_line(capsys.readouterr().err)
    assert not (tmp_path / "new").exists()


def test_a_full_disk_in_the_data_command_leaves_the_users_folder_as_it_was(
    gsm8k_src: Path, tmp_path: Path, monkeypatch, capsys
) -> None:
    out = tmp_path / "mine"
    out.mkdir()
    (out / "README").write_text("the user's folder")

    def disk_full() -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    fail_second_write(monkeypatch, disk_full)
    assert fulcrum(["data", "gsm8k", "--src", str(gsm8k_src), "--out", str(out)]) == 1
    assert "No space left on device" in one_line(capsys.readouterr().err)
    assert tree(out) == {"README": b"the user's folder"}


def test_a_full_disk_while_writing_the_report_keeps_the_earlier_one(run: Path, monkeypatch, capsys) -> None:
    assert fulcrum(["report", str(run)]) == 0
    earlier = (run / "report.html").read_bytes()
    real_write_text = Path.write_text

    def disk_full(self: Path, text: str, *args: object, **kwargs: object) -> int:
        real_write_text(self, text[: len(text) // 2], *args, **kwargs)  # half written, then no space
        raise OSError(errno.ENOSPC, "No space left on device", str(self))

    monkeypatch.setattr(Path, "write_text", disk_full)
    assert fulcrum(["report", str(run)]) == 1
    assert f"cannot write {run / 'report.html'}: no space left on device" in one_line(capsys.readouterr().err)
    assert (run / "report.html").read_bytes() == earlier
    assert not [p.name for p in run.iterdir() if ".tmp-" in p.name]


# ---------------------------------------------------------------------------------------------- cli


def test_ctrl_c_in_any_command_ends_with_one_line(monkeypatch, capsys) -> None:
    def interrupted_main(argv: list[str]) -> int:
        raise KeyboardInterrupt

    monkeypatch.setitem(sys.modules, "fulcrum_interrupted", SimpleNamespace(main=interrupted_main))
    monkeypatch.setitem(COMMANDS, "later", ("fulcrum_interrupted", "a command interrupted at once"))
    assert interrupted(["later"]) == 130
    assert one_line(capsys.readouterr().err) == "fulcrum later: interrupted (Ctrl-C)"
