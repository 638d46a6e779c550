"""`fulcrum sft`: supervised fine-tuning on prompt/response parquet data, with verl's SFT keys.

    fulcrum sft data.train_files=$DATA/train.parquet data.val_files=$DATA/test.parquet \
        data.prompt_key=extra_info data.response_key=extra_info \
        model.partial_pretrain=$MODEL optim.lr=1e-4 trainer.total_epochs=2 trainer.default_local_dir=$OUT

The keys and their defaults are those of verl's `sft_trainer.yaml` (`fsdp_sft_trainer`), so a verl
SFT command runs after changing the module name. Each example is the prompt as a user turn through the
tokenizer's chat template (generation prompt added, exactly as the PPO prompt data set does), then the
response and the EOS token; the loss is the token-mean cross-entropy over response tokens only.
The model is written with `save_pretrained` (safetensors) and the tokenizer to
`<default_local_dir>/global_step_<N>/`, a Hugging Face folder that `actor_rollout_ref.model.path`
can name. `metrics.jsonl` (train/loss, train/lr, val/loss) and `config.yaml` go beside it.

Where a column holds a dict (verl's `extra_info`), `prompt_dict_keys` / `response_dict_keys` pick the
field; where the prompt column holds chat messages (verl's RL `prompt` column), they are used as is.
With `data.multiturn.enable=true` each row is a conversation (`data.multiturn.messages_key`, tools in
`tools_key`) and the loss counts only the assistant turns, tool calls included (fulcrum.trainer.sft_multiturn).
Departures from verl: one device only (FSDP and sequence parallelism keys are accepted without
effect), the loss is averaged over the response tokens of the whole global batch rather than per
device, `trainer.device` (auto|cpu|cuda) is ours.
The loop, evaluation and saving in one file, as cleanrl keeps an algorithm (the data in
fulcrum.trainer.sft_data); its loading, autocast, LR schedule, NaN guard and metrics writer are the PPO
trainer's.
"""

from __future__ import annotations

import os
import random
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from fulcrum.batch import host_to_device
from fulcrum.config import ConfigError, load_structured, save_config, to_dict
from fulcrum.config.device import cap_host_threads, select_device
from fulcrum.models.load import autocast_for, load_causal_lm, load_tokenizer
from fulcrum.trainer import run_lock
from fulcrum.trainer.faults import NonFiniteGuard, NonFiniteTrainingError
from fulcrum.trainer.loggers import MetricsWriteError, Tracking
from fulcrum.trainer.run_dir import other_run_contents
from fulcrum.trainer.run_ownership import CONFIG_FILE, RunDirError, check_own_files, mark_run_dir, write_whole
from fulcrum.trainer.sft_data import SFTExample, check_files, collate, load_examples
from fulcrum.trainer.sft_multiturn import SFTMultiturnConfig
from fulcrum.workers.optim import clip_and_step, lr_schedule

NON_FINITE_SFT = ("train/loss", "train/grad_norm")  # the metrics whose NaN/Inf skips a step
SFT_LEVERS = "lower optim.lr, set optim.clip_grad, check the data for empty or overlong responses"

# ---------------------------------------------------------------- configuration (verl's sft_trainer.yaml)


@dataclass
class SFTDataConfig:
    train_batch_size: int = 256  # examples per optimiser step
    micro_batch_size: int | None = None  # deprecated in verl; when set, overrides micro_batch_size_per_gpu
    micro_batch_size_per_gpu: int = 4  # examples per forward/backward (gradient accumulation)
    train_files: Any = None  # a parquet path or a list of them
    val_files: Any = None
    prompt_key: str = "question"  # column holding the prompt (text, dict or chat messages)
    response_key: str = "answer"  # column holding the response (text or dict)
    prompt_dict_keys: list[str] = field(default_factory=lambda: ["question"])  # path into a dict column
    response_dict_keys: list[str] = field(default_factory=lambda: ["answer"])
    max_length: int = 1024  # prompt + response tokens
    truncation: str = "error"  # error | left | right
    balance_dp_token: bool = False  # no effect (one device)
    chat_template: str | None = None  # a Jinja chat template replacing the tokenizer's
    multiturn: SFTMultiturnConfig = field(default_factory=SFTMultiturnConfig)  # conversations, tools


@dataclass
class SFTModelConfig:
    partial_pretrain: str | None = None  # Hugging Face model folder or hub name to start from
    enable_gradient_checkpointing: bool = False
    trust_remote_code: bool = False
    external_lib: str | None = None  # a module to import before loading (custom architectures)
    fsdp_config: dict[str, Any] = field(default_factory=dict)  # accepted, no effect (one device)
    lora_rank: int = 0  # LoRA is not supported: must stay 0
    use_liger: bool = False  # accepted, no effect


