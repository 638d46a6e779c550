"""Benchmark: the reference command (docs/configuration.md,
"The reference command") for a few steps on one device, with a Qwen2.5-0.5B-shaped
random model, and a summary of throughput, the timing breakdown and peak memory.

    # once: GSM8K parquet (from the MIT-licensed release) and the model
    fulcrum data gsm8k --src ../shared/data/gsm8k --out .bench/data
    python bench/train_step.py make-model --out .bench/qwen05
    # the run (one H200: ~3 min); extra KEY=VALUE overrides go to the trainer
    python bench/train_step.py run --data .bench/data --model .bench/qwen05 --run /tmp/bench_run \
        --steps 3 --summary summary.json [KEY=VALUE ...]

The model is random (hidden 896, 24 layers, 14 heads, 2 KV heads, intermediate 4864, vocab 151936,
tied embeddings, bf16 on disk) with the tiny byte-level tokenizer of `fulcrum tiny-model`: the ids
the tokenizer does not know decode to nothing, so responses run to max length (a fixed, worst-case
load) and every reward is 0. Throughput and time are what this measures, not learning.

Checkpoint cost (`trainer.save_in_background`): the summary's `checkpoints` lists, per save, the step's
stall (`timing_s/save_checkpoint`, of which `perf/checkpoint_wait_s` waited for the previous write) and
each background write's seconds (`perf/checkpoint_write_s`). Run enough steps that a write ends before
the last save, e.g. `--steps 12 trainer.save_freq=5`. Or the saves alone, no training (actor and
critic with AdamW moments, float32 as the workers hold them; `--device cpu` for a small model):

    python bench/train_step.py checkpoint --model .bench/qwen05 --run /tmp/ckpt_bench --saves 3

The summary's `host` holds `bench/host_speed.py`'s probe before and after the run (Python loop ms,
µs per kernel launch, load): the seed command's figure moved with it until its micro-batches were graphed.
`--burn N` runs N CPU-burning neighbour processes through the run (probes included): the same command
with and without them says how much the figure depends on the host (`bench/features.sh` part `host`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from packed_knobs import add_packed_knobs, apply_packed_knobs, knob_summary


def make_model(out: Path, seed: int = 0, shape: str = "qwen2.5-0.5b", tiny: bool = False) -> Path:
    """A random model of a named shape (bench/shapes.py; the Qwen2.5-0.5B shape by default; `tiny`: its
    family at a CPU smoke's size) in bf16 with the tiny tokenizer and chat template."""
    from shapes import shape_of
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    from fulcrum.models.tiny import IM_END, PAD_TOKEN, build_tokenizer

    tokenizer = build_tokenizer()
    eos_id, pad_id = tokenizer.convert_tokens_to_ids([IM_END, PAD_TOKEN])
    model_type, fields = shape_of(shape, tiny)
    config = AutoConfig.for_model(
        model_type, **fields, eos_token_id=eos_id, pad_token_id=pad_id, bos_token_id=None
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    model.generation_config = GenerationConfig(eos_token_id=eos_id, pad_token_id=pad_id, bos_token_id=None)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def seed_command(data: Path, model: Path) -> list[str]:
    """The seed's final command (docs/configuration.md) on one device: `n_gpus_per_node=1`,
    `tensor_model_parallel_size=1`, every other key as the seed writes it."""
    return [
        f"data.train_files={data}/train.parquet",
        f"data.val_files={data}/test.parquet",
        "data.train_batch_size=512",
        "data.max_prompt_length=512",
        "data.max_response_length=256",
        f"actor_rollout_ref.model.path={model}",
        "actor_rollout_ref.actor.optim.lr=1.5e-6",
        "actor_rollout_ref.actor.ppo_mini_batch_size=128",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        "actor_rollout_ref.rollout.gpu_memory_utilization=0.65",
        "actor_rollout_ref.rollout.max_num_seqs=1896",
        "actor_rollout_ref.rollout.max_num_batched_tokens=16384",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=16",
        "critic.optim.lr=1e-5",
        f"critic.model.path={model}",
        "critic.ppo_micro_batch_size_per_gpu=8",
        "critic.forward_micro_batch_size_per_gpu=8",
        "algorithm.kl_ctrl.kl_coef=0.0005",
        "algorithm.kl_ctrl.target_kl=0.05",
        "trainer.logger=[console]",
        "trainer.val_before_train=False",
        "trainer.n_gpus_per_node=1",
        "trainer.nnodes=1",
        "trainer.save_freq=10",
        "trainer.test_freq=10",
        "trainer.total_epochs=15",
    ]


def seed_overrides(data: Path, model: Path, run: Path, steps: int) -> list[str]:
    """The seed's command with the hf rollout backend and `steps` steps, in `run`."""
    return [
        *seed_command(data, model),
        f"trainer.total_training_steps={steps}",
        "actor_rollout_ref.rollout.name=hf",
        f"trainer.default_local_dir={run}",
    ]


# The GRPO step of BENCHMARKS.md's GRPO and architecture rows, over the seed command: 64 prompts x 8
# responses through the native engine, micro-batches of 32 with gradient checkpointing, no validation or save.
GRPO_STEP = [
    "algorithm.adv_estimator=grpo",
    "data.train_batch_size=64",
    "actor_rollout_ref.rollout.n=8",
    "actor_rollout_ref.actor.ppo_mini_batch_size=64",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=32",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=32",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=32",
    "actor_rollout_ref.model.enable_gradient_checkpointing=True",
    "actor_rollout_ref.rollout.name=native",
    "trainer.test_freq=-1",
    "trainer.save_freq=-1",
    "trainer.resume_mode=disable",
]


def summarise(run: Path) -> dict[str, object]:
    """Per step: throughput, step time, every timing_s/*, peak memory, the engine's `rollout/*` figures
    (generate, KV cache allocation and release, graph captures: what `timing_s/gen` holds besides
    decoding); plus the mean over steps after the first."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in rows if "training/global_step" in r]
    keep = (
        "perf/",
        "timing_s/",
        "rollout/",
        "timing_per_token_ms/",
        "response_length/mean",
        "prompt_length/mean",
        "val-core/",
    )
    per_step = [{k: v for k, v in r.items() if k.startswith(keep)} for r in steps]
    warm = per_step[1:] or per_step
    shared = {
        k
        for k in (set.intersection(*(set(r) for r in warm)) if warm else set())  # none: a run with no step
        if all(isinstance(r[k], int | float) for r in warm)
    }
    mean_warm = {
        k: sum(r[k] for r in warm) / len(warm) for k in sorted(shared) if not k.startswith("val-core/")
    }
    return {"steps": per_step, "mean_after_first": mean_warm, "checkpoints": checkpoint_costs(steps)}


def checkpoint_costs(rows: list[dict[str, float]]) -> dict[str, list[float]]:
    """Per save of the run: the step's stall and its wait for the previous write; every write's seconds."""
    saves = [r for r in rows if "timing_s/save_checkpoint" in r]
    return {
        "stall_s": [r["timing_s/save_checkpoint"] for r in saves],
        "wait_s": [r.get("perf/checkpoint_wait_s", 0.0) for r in saves],
        "write_s": [r["perf/checkpoint_write_s"] for r in rows if "perf/checkpoint_write_s" in r],
    }


def bench_checkpoint(model: Path, run: Path, saves: int, device: torch.device) -> dict[str, object]:
    """Seconds a step stalls for a save and seconds the write takes, in the background and in the step,
    for an actor and a critic of `model` with AdamW moments (one update on a short random batch)."""
    import time

    from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

    from fulcrum.models.value_head import CriticModel
    from fulcrum.trainer.checkpoint import CheckpointManager
    from fulcrum.workers.optim import build_optimizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    optim = argparse.Namespace(lr=1e-6)
    roles = {}
    for name, net in (
        ("actor", AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)),
        ("critic", CriticModel(AutoModel.from_pretrained(model, dtype=torch.float32))),
    ):
        net = net.to(device)
        optimizer = build_optimizer(net.parameters(), optim, device)
        out = net(input_ids=torch.randint(0, 100, (1, 16), device=device))
        (out.logits if name == "actor" else out).float().mean().backward()
        optimizer.step()
        roles[name] = argparse.Namespace(model=net, optimizer=optimizer, tokenizer=tokenizer)
    result: dict[str, object] = {"device": str(device), "saves": saves}
    for background in (True, False):
        manager = CheckpointManager(run / ("background" if background else "in_step"), None)
        stalls, writes = [], []
        for step in range(1, saves + 1):
            begin = time.perf_counter()
            if background:
                manager.save(step, roles, {"epoch": 0}, background=True)
                stalls.append(time.perf_counter() - begin)
                manager.wait()
                writes.append(manager.writer.seconds_of_finished())
            else:
                manager.save(step, roles, {"epoch": 0})
                stalls.append(time.perf_counter() - begin)
        key = "background" if background else "in_step"
        result[key] = {"stall_s": stalls, "write_s": writes}
    result["checkpoint_gb"] = (
        sum(f.stat().st_size for f in (run / "background" / f"global_step_{saves}").rglob("*") if f.is_file())
        / 1e9
    )
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="cmd", required=True)
    mk = sub.add_parser(
        "make-model", help="write a random model of a named shape (Qwen2.5-0.5B's by default)"
    )
    mk.add_argument("--out", type=Path, required=True)
    mk.add_argument("--shape", default="qwen2.5-0.5b", help="a bench/shapes.py shape (random weights)")
    mk.add_argument(
        "--tiny", action="store_true", help="the shape's family at a size the CPU trains in seconds"
    )
    rn = sub.add_parser("run", help="run the seed command for --steps steps and summarise")
    rn.add_argument("--data", type=Path, required=True)
    rn.add_argument("--model", type=Path, required=True)
    rn.add_argument("--run", type=Path, required=True)
    rn.add_argument("--steps", type=int, default=3)
    rn.add_argument("--summary", type=Path, default=None)
    rn.add_argument(
        "--burn", type=int, default=0, help="CPU-burning neighbour processes during the run (a slowed host)"
    )
    rn.add_argument(
        "--grpo", action="store_true", help="the GRPO step shape (64 prompts x 8, native rollout; GRPO_STEP)"
    )
    add_packed_knobs(rn)
    ck = sub.add_parser(
        "checkpoint", help="time the saves alone: step stall and write, background and in-step"
    )
    ck.add_argument("--model", type=Path, required=True)
    ck.add_argument("--run", type=Path, required=True, help="an empty folder for the checkpoints")
    ck.add_argument("--saves", type=int, default=3)
    ck.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ck.add_argument("--summary", type=Path, default=None)
    args, extra = parser.parse_known_args(argv)
    if args.cmd == "make-model":
        print(f"wrote {make_model(args.out, shape=args.shape, tiny=args.tiny)}")
        return 0
    if args.cmd == "checkpoint":
        text = json.dumps(
            bench_checkpoint(args.model, args.run, args.saves, torch.device(args.device)), indent=1
        )
        print(text)
        if args.summary:
            args.summary.write_text(text)
        return 0
    from host_speed import cpu_burners, host_speed

    from fulcrum.trainer.main_ppo import main as train_main

    apply_packed_knobs(args)
    with cpu_burners(args.burn):
        host_before = host_speed()
        print(f"host before the run: {host_before} ({args.burn} burners)", flush=True)
        preset = GRPO_STEP if args.grpo else []
        code = train_main(seed_overrides(args.data, args.model, args.run, args.steps) + preset + extra)
        host_after = host_speed()
    if code != 0:
        return code
    summary = summarise(args.run)
    summary["host"] = {"before": host_before, "after": host_after, "burners": args.burn}
    summary.update(knob_summary())
    summary["device"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    summary["torch"] = torch.__version__
    text = json.dumps(summary, indent=1)
    print(text)
    if args.summary:
        args.summary.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
