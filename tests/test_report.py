"""`fulcrum report`: one self-contained HTML page (plots embedded, nothing from the network) with the
diagnosis, for one run or two compared; it renders in headless Chromium without console errors."""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from fulcrum.tools import report
from fulcrum.trainer.loggers import JsonlLogger

# The rows of a healthy run live in test_diagnosis.py; load it by path so this works however pytest runs.
_spec = importlib.util.spec_from_file_location(
    "_test_diagnosis", Path(__file__).with_name("test_diagnosis.py")
)
_test_diagnosis = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_test_diagnosis)
healthy_rows = _test_diagnosis.healthy_rows


def write_run(run_dir: Path, rows: list[dict[str, Any]]) -> Path:
    """A run directory as the trainer leaves it: metrics.jsonl written by the trainer's own logger."""
    logger = JsonlLogger(run_dir)
    for row in rows:
        row = dict(row)
        step = row.pop("step")
        logger.log({k: float(v) for k, v in row.items()}, step=step)
    logger.close()
    (run_dir / "config.yaml").write_text("data:\n  train_batch_size: 512\n  max_response_length: 256\n")
    return run_dir


def spiky_rows() -> list[dict[str, Any]]:
    rows = healthy_rows()
    rows[8]["actor/ppo_kl"] = 0.08
    rows[-1]["val-core/openai/gsm8k/reward/mean@1"] = 0.31
    return rows


def test_report_is_one_self_contained_page(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = write_run(tmp_path / "run", spiky_rows())
    assert report.main([str(run)]) == 0
    page = (run / "report.html").read_text()
    images = re.findall(r'<img alt="[^"]*" src="data:image/png;base64,[A-Za-z0-9+/=]+">', page)
    assert len(images) >= 8  # step time by phase and the metric panels this run logged
    assert not re.search(r'(src|href)="(https?:)?//', page)  # nothing fetched to view it
    assert "<script" not in page
    assert "the bottleneck is update_actor: 50% of step time" in page
    assert "kl_spike" in page and "actor/ppo_kl = 0.08" in page
    assert "val-core/openai/gsm8k/reward/mean@1" in page
    assert "Entropy and critic explained variance: not logged in this run" not in page
    assert "Memory (GiB)" in page
    out = capsys.readouterr().out
    assert f"wrote {run / 'report.html'}" in out and "diagnosis (kl_spike) step 9" in out


@pytest.fixture(scope="module")
def compared(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """One report comparing a run with a KL spike and a healthy one (rendered once for the module)."""
    root = tmp_path_factory.mktemp("compare")
    first = write_run(root / "ppo-lr1e-6", spiky_rows())
    second = write_run(root / "ppo-lr5e-7", healthy_rows())
    page = root / "cmp.html"
    assert report.main([str(first), "--compare", str(second), "--out", str(page)]) == 0
    return page, first, second


def test_compare_two_runs(compared: tuple[Path, Path, Path]) -> None:
    page, first, _ = compared
    text = page.read_text()
    assert "ppo-lr1e-6 vs ppo-lr5e-7" in text and "dashed" in text
    assert text.count("<h3>") == 2  # a diagnosis per run
    assert text.count("kl_spike") == 1  # only the first run spiked
    assert not (first / "report.html").exists()  # --out was given


def test_unreadable_runs_are_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert report.main([str(tmp_path / "nowhere")]) == 1
    assert "nowhere: no such run directory" in capsys.readouterr().err
    run = write_run(tmp_path / "run", healthy_rows(3))
    with (run / "metrics.jsonl").open("a") as f:
        f.write("{truncated\n")
    assert report.main([str(run)]) == 1
    assert "metrics.jsonl line 4: not JSON" in capsys.readouterr().err


# ------------------------------------------------------------------------------------ in a browser
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None, reason="no chromium on this machine (apt-get install chromium)"
)
# Run after the page loads: every image decoded, written into the DOM that --dump-dom prints.
IMAGE_PROBE = """<script>window.addEventListener("load", () => {
  const bad = [...document.images].filter((i) => !(i.complete && i.naturalWidth > 0));
  document.body.setAttribute("data-images", document.images.length + " loaded, " + bad.length + " broken");
});</script>"""


def chromium(page: Path, *args: str) -> subprocess.CompletedProcess[str]:
    command = [
        CHROMIUM,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--enable-logging=stderr",
        "--log-level=0",
    ]
    return subprocess.run(
        [*command, *args, page.as_uri()], capture_output=True, text=True, timeout=120, check=True
    )


def console_messages(result: subprocess.CompletedProcess[str]) -> list[str]:
    """Chromium logs each console message (errors and uncaught exceptions included) as `:CONSOLE`."""
    return [line for line in result.stderr.splitlines() if ":CONSOLE" in line]


def broken_images(page: Path) -> str:
    probed = page.with_name("probe-" + page.name)
    probed.write_text(page.read_text().replace("</body>", IMAGE_PROBE + "</body>"))
    dom = chromium(probed, "--virtual-time-budget=5000", "--dump-dom").stdout
    found = re.search(r'data-images="([^"]*)"', dom)
    assert found, "the probe did not run"
    return found.group(1)


@needs_chromium
def test_the_check_catches_a_broken_page(tmp_path: Path) -> None:
    """The browser check is real: a console error and a missing image are caught."""
    bad = tmp_path / "bad.html"
    bad.write_text('<html><body><img src="missing.png"><script>console.error("boom")</script></body></html>')
    assert any("boom" in line for line in console_messages(chromium(bad, "--dump-dom")))
    assert broken_images(bad) == "1 loaded, 1 broken"


@needs_chromium
def test_report_renders_in_headless_chromium(compared: tuple[Path, Path, Path], tmp_path: Path) -> None:
    page = compared[0]
    shot = tmp_path / "report.png"
    result = chromium(page, "--window-size=1200,2400", f"--screenshot={shot}")
    assert console_messages(result) == []
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000
    n_images = page.read_text().count("<img ")
    assert broken_images(page) == f"{n_images} loaded, 0 broken"


def test_a_read_only_run_says_one_line_and_writes_elsewhere_with_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The run directory on a read-only file system (a mounted archive): every write and every removal
    there fails with EROFS, as the kernel answers even for root. One line suggests --out, which works."""
    import errno
    import os

    run = write_run(tmp_path / "run", spiky_rows()).resolve()
    before = sorted(p.name for p in run.iterdir())

    def guard(real):
        def call(self: Path, *args: Any, **kwargs: Any) -> Any:
            if Path(self).resolve().is_relative_to(run):
                raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(self))
            return real(self, *args, **kwargs)

        return call

    monkeypatch.setattr(Path, "write_text", guard(Path.write_text))
    monkeypatch.setattr(Path, "unlink", guard(Path.unlink))
    assert report.main([str(run)]) == 1
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [
        f"fulcrum report: cannot write {run / 'report.html'}: read-only file system; "
        "pass --out FILE to write the report elsewhere"
    ]
    assert sorted(p.name for p in run.iterdir()) == before
    out = tmp_path / "elsewhere.html"
    assert report.main([str(run), "--out", str(out)]) == 0
    assert out.read_text().startswith("<!DOCTYPE html>")