@dataclass
class SFTOptimConfig:
    lr: float = 1e-5
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    weight_decay: float = 0.01
    warmup_steps_ratio: float = 0.1  # linear warm-up over this fraction of the steps
    clip_grad: float = 1.0  # max global gradient norm
    lr_scheduler: str = "cosine"  # cosine (to 0) | constant


@dataclass
class SFTTrainerConfig:
    default_local_dir: str = "checkpoints/fulcrum-sft/sft"  # run directory
    default_hdfs_dir: str | None = None  # accepted, no effect
    resume_path: str | None = None  # not supported: must stay null
    project_name: str = "fulcrum-sft"
    experiment_name: str = "sft"
    total_epochs: int = 4
    total_training_steps: int | None = None  # when set, stops after this many steps
    logger: list[str] = field(default_factory=lambda: ["console"])
    seed: int = 1
    save_freq: int = -1  # save every N steps (the last step is always saved)
    test_freq: int = -1  # validation loss every N steps (and after the last step when val_files is set)
    nnodes: int = 1
    n_gpus_per_node: int = 1
    max_ckpt_to_keep: int | None = None
    device: str = "auto"  # ours: auto | cpu | cuda
    max_nan_steps: int = 3  # ours, as fulcrum train's: stop after this many NaN/Inf steps in a row (0: never)


@dataclass
class SFTConfig:
    data: SFTDataConfig = field(default_factory=SFTDataConfig)
    model: SFTModelConfig = field(default_factory=SFTModelConfig)
    optim: SFTOptimConfig = field(default_factory=SFTOptimConfig)
    trainer: SFTTrainerConfig = field(default_factory=SFTTrainerConfig)
    ulysses_sequence_parallel_size: int = 1  # accepted; must be 1
    use_remove_padding: bool = False  # accepted, no effect


def load_sft_config(overrides: list[str]) -> SFTConfig:
    """verl-style `a.b=value` overrides (`+a.b=value` too) on the defaults; `ConfigError` names the key."""
    cfg = load_structured(SFTConfig, overrides)
    _validate(cfg)
    return cfg


def _validate(cfg: SFTConfig) -> None:
    if not cfg.data.train_files:
        raise ConfigError("data.train_files is required (a parquet file or a list of them)")
    if not cfg.model.partial_pretrain:
        raise ConfigError("model.partial_pretrain is required (a Hugging Face model folder)")
    if cfg.data.truncation not in ("error", "left", "right"):
        raise ConfigError(f"data.truncation must be error|left|right, got {cfg.data.truncation!r}")
    if cfg.optim.lr_scheduler not in ("cosine", "constant"):
        raise ConfigError(f"optim.lr_scheduler must be cosine|constant, got {cfg.optim.lr_scheduler!r}")
    if cfg.trainer.device not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"trainer.device must be auto|cpu|cuda, got {cfg.trainer.device!r}")
    if cfg.model.lora_rank:
        raise ConfigError("model.lora_rank: LoRA is not supported by fulcrum sft; leave it 0")
    if cfg.trainer.resume_path:
        raise ConfigError("trainer.resume_path: resuming SFT is not supported; leave it null")
    if cfg.ulysses_sequence_parallel_size != 1:
        raise ConfigError("ulysses_sequence_parallel_size: sequence parallelism is not supported; use 1")
    if cfg.data.max_length < 1:
        raise ConfigError(
            f"data.max_length must be >= 1 (prompt + response tokens), got {cfg.data.max_length}"
        )
    micro = micro_batch_size(cfg)
    if micro < 1 or cfg.data.train_batch_size < 1:
        raise ConfigError("data.train_batch_size and data.micro_batch_size_per_gpu must be >= 1")
    if cfg.data.train_batch_size % micro:
        raise ConfigError(
            f"data.train_batch_size ({cfg.data.train_batch_size}) must be divisible by "
            f"data.micro_batch_size_per_gpu ({micro})"
        )
    if cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node != 1:
        print(
            "fulcrum sft: runs on one device; trainer.nnodes / n_gpus_per_node are ignored", file=sys.stderr
        )


def micro_batch_size(cfg: SFTConfig) -> int:
    return cfg.data.micro_batch_size or cfg.data.micro_batch_size_per_gpu


# ---------------------------------------------------------------- maths


def response_token_nll(
    logits: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor
) -> torch.Tensor:
    """Summed negative log-likelihood of the response tokens.

    nll = -Σ_{b,t≥1} loss_mask[b,t] · log softmax(logits[b,t-1])[input_ids[b,t]]
    logits (B, T, V), input_ids (B, T), loss_mask (B, T) -> scalar. Computed in float32.
    """
    targets = input_ids[:, 1:]
    mask = loss_mask[:, 1:].float()
    token_nll = F.cross_entropy(
        logits[:, :-1].float().reshape(-1, logits.size(-1)), targets.reshape(-1), reduction="none"
    ).view_as(mask)
    return (token_nll * mask).sum()


