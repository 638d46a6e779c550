"""bench/passes_under_load.py: each training pass alone and beside CPU burners, with the host seconds spent
inside its micro-batch calls (never more than the pass's wall time)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from passes_under_load import HostInside, main


def test_host_inside_counts_the_calls_and_their_seconds_even_when_one_raises() -> None:
    inside = HostInside()
    wrapped = inside.wrap(lambda x: 1 / x)
    assert wrapped(2) == 0.5
    try:
        wrapped(0)
    except ZeroDivisionError:
        pass
    assert inside.calls == 2 and inside.seconds > 0
    inside.reset()
    assert (inside.calls, inside.seconds) == (0, 0.0)


def test_every_pass_is_timed_alone_and_loaded_on_the_cpu(tiny_dir: str, tmp_path: Path) -> None:
    out = tmp_path / "passes.json"
    args = ["--model", tiny_dir, "--device", "cpu", "--rows", "8", "--prompt-width", "320"]
    assert main([*args, "--response", "8", "--burn", "1", "--repeat", "1", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert set(result["passes"]) == {"old_log_prob", "values", "update_critic", "update_actor"}
    for loads in result["passes"].values():
        assert set(loads) == {"burn0", "burn1"}
        for entry in loads.values():
            (wall,), (host,) = entry["wall_s"], entry["host_inside_s"]
            assert 0 < host <= wall
