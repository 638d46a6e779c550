"""bench/tools/mlp_sweep.py: each launch's output is checked against the engine's path before it is timed,
and the summary names the best launch per case (under Triton's interpreter here: the path, not the timing)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from fulcrum.rollout.native.kernels import HAVE_TRITON

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench" / "tools"))

pytestmark = pytest.mark.skipif(
    not HAVE_TRITON or not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"),
    reason="needs triton and a CUDA device (or TRITON_INTERPRET=1)",
)


def test_the_sweep_checks_every_launch_and_names_the_best(tmp_path: Path) -> None:
    from mlp_sweep import main

    out = tmp_path / "mlp.json"
    main(["--small", "--json", str(out)])
    (case,) = json.loads(out.read_text())["cases"]
    assert len(case["rows"]) == 2  # both launches built and matched the product then SiLU·mul
    assert case["summary"]["best"] in case["rows"] and case["summary"]["tokens"] == 37