# ---------------------------------------------------------------- training


@dataclass
class SFTResult:
    model_dir: Path  # the Hugging Face folder of the last step
    train_losses: list[float]  # per optimiser step, token-mean NLL of the response tokens
    val_loss: float | None  # after the last step, when data.val_files is set
    seconds: float


@torch.no_grad()
def evaluate_loss(
    model: Any, examples: list[SFTExample], micro: int, pad_id: int, device: torch.device
) -> float:
    """Token-mean NLL of the response tokens over `examples`."""
    model.eval()
    total, count = 0.0, 0
    for start in range(0, len(examples), micro):
        ids, attn, mask = (
            host_to_device(t, device) for t in collate(examples[start : start + micro], pad_id)
        )
        with autocast_for(device):
            logits = model(input_ids=ids, attention_mask=attn).logits
        total += response_token_nll(logits, ids, mask).item()
        count += int(mask[:, 1:].sum())
    model.train()
    return total / max(count, 1)


def _load(cfg: SFTConfig, device: torch.device) -> tuple[Any, Any]:
    if cfg.model.external_lib:
        __import__(cfg.model.external_lib)
    path, remote = str(cfg.model.partial_pretrain), cfg.model.trust_remote_code
    tokenizer = load_tokenizer(path, "model.partial_pretrain", trust_remote_code=remote)
    if cfg.data.chat_template:
        tokenizer.chat_template = cfg.data.chat_template
    model = load_causal_lm(
        path,
        device,
        gradient_checkpointing=cfg.model.enable_gradient_checkpointing,
        key="model.partial_pretrain",
        trust_remote_code=remote,
    )
    return model, tokenizer


def _save(model: Any, tokenizer: Any, run_dir: Path, step: int) -> Path:
    """`run_dir/global_step_{step}`, written under a hidden name and renamed when complete, so a reader
    that watches the folder during training (`bench/learning.py` checks each checkpoint) never loads a
    half-written one."""
    out = run_dir / f"global_step_{step}"
    partial = run_dir / f".global_step_{step}.partial"
    shutil.rmtree(partial, ignore_errors=True)  # left by a run killed while saving
    model.save_pretrained(partial, safe_serialization=True)
    tokenizer.save_pretrained(partial)
    os.replace(partial, out)
    return out


def run_sft(cfg: SFTConfig, log: Any = print) -> SFTResult:
    """Train as `cfg` says; returns the saved folder and the loss curve."""
    started = time.perf_counter()
    random.seed(cfg.trainer.seed)
    torch.manual_seed(cfg.trainer.seed)
    device = select_device(
        cfg.trainer.device, cpu_when_no_cuda=True
    )  # one device: n_gpus_per_node is ignored
    cap_host_threads(device)
    run_dir = Path(cfg.trainer.default_local_dir).expanduser()
    try:
        run_lock.acquire(run_dir, "fulcrum sft")
    except run_lock.RunDirBusyError as err:
        raise ConfigError(str(err), "trainer.default_local_dir") from None
    try:
        return _train(cfg, run_dir, device, started, log)
    finally:
        run_lock.release(run_dir)


def _open_run_dir(cfg: SFTConfig, run_dir: Path) -> None:
    """The run-directory rules of `fulcrum train` (fulcrum.trainer.run_dir): never over another run,
    never over files fulcrum did not write; the marker, then the configuration, written whole."""
    there = other_run_contents(run_dir)
    if there:  # one run directory, one run: never overwrite another run's checkpoints or metrics
        raise ConfigError(
            f"trainer.default_local_dir={run_dir} holds another run ({'; '.join(there)}); choose another folder"
        )
    try:
        check_own_files(run_dir)
        mark_run_dir(run_dir, "fulcrum sft")
        write_whole(run_dir / CONFIG_FILE, lambda tmp: save_config(cfg, tmp))
    except RunDirError as err:
        raise ConfigError(str(err), "trainer.default_local_dir") from None


