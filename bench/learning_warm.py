"""bench/learning.py's warm start: `fulcrum sft` with a checkpoint every few steps, each checked greedy
on the dev set while SFT trains on, and the choice of the checkpoint RL starts from.

Run to the end (1,500 steps, 2026-11-30 on an H200), SFT alone reached 0.996 greedy accuracy on the
multi-step task and RL had nothing left to gain. Format is learned long before the answers (on the
CPU a 1.3 M model had format 1.00 at step 100 with accuracy 0.04), so stopping at the format alone
would start RL near zero: `choose_warm_start` asks for both the format and some accuracy, under a
ceiling.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


def _env(threads: int) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    if threads:
        env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(threads)
    return env


def fulcrum(*args: str) -> list[str]:
    """The `fulcrum` command as this Python runs it (`python -m fulcrum.cli` is the console script)."""
    return [sys.executable, "-m", "fulcrum.cli", *args]


def _step(checkpoint: Path) -> int:
    return int(checkpoint.name.split("_")[-1])


def _checkpoints(sft: Path) -> list[Path]:
    """Complete checkpoints in step order (`fulcrum sft` renames each into place once written)."""
    return sorted((p for p in sft.glob("global_step_*") if p.is_dir()), key=_step)


def choose_warm_start(checks: list[dict], plan: Any) -> dict | None:
    """The warm start among `checks` (greedy dev checks in step order, each with `accuracy` and
    `format_accuracy`), or None while none qualifies: the first with format >= min_format_accuracy and
    accuracy >= warm_min_accuracy; when that one is above warm_max_accuracy (accuracy can jump between
    two checks) the check before it, if it has the format: room to learn is what RL is measured on."""
    for i, check in enumerate(checks):
        if (
            check["format_accuracy"] >= plan.min_format_accuracy
            and check["accuracy"] >= plan.warm_min_accuracy
        ):
            before = checks[i - 1] if i else None
            formatted = before is not None and before["format_accuracy"] >= plan.min_format_accuracy
            return before if check["accuracy"] > plan.warm_max_accuracy and formatted else check
    return None


def sft_command(out: Path, base: Path, plan: Any) -> list[str]:
    data = out / "data"
    return fulcrum(
        "sft",
        f"data.train_files={data / 'train.parquet'}",
        "data.prompt_key=prompt",  # the very chat messages the RL stage sees
        "data.response_key=extra_info",
        "data.response_dict_keys=[answer]",
        f"data.train_batch_size={plan.sft_batch_size}",
        f"data.max_length={plan.max_prompt_length + plan.max_response_length}",
        "data.truncation=right",  # the few worked solutions longer than a response may be are cut
        f"model.partial_pretrain={base}",
        f"model.enable_gradient_checkpointing={plan.gradient_checkpointing}",
        f"optim.lr={plan.sft_lr}",
        f"data.micro_batch_size_per_gpu={plan.sft_micro_batch}",
        "optim.warmup_steps_ratio=0.05",
        f"trainer.total_training_steps={plan.sft_steps}",
        f"trainer.save_freq={plan.sft_check_every}",
        f"trainer.default_local_dir={out / 'sft'}",
        f"trainer.device={plan.device}",
    )


def sft_and_choose(out: Path, base: Path, plan: Any, stop_at: float) -> tuple[Path, list[dict]]:
    """`fulcrum sft` for at most `sft_steps`, a checkpoint every `sft_check_every` steps; each checkpoint
    gets a greedy check on the dev set here while SFT trains on, in step order, until
    `choose_warm_start` picks one; then SFT is stopped. Returns the chosen checkpoint and every check."""
    sft, log = out / "sft", out / "sft.log"
    if sft.exists():  # an SFT whose choice an earlier call did not finish: start it again
        shutil.rmtree(sft)
    cmd = sft_command(out, base, plan)
    print(f"$ {' '.join(cmd)}", flush=True)
    checks: list[dict] = []
    chosen: dict | None = None
    with log.open("w") as log_file:
        proc = subprocess.Popen(
            cmd, stdout=log_file, stderr=subprocess.STDOUT, env=_env(plan.threads_per_run)
        )
        try:
            while chosen is None:
                ended = proc.poll() is not None  # read before listing: the last checkpoint is then there
                new = [p for p in _checkpoints(sft) if not checks or _step(p) > checks[-1]["step"]]
                if not new:
                    if ended:
                        break
                    if time.monotonic() > stop_at:
                        raise SystemExit(f"out of time during SFT (checked {len(checks)} checkpoints)")
                    time.sleep(0.5)
                    continue
                check = warm_start_check(new[0], out / "data" / "dev.parquet", plan)
                checks.append({"step": _step(new[0]), **check})
                print(
                    f"  SFT step {_step(new[0])}: dev accuracy {check['accuracy']:.3f}, "
                    f"format {check['format_accuracy']:.3f}",
                    flush=True,
                )
                chosen = choose_warm_start(checks, plan)
        finally:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
    if chosen is None and proc.returncode != 0:
        tail = "\n".join(log.read_text().splitlines()[-30:])
        raise SystemExit(f"fulcrum sft failed (exit {proc.returncode})\n--- {log} (last lines) ---\n{tail}")
    if not checks:
        raise SystemExit(f"fulcrum sft wrote no checkpoint under {sft}: see {log}")
    if chosen is None:  # SFT ran out of steps first: the last formatted checkpoint, else the last
        formatted = [c for c in checks if c["format_accuracy"] >= plan.min_format_accuracy]
        chosen = (formatted or checks)[-1]
    model = sft / f"global_step_{chosen['step']}"
    for other in _checkpoints(sft):  # 100 MB each: keep the chosen one only
        if other != model:
            shutil.rmtree(other)
    return model, checks


def warm_start_check(model_dir: Path, test_file: Path, plan: Any) -> dict[str, Any]:
    """Greedy generation on a parquet set: accuracy (strict GSM8K score) and format accuracy. The
    model leaves the device afterwards: the RL runs need the memory."""
    import pyarrow.parquet as pq
    import torch
    from transformers import AutoModelForCausalLM

    from fulcrum.models.load import load_tokenizer

    rows = pq.read_table(test_file).to_pylist()
    tokenizer = load_tokenizer(str(model_dir))  # a pad token guaranteed, as training has it
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(model_dir).to(plan.device).eval()
    texts = [
        tokenizer.apply_chat_template(r["prompt"], tokenize=False, add_generation_prompt=True) for r in rows
    ]
    responses: list[str] = []
    for start in range(0, len(texts), 256):
        batch = tokenizer(texts[start : start + 256], return_tensors="pt", padding=True).to(plan.device)
        with torch.no_grad():
            ids = model.generate(**batch, do_sample=False, max_new_tokens=plan.max_response_length)
        responses += tokenizer.batch_decode(ids[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)
    del model
    if plan.device == "cuda":
        torch.cuda.empty_cache()
    truths = [r["reward_model"]["ground_truth"] for r in rows]
    stats = answer_stats(responses, truths, [len(tokenizer(t)["input_ids"]) for t in responses])
    return {
        "accuracy": stats["strict"],
        "format_accuracy": stats["format"],
        "flexible_accuracy": stats["flexible"],
        "response_length": stats["response_length"],
        "num_problems": len(rows),
        "example_response": responses[0],
    }


def answer_stats(responses: list[str], truths: list[str], lengths: list[int]) -> dict[str, float]:
    """GSM8K scoring as verl's: strict accuracy (the last `#### N`), flexible (the last number), format
    (a strict `#### N` present, right or wrong) over the last 300 characters; mean length in tokens."""
    from fulcrum.reward.gsm8k import compute_score, extract_solution

    n = max(len(responses), 1)
    pairs = list(zip(responses, truths, strict=True))
    return {
        "strict": sum(compute_score(t, g, method="strict") for t, g in pairs) / n,
        "flexible": sum(compute_score(t, g, method="flexible") for t, g in pairs) / n,
        "format": sum(extract_solution(t[-300:], method="strict") is not None for t in responses) / n,
        "response_length": sum(lengths) / n,
        "num_problems": len(responses),
    }


def dump_stats(folder: Path) -> dict[str, dict[str, float]]:
    """`answer_stats` of the first and the last validation a run dumped (`trainer.validation_data_dir`:
    `<step>.jsonl`), plus the share of responses cut at the length limit; {} when it dumped none."""
    import json

    files = sorted(folder.glob("*.jsonl"), key=lambda p: int(p.stem)) if folder.is_dir() else []
    out: dict[str, dict[str, float]] = {}
    for name, path in (("first", files[0]), ("last", files[-1])) if files else ():
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        stats = answer_stats(
            [r["output"] for r in rows], [r["gts"] for r in rows], [r["response_length"] for r in rows]
        )
        stats["truncated"] = sum(not r["finished"] for r in rows) / max(len(rows), 1)
        out[name] = {"step": int(path.stem), **stats}
    return out
