"""The `fulcrum` command: one sub-command per job, each implemented by a module's `main(argv) -> int`.

Modules are imported only when their sub-command runs, so `fulcrum --help` stays fast and one broken
optional piece never stops the others. Ctrl-C or SIGTERM anywhere in a command ends it with one line
(what the command removed, when it says so) and exit 130 or 143, never a traceback.
"""

from __future__ import annotations

import importlib
import sys
from contextlib import nullcontext

from fulcrum.tools.interrupts import Terminated, interrupt_line, sigterm_raises

# sub-command -> (module, one-line help). The module defines `main(argv: list[str]) -> int`.
COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("fulcrum.trainer.main_ppo", "run PPO/GRPO training (no arguments: the built-in demo)"),
    "sft": ("fulcrum.trainer.sft", "supervised fine-tuning on prompt/response parquet data"),
    "data": ("fulcrum.data.cli", "prepare data sets: `fulcrum data gsm8k|math|humaneval ... --out DIR`"),
    "doctor": ("fulcrum.tools.doctor", "check a configuration before spending GPU time"),
    "eval": ("fulcrum.tools.evaluate", "evaluate a model or checkpoint on a data set: mean@1, pass@k, maj@k"),
    "report": ("fulcrum.tools.report", "write RUN_DIR/report.html with plots and a diagnosis"),
    "tune": ("fulcrum.tools.tune", "short probes over the throughput levers; prints the fastest that fits"),
    "export": ("fulcrum.tools.export", "a checkpoint's actor or critic as a Hugging Face folder"),
    "tiny-model": ("fulcrum.models.tiny", "write a small random-initialised model with a tokenizer"),
    "import-gguf": (
        "fulcrum.models.gguf_import",
        "a GGUF checkpoint (Llama, Qwen2) as a plain Hugging Face folder",
    ),
    "pretrained": ("fulcrum.models.pretrained", "fetch a known real pretrained model and convert it"),
}
# Commands that handle SIGTERM themselves: training stops after the current step and saves
# (`fulcrum.trainer.faults.GracefulInterrupt`), and under torchrun the launcher forwards the signal.
OWN_SIGTERM = frozenset({"train"})


def usage() -> str:
    """The help text: every sub-command with its one-line description."""
    width = max(len(c) for c in COMMANDS)
    lines = ["usage: fulcrum COMMAND [ARGS ...]", "", "commands:"]
    lines += [f"  {name:<{width}}  {help_}" for name, (_, help_) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Dispatch `fulcrum COMMAND ARGS...`; returns the exit code."""
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    name, rest = args[0], args[1:]
    if name not in COMMANDS:
        print(f"fulcrum: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    try:
        with nullcontext() if name in OWN_SIGTERM else sigterm_raises():
            return run_command(name, rest)
    except (KeyboardInterrupt, Terminated) as exc:
        line, code = interrupt_line(name, exc)
        print(line, file=sys.stderr)
        return code


def run_command(name: str, rest: list[str]) -> int:
    """Import sub-command `name`'s module and run its `main(rest)`; 2 when it is not in this version."""
    module_name = COMMANDS[name][0]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name != module_name:  # a real missing dependency: show it as it is
            raise
        print(f"fulcrum {name}: not available in this version of fulcrum", file=sys.stderr)
        return 2
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