def _train(cfg: SFTConfig, run_dir: Path, device: torch.device, started: float, log: Any) -> SFTResult:
    _open_run_dir(cfg, run_dir)
    check_files(cfg.data.train_files, "data.train_files")  # before the model loads: a bad file fails fast
    if cfg.data.val_files:
        check_files(cfg.data.val_files, "data.val_files")
    model, tokenizer = _load(cfg, device)
    train = load_examples(cfg.data.train_files, tokenizer, cfg.data)
    val = (
        load_examples(cfg.data.val_files, tokenizer, cfg.data, "data.val_files") if cfg.data.val_files else []
    )
    batch, micro = cfg.data.train_batch_size, micro_batch_size(cfg)
    steps_per_epoch = len(train) // batch  # the last incomplete batch is dropped, as verl's sampler does
    if steps_per_epoch == 0:
        raise ConfigError(f"data.train_batch_size={batch} is larger than the {len(train)} training examples")
    total_steps = cfg.trainer.total_training_steps or steps_per_epoch * cfg.trainer.total_epochs
    warmup_steps = int(cfg.optim.warmup_steps_ratio * total_steps)

    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": cfg.optim.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=cfg.optim.lr,
        betas=tuple(cfg.optim.betas),  # type: ignore[arg-type]
    )
    schedule = lr_schedule(optimizer, cfg.optim.lr_scheduler, warmup_steps, total_steps, warm_first_step=True)
    log(
        f"fulcrum sft: {len(train)} examples, {total_steps} steps of {batch} (micro-batches of {micro}), "
        f"device {device}, model {cfg.model.partial_pretrain}"
    )
    pad_id = tokenizer.pad_token_id
    generator = torch.Generator().manual_seed(cfg.trainer.seed)
    # metrics.jsonl and trainer.logger's other backends; the console line below is SFT's own.
    tracking = Tracking(
        [b for b in cfg.trainer.logger if b != "console"],
        run_dir,
        cfg.trainer.project_name,
        cfg.trainer.experiment_name,
        to_dict(cfg),
    )
    log_every = max(1, total_steps // 20)
    losses: list[float] = []
    order: list[int] = []
    val_loss: float | None = None
    guard = NonFiniteGuard(cfg.trainer.max_nan_steps, watched=NON_FINITE_SFT, levers=SFT_LEVERS)
    model.train()
    for step in range(total_steps):
        if step % steps_per_epoch == 0:
            order = torch.randperm(len(train), generator=generator).tolist()
        start = (step % steps_per_epoch) * batch
        chosen = [train[i] for i in order[start : start + batch]]
        num_targets = sum(sum(e.mask()[1:]) for e in chosen)  # the first token is never predicted
        lr = schedule.get_last_lr()[0]
        step_nll = 0.0
        for m in range(0, batch, micro):
            ids, attn, mask = (host_to_device(t, device) for t in collate(chosen[m : m + micro], pad_id))
            with autocast_for(device):
                logits = model(input_ids=ids, attention_mask=attn).logits
            # Dividing by the batch's target count makes the accumulated gradient that of the token mean.
            nll = response_token_nll(logits, ids, mask)
            (nll / max(num_targets, 1)).backward()
            step_nll += nll.item()
        # a NaN/Inf gradient norm skips the update, as in fulcrum train
        grad_norm = clip_and_step(model, optimizer, cfg.optim.clip_grad)
        schedule.step()
        losses.append(step_nll / max(num_targets, 1))
        row: dict[str, float | int] = {
            "train/loss": losses[-1],
            "train/lr": lr,
            "train/grad_norm": float(grad_norm),
            "train/epoch": step // steps_per_epoch,
        }
        row.update(guard.observe(step + 1, row))
        if guard.exceeded:  # the weights are the last finite step's; no checkpoint for the failing steps
            tracking.log(row, step=step + 1)  # type: ignore[arg-type]
            tracking.close()
            raise guard.error()
        last = step + 1 == total_steps
        if val and (last or (cfg.trainer.test_freq > 0 and (step + 1) % cfg.trainer.test_freq == 0)):
            val_loss = evaluate_loss(model, val, micro, pad_id, device)
            row["val/loss"] = val_loss
        tracking.log(row, step=step + 1)  # type: ignore[arg-type]
        if "console" in cfg.trainer.logger and ((step + 1) % log_every == 0 or last or "val/loss" in row):
            extra = f" val/loss {row['val/loss']:.4f}" if "val/loss" in row else ""
            log(f"step {step + 1}/{total_steps} train/loss {losses[-1]:.4f} lr {lr:.2e}{extra}")
        due = cfg.trainer.save_freq > 0 and (step + 1) % cfg.trainer.save_freq == 0
        if due and not last and not guard.consecutive:  # a skipped step saves nothing new
            _save(model, tokenizer, run_dir, step + 1)
    tracking.close()
    model_dir = _save(model, tokenizer, run_dir, total_steps)
    seconds = time.perf_counter() - started
    log(f"fulcrum sft: saved {model_dir} ({seconds:.0f} s)")
    return SFTResult(model_dir=model_dir, train_losses=losses, val_loss=val_loss, seconds=seconds)


def main(argv: list[str]) -> int:
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    try:
        cfg = load_sft_config(argv)
        run_sft(cfg)
    except (ConfigError, FileNotFoundError, ValueError, NonFiniteTrainingError, MetricsWriteError) as err:
        print(f"fulcrum sft: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    torch.set_num_threads(min(torch.get_num_threads(), 2))
    raise SystemExit(main(sys.argv[1:]))
