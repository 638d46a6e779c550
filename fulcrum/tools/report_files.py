"""`fulcrum report`'s files: reading a run (metrics rows, saved configuration) and writing the page.

Every failure is a `ReportError` whose one-line message names the file (and line). The page replaces
an earlier report; any other existing file only with `--force`, and never a run's own files
(`fulcrum.tools.run_files`). It is written beside its target and renamed when whole.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fulcrum.tools.run_files import run_own_path

REPORT_TITLE = "<title>fulcrum report: "  # in the head of every page `render` writes: what marks ours


class ReportError(Exception):
    """A run that cannot be read or an output that may not be written; the one-line message names it."""


@dataclass
class Run:
    """One run as the report sees it: its name, folder, metrics rows and saved configuration."""

    name: str
    path: Path
    rows: list[dict[str, Any]]
    config: dict[str, Any] = field(default_factory=dict)


# ------------------------------------------------------------------------------------------ input
def load_run(path: str | Path) -> Run:
    """The run's metrics rows (oldest first) and its resolved configuration, if saved."""
    run_dir = Path(path).expanduser()
    if not run_dir.is_dir():
        raise ReportError(f"{run_dir}: no such run directory")
    metrics_file = run_dir / "metrics.jsonl"
    if not metrics_file.is_file():
        raise ReportError(f"{metrics_file}: not found (is {run_dir} a run directory?)")
    try:
        text = metrics_file.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ReportError(f"{metrics_file}: cannot read it ({_reason(exc)})") from exc
    rows = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ReportError(f"{metrics_file} line {number}: not JSON ({exc.msg})") from exc
        if not isinstance(row, dict):
            raise ReportError(f"{metrics_file} line {number}: not a JSON object")
        rows.append(row)
    if not rows:
        raise ReportError(f"{metrics_file}: no rows (the run logged no step)")
    config_file = run_dir / "config.yaml"
    config = load_config_yaml(config_file) if config_file.is_file() else {}
    return Run(run_dir.resolve().name, run_dir, rows, config)


def _reason(exc: BaseException) -> str:
    """An OS or decoding error in a few words (the path is named by the caller)."""
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror.lower()
    return str(exc)


def load_config_yaml(path: Path) -> dict[str, Any]:
    """A run's saved configuration as a plain dict; a ReportError naming the file and line when it is not
    YAML, and an empty dict when it holds no mapping."""
    import yaml
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        loaded = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or type(exc).__name__
        raise ReportError(f"{path}{where}: not valid YAML ({problem})") from exc
    except (OSError, UnicodeDecodeError, OmegaConfBaseException) as exc:
        raise ReportError(f"{path}: cannot read it ({_reason(exc)})") from exc
    return loaded if isinstance(loaded, dict) else {}


# ----------------------------------------------------------------------------------------- output
def is_earlier_report(path: Path) -> bool:
    """Whether `path` is a regular file that `fulcrum report` wrote (its head carries the report title)."""
    if path.is_symlink() or not path.is_file():
        return False
    try:
        with path.open("rb") as f:
            head = f.read(1024).decode("utf-8", errors="replace")
    except OSError:
        return False
    return head.startswith("<!DOCTYPE html>") and REPORT_TITLE in head


def check_out_file(out: Path, runs: list[Run], force: bool, flag: str) -> None:
    """Refuse an output that is a folder, lies in a missing folder, is a run's own file (even with
    `force`), or is an existing file other than an earlier report (unless `force`). `flag` names the
    output in messages ("--out FILE", or the default path)."""
    if out.is_dir():
        raise ReportError(f"{flag}: is a folder; name the file to write, e.g. {out / 'report.html'}")
    if not out.parent.is_dir():
        raise ReportError(f"{flag}: its folder {out.parent} does not exist; create it or choose another file")
    for run in runs:
        what = run_own_path(out, run.path, run.config)
        if what is not None:
            raise ReportError(
                f"{flag}: {what}; fulcrum report never writes there, even with --force; choose another file"
            )
    exists = out.exists() or out.is_symlink()
    if exists and not force and not is_earlier_report(out):
        raise ReportError(
            f"{flag}: exists and is not a report written by fulcrum report; pass --force to replace it, "
            "or choose another file"
        )


def write_report(out: Path, page: str, suggest_out: bool) -> None:
    """Write `page` to `out` through a temporary file beside it, renamed when whole: an interrupt or a
    full disk leaves the earlier file as it was and no partial one. OS errors become one-line ReportErrors."""
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(page, encoding="utf-8")
        os.replace(tmp, out)
    except OSError as exc:
        _remove(tmp)
        hint = "; pass --out FILE to write the report elsewhere" if suggest_out else ""
        raise ReportError(f"cannot write {out}: {_reason(exc)}{hint}") from exc
    except BaseException as exc:  # Ctrl-C or SIGTERM while writing
        if tmp.exists() and _remove(tmp):
            exc.add_note(f"removed the partial {tmp}")
        raise


def _remove(path: Path) -> bool:
    """Remove `path` if it is there; False when it cannot be (a read-only file system refuses even the
    removal of a file it never let be created)."""
    try:
        path.unlink(missing_ok=True)
    except OSError:
        return False
    return True
