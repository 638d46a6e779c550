"""Peak GPU memory allocated in each training-side phase, for any tree (also trees from before the
trainer reported `perf/max_memory_allocated_gb/<phase>` itself).

    PYTHONPATH=<tree> python bench/phase_peaks.py --json peaks.json -- <bench/train_step.py run arguments>

Wraps the workers' phase methods (old log-probs, reference log-probs, values, actor update, critic
update): the peak counter is reset on entry and read on exit, the largest reading per phase over
all steps is kept. Then runs `bench/train_step.py run` of the tree on PYTHONPATH with the arguments
after `--`. The figures are what `torch.cuda.max_memory_allocated` reports, as the trainer's metric.
"""

from __future__ import annotations

import argparse
import functools
import json
import runpy
import sys
from pathlib import Path

import torch

GiB = 1024**3
PHASES = {
    "fulcrum.workers.actor": {
        "ActorWorker": {"compute_log_prob": "old_log_prob", "update_policy": "update_actor"},
        "ReferenceWorker": {"compute_ref_log_prob": "ref"},
    },
    "fulcrum.workers.critic": {
        "CriticWorker": {"compute_values": "values", "update_critic": "update_critic"}
    },
}


def wrap(cls: type, method: str, phase: str, peaks: dict[str, float]) -> None:
    inner = getattr(cls, method)

    @functools.wraps(inner)
    def measured(*args, **kwargs):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        try:
            return inner(*args, **kwargs)
        finally:
            torch.cuda.synchronize()
            peaks[phase] = max(peaks.get(phase, 0.0), torch.cuda.max_memory_allocated() / GiB)

    setattr(cls, method, measured)


def main() -> int:
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument(
        "--train-step", type=Path, default=None, help="bench/train_step.py to run (default: the tree's)"
    )
    args = parser.parse_args(argv[:split])
    import importlib

    peaks: dict[str, float] = {}
    for module_name, classes in PHASES.items():
        module = importlib.import_module(module_name)
        for class_name, methods in classes.items():
            cls = getattr(module, class_name, None)
            for method, phase in methods.items():
                if cls is not None and hasattr(cls, method):
                    wrap(cls, method, phase, peaks)
    import fulcrum

    script = args.train_step or Path(fulcrum.__file__).resolve().parent.parent / "bench" / "train_step.py"
    sys.argv = [str(script), *argv[split + 1 :]]
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as exit_:
        if exit_.code not in (0, None):
            raise
    finally:
        args.json.write_text(json.dumps({"peak_allocated_gib": peaks}, indent=1))
        print("phase peaks (GiB):", {k: round(v, 2) for k, v in peaks.items()}, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
