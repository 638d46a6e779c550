"""`fulcrum doctor`'s lever rules: settings that run but waste data, generation or memory, and the memory
estimate. Each rule is a function of the doctor's context returning findings with their severity, the
keys involved, why it matters and the fix (docs/levers.md explains each lever).

Kept apart from fulcrum/tools/doctor.py (files, models, the config's own rules) so each file stays one
concern; doctor.py runs LEVER_CHECKS after its own.
"""

from __future__ import annotations

import copy
import math
import os
from collections.abc import Callable
from typing import Any, Protocol

from fulcrum.config import FulcrumConfig, uses_critic, uses_reference, world_size
from fulcrum.config.finding import Finding
from fulcrum.config.schema import (
    ActorConfig,
    CriticModelConfig,
    ModelConfig,
    RewardModelConfig,
    RolloutConfig,
)
from fulcrum.config.schema_v1 import partial_rollouts_on
from fulcrum.config.validate import sp_roles
from fulcrum.device_facts import device_hbm_bandwidth, hbm_bandwidth
from fulcrum.models.arch.spec import kv_bytes_per_token, matmul_param_count
from fulcrum.rollout.native.pipeline import decode_floor_s
from fulcrum.tools.memory_estimate import (
    DEFAULT_DEVICE_GIB,
    Estimate,
    GiB,
    ModelShape,
    estimate,
    format_estimate,
    read_model_shape,
)


class DoctorContext(Protocol):
    cfg: FulcrumConfig
    device: str  # "cuda" or "cpu"
    n_visible: int
    overrides: list[str]
    device_memory_gib: float | None


def _set_by_user(ctx: DoctorContext, key: str) -> bool:
    return any(text.lstrip("+").split("=", 1)[0].strip() == key for text in ctx.overrides)


# --------------------------------------------------------------------------------------------- rules
def check_response_length(ctx: DoctorContext) -> list[Finding]:
    """rollout.response_length different from data.max_response_length."""
    cfg = ctx.cfg
    generated, data_limit = cfg.actor_rollout_ref.rollout.response_length, cfg.data.max_response_length
    if generated == data_limit:
        return []
    key, data_key = cfg.actor_rollout_ref.rollout.key("response_length"), cfg.data.key("max_response_length")
    return [
        Finding(
            (key, data_key),
            f"{key}={generated} differs from {data_key}={data_limit}",
            "warning",
            why=f"the rollout generates at most {generated} tokens and the batches, response_length/clip_ratio and "
            f"the memory follow it; {data_key}={data_limit} then only misleads whoever reads "
            "the configuration (verl derives one from the other)",
            fix=f"set {data_key}={generated} and drop rollout.response_length (it follows data)",
        )
    ]


def _train_rows(files: str | list[str]) -> int | None:
    """Rows of the training files from their parquet footers (no data read); None if one is unreadable."""
    import pyarrow.parquet as pq

    total = 0
    for name in [files] if isinstance(files, str) else list(files):
        try:
            total += pq.read_metadata(os.path.expanduser(name)).num_rows
        except Exception:  # reported by check_data_files
            return None
    return total


def _nearby_divisors(n: int, around: int) -> list[int]:
    return [b for b in range(max(1, around // 2), 2 * around + 1) if n % b == 0]


def check_epoch_drop(ctx: DoctorContext) -> list[Finding]:
    """Prompts of each epoch that no step uses: the loader drops the last partial batch (verl: drop_last)."""
    cfg = ctx.cfg
    prompts = _train_rows(cfg.data.train_files)
    batch = cfg.data.train_batch_size
    if prompts is None or batch <= 0 or prompts < batch:  # fewer rows than a batch: doctor's check_data_rows
        return []
    keys = (cfg.data.key("train_batch_size"),)
    dropped = prompts % batch
    if dropped == 0:
        return []
    divisors = _nearby_divisors(prompts, batch)
    fix = (
        f"a train_batch_size dividing {prompts:,}, e.g. {', '.join(map(str, divisors[:4]))}"
        if divisors
        else f"none between {batch // 2} and {2 * batch} divides {prompts:,}: accept the loss, or add or "
        "filter prompts to a multiple of the batch"
    )
    shuffle = cfg.data.key("shuffle")
    shuffled = f" with {shuffle}=True a different set is dropped each epoch, so none is lost for good"
    return [
        Finding(
            keys,
            f"{prompts:,} training prompts at {batch} a step = {prompts // batch} steps per epoch; {dropped:,} "
            f"prompts ({dropped / prompts:.1%}) dropped (unused) each epoch",
            "warning",
            why="the loader drops the last partial batch (as verl's drop_last);"
            + (shuffled if cfg.data.shuffle else " without shuffling the same prompts are never trained on"),
            fix=fix,
        )
    ]


def check_token_limits(ctx: DoctorContext) -> list[Finding]:
    """The engine's prefill budget against the longest prompt (training budgets: fulcrum.config.validate_sizes)."""
    rollout = ctx.cfg.actor_rollout_ref.rollout
    key, max_tokens = rollout.key("max_num_batched_tokens"), rollout.max_num_batched_tokens
    if rollout.name != "native" or not 0 < max_tokens < rollout.prompt_length:
        return []
    return [
        Finding(
            (key, ctx.cfg.data.key("max_prompt_length")),
            f"{key}={max_tokens} is below the longest prompt ({rollout.prompt_length} tokens)",
            "warning",
            why="the engine prefills at most this many tokens a step, so long prompts are split over several "
            "steps (slower prefill); vLLM without chunked prefill refuses this",
            fix=f"{key}>={rollout.prompt_length + rollout.response_length}",
        )
    ]


def check_tensor_parallel_heads(ctx: DoctorContext) -> list[Finding]:
    """Rollout tensor parallelism must split the attention and KV heads evenly (vLLM's rule)."""
    arr = ctx.cfg.actor_rollout_ref
    key, tp = arr.rollout.key("tensor_model_parallel_size"), arr.rollout.tensor_model_parallel_size
    shape = read_model_shape(arr.model.path)
    if shape is None or tp <= 1:
        return []
    bad = [
        f"{n} {what}"
        for n, what in ((shape.heads, "attention heads"), (shape.kv_heads, "KV heads"))
        if n % tp
    ]
    if not bad:
        return []
    good = [t for t in (1, 2, 4, 8) if shape.heads % t == 0 and shape.kv_heads % t == 0]
    return [
        Finding(
            (key, arr.model.key("path")),
            f"{key}={tp} does not divide the model's {' and '.join(bad)}",
            "warning",
            why="each tensor-parallel rank takes an equal share of the heads; verl's vLLM refuses this model at "
            "this size (fulcrum's rollout runs one engine per device and ignores the key today)",
            fix=f"{key} in {good}",
        )
    ]


def check_sequence_parallel_heads(ctx: DoctorContext) -> list[Finding]:
    """Ulysses sequence parallelism splits the attention heads evenly over its ranks (start-up refuses
    a size that does not divide them; key/value heads are repeated as needed)."""
    findings = []
    for key, sp, _, _ in sp_roles(ctx.cfg):
        critic = key.startswith(f"{ctx.cfg.critic.PATH}.")
        model = ctx.cfg.critic.model if critic else ctx.cfg.actor_rollout_ref.model
        model_key = model.key("path")
        shape = read_model_shape(model.path)
        if sp <= 1 or shape is None or shape.heads % sp == 0:
            continue
        good = [s for s in (1, 2, 4, 8) if shape.heads % s == 0]
        findings.append(
            Finding(
                (key, model_key),
                f"{key}={sp} does not divide the model's {shape.heads} attention heads",
                why="each sequence-parallel rank attends over an equal share of the heads",
                fix=f"{key} in {good}",
            )
        )
    return findings


def check_target_kl_fixed(ctx: DoctorContext) -> list[Finding]:
    """target_kl (or horizon) set with the fixed KL controller, which never reads them."""
    algo = ctx.cfg.algorithm
    kl, type_key = algo.kl_ctrl, algo.key("kl_ctrl.type")
    if kl.type != "fixed":
        return []
    set_keys = [
        k for k in (algo.key("kl_ctrl.target_kl"), algo.key("kl_ctrl.horizon")) if _set_by_user(ctx, k)
    ]
    if not set_keys:
        return []
    return [
        Finding(
            (*set_keys, type_key),
            f"{' and '.join(set_keys)} set with {type_key}=fixed: no effect",
            "warning",
            why=f"only the adaptive controller moves the coefficient towards target_kl; the fixed one keeps "
            f"kl_coef={kl.kl_coef} for the whole run",
            fix=f"{type_key}=adaptive with {algo.key('use_kl_in_reward')}=True, or drop target_kl",
        )
    ]


SHM_KEYS = (
    ModelConfig.key("use_shm"),
    CriticModelConfig.key("use_shm"),
    RewardModelConfig.key("model.use_shm"),
)


def check_use_shm(ctx: DoctorContext) -> list[Finding]:
    """verl's `use_shm` (copy the model to /dev/shm before loading): accepted, and why it does nothing here."""
    cfg = ctx.cfg
    models = (cfg.actor_rollout_ref.model, cfg.critic.model, cfg.reward_model.model)
    on = tuple(key for key, model in zip(SHM_KEYS, models, strict=True) if getattr(model, "use_shm", False))
    if not on:
        return []
    return [
        Finding(
            on,
            f"{', '.join(on)}=True: no effect, the model loads from its folder",
            "warning",
            why="each process reads a local model folder once at start, and the page cache serves the other "
            "ranks of a node from memory; a /dev/shm copy would read it once more and hold the weights in "
            "host memory twice (verl copies from remote storage for many workers per node)",
            fix="drop use_shm; for a slow network filesystem, copy the folder to local disk or /dev/shm once "
            "and point the model's path at the copy",
        )
    ]


def check_rollout_waves(ctx: DoctorContext) -> list[Finding]:
    """max_num_seqs below the responses one device generates in a step: the rollout runs in waves."""
    cfg = ctx.cfg
    rollout = cfg.actor_rollout_ref.rollout
    per_device = cfg.data.train_batch_size * rollout.n // max(world_size(cfg), 1)
    if rollout.max_num_seqs <= 0 or per_device <= rollout.max_num_seqs:
        return []
    waves, key = math.ceil(per_device / rollout.max_num_seqs), rollout.key("max_num_seqs")
    return [
        Finding(
            (key, cfg.data.key("train_batch_size"), rollout.key("n")),
            f"{key}={rollout.max_num_seqs} is below the {per_device} responses "
            f"a device generates per step: the rollout runs in about {waves} waves",
            "warning",
            why="decoding is bound by reading the weights and KV cache once per token for the whole batch, so a "
            "larger decode batch is nearly free until memory runs out; waves repeat the long tail",
            fix=f"{key}={per_device} if the KV cache holds it (see the memory "
            "estimate), else a larger gpu_memory_utilization",
        )
    ]


# ---------------------------------------------------------------------------------------- memory
def device_memory(ctx: DoctorContext) -> tuple[float, bool]:
    """(bytes, known): --device-memory-gib, else the visible CUDA device, else an assumed H200."""
    if ctx.device_memory_gib:
        return ctx.device_memory_gib * GiB, True
    if ctx.device == "cuda" and ctx.n_visible > 0:
        import torch

        return float(torch.cuda.get_device_properties(0).total_memory), True
    return DEFAULT_DEVICE_GIB * GiB, False


def memory_estimate(ctx: DoctorContext, cfg: FulcrumConfig | None = None) -> Estimate | None:
    """The memory estimate of `cfg` (the context's configuration by default) on the context's device."""
    cfg = cfg or ctx.cfg
    shape: ModelShape | None = read_model_shape(cfg.actor_rollout_ref.model.path)
    if shape is None:
        return None
    device_bytes, known = device_memory(ctx)
    per_device = cfg.data.train_batch_size * cfg.actor_rollout_ref.rollout.n // max(world_size(cfg), 1)
    return estimate(cfg, shape, device_bytes, known, uses_critic(cfg), uses_reference(cfg), per_device)


def check_memory(ctx: DoctorContext) -> list[Finding]:
    """An out-of-memory predicted before the run: a phase's estimate above the device's memory."""
    est = memory_estimate(ctx)
    if est is None:
        return []
    findings = []
    rollout = ctx.cfg.actor_rollout_ref.rollout
    if rollout.name == "native" and est.kv_cache_bytes <= 0:
        key = rollout.key("gpu_memory_utilization")
        findings.append(
            Finding(
                (key,),
                f"{key}={rollout.gpu_memory_utilization} leaves no room for the KV cache",
                "error" if est.device_known else "warning",
                why="the engine's share of the device must hold its weights, its workspace and the cache",
                fix="a larger gpu_memory_utilization, or a smaller max_num_batched_tokens / max_num_seqs",
            )
        )
    over = [p for p in est.phases if p.total > est.device_bytes]
    if over:
        worst = max(over, key=lambda p: p.total)
        top = sorted(worst.items.items(), key=lambda kv: -kv[1])[:3]
        findings.append(
            Finding(
                (
                    ActorConfig.key("ppo_micro_batch_size_per_gpu"),
                    ModelConfig.key("enable_gradient_checkpointing"),
                    RolloutConfig.key("gpu_memory_utilization"),
                ),
                f"predicted out of memory in {worst.name}: {worst.total / GiB:.1f} GiB estimated on a "
                f"{est.device_bytes / GiB:.1f} GiB device",
                "error" if est.device_known else "warning",
                why="largest items: " + "; ".join(f"{name} {size / GiB:.1f} GiB" for name, size in top),
                fix="smaller micro-batches, enable_gradient_checkpointing=True, a lower gpu_memory_utilization, "
                f"or more devices ({ctx.cfg.trainer.key('n_gpus_per_node')})",
            )
        )
    return findings


def check_partial_rollout_cache(ctx: DoctorContext) -> list[Finding]:
    """Partial rollouts that release the KV cache for training (`free_cache_engine=True`, verl's default):
    the held samples lose their K/V and are prefilled again the next step. Named where the estimate with
    the cache kept through training still fits the device."""
    cfg = ctx.cfg
    rollout = cfg.actor_rollout_ref.rollout
    if not partial_rollouts_on(cfg.trainer) or rollout.name != "native" or not rollout.free_cache_engine:
        return []
    kept = copy.deepcopy(cfg)
    kept.actor_rollout_ref.rollout.free_cache_engine = False
    est = memory_estimate(ctx, kept)
    if est is None or est.peak.total > est.device_bytes:
        return []
    key = rollout.key("free_cache_engine")
    return [
        Finding(
            (key,),
            f"{key}=True under partial rollouts: the held samples' K/V are released for training and "
            "prefilled again the next step; with the cache kept the estimate's peak is "
            f"{est.peak.total / GiB:.1f} GiB ({est.peak.name}) of {est.device_bytes / GiB:.1f} GiB",
            "warning",
            why="at Qwen2.5-0.5B's shape the held samples took 0.8-1.3 M tokens of prefill a step (1.5-2.9 s) and "
            "partial rollouts broke even; kept, with bypass mode, they ran 1.26-1.28x the trained tokens a second "
            '(docs/levers.md, "Long responses")',
            fix=f"{key}=False; algorithm.rollout_correction.bypass_mode=True also leaves out the old-log-prob pass",
        )
    ]


def kv_tokens_needed(prompts: int, n: int, max_num_seqs: int, prompt_len: int, response_len: int) -> int:
    """KV-cache tokens the native engine needs when every sequence decoding at once reaches its longest:
    s = min(prompts · n, max_num_seqs) sequences, whose ⌈s / n⌉ prompts are held once (the n responses
    of a prompt share its blocks): ⌈s / n⌉ · prompt_len + s · response_len."""
    sequences = min(prompts * n, max_num_seqs) if max_num_seqs > 0 else prompts * n
    return math.ceil(sequences / n) * prompt_len + sequences * response_len


def sequences_that_fit(kv_tokens: int, n: int, prompt_len: int, response_len: int) -> int:
    """The most sequences at once whose longest the cache holds: the largest s with
    `kv_tokens_needed` (⌈s / n⌉ · prompt_len + s · response_len) <= kv_tokens (0 when not even one)."""
    s = int(kv_tokens // (response_len + prompt_len / n)) + 1  # an estimate from above, then down to it
    while s > 0 and kv_tokens_needed(s, n, s, prompt_len, response_len) > kv_tokens:
        s -= 1
    return s


def batches_in_flight(trainer: Any) -> int:
    """Prompt batches the engine holds at once: 1, or under partial rollouts the step's own and
    `trainer.v1.colocate_async.num_warmup_batches` more (the groups carried to the next step keep
    decoding beside the new batch)."""
    if not partial_rollouts_on(trainer):
        return 1
    return 1 + int(trainer.v1.colocate_async.num_warmup_batches)


def check_kv_preemption(ctx: DoctorContext) -> list[Finding]:
    """The native engine's KV cache below what the sequences in flight need at their longest: it preempts.
    Under partial rollouts every batch in flight counts (`batches_in_flight`)."""
    rollout = ctx.cfg.actor_rollout_ref.rollout
    est = memory_estimate(ctx) if rollout.name == "native" else None
    if est is None or est.kv_tokens <= 0:  # no cache at all is check_memory's error
        return []
    batches = batches_in_flight(ctx.cfg.trainer)
    prompts = batches * (ctx.cfg.data.train_batch_size // max(world_size(ctx.cfg), 1))
    response_len = rollout.response_length or ctx.cfg.data.max_response_length
    needed = kv_tokens_needed(
        prompts, rollout.n, rollout.max_num_seqs, ctx.cfg.data.max_prompt_length, response_len
    )
    if needed <= est.kv_tokens:
        return []
    share = (
        rollout.gpu_memory_utilization
        + (needed - est.kv_tokens) * est.kv_cache_bytes / est.kv_tokens / est.device_bytes
    )
    key = rollout.key("gpu_memory_utilization")
    generation = next(p for p in est.phases if p.name == "generation")
    most = rollout.gpu_memory_utilization + (est.device_bytes - generation.total) / est.device_bytes
    warmup_key = "trainer.v1.colocate_async.num_warmup_batches"
    fewer = f", or fewer {warmup_key}" if batches > 1 else ""
    if share <= min(most, 1.0):
        fix = (
            f"{key}={math.ceil(share * 100) / 100:.2f} or more, or a smaller max_num_seqs (fewer sequences "
            f"at once){fewer}"
        )
    else:  # no share of this device holds them: only fewer sequences at once rule preemption out
        fits = sequences_that_fit(est.kv_tokens, rollout.n, ctx.cfg.data.max_prompt_length, response_len)
        fix = (
            f"{rollout.key('max_num_seqs')}={fits} rules it out (that many sequences at their longest fit; "
            f"{key} would need {share:.2f} of the device){fewer}, at the cost of decoding fewer at once: "
            "where few responses reach the longest together, keep the batch and watch rollout/preemptions"
        )
    sequences = (
        "a step's sequences" if batches == 1 else f"the {batches} prompt batches in flight (partial rollouts)"
    )
    keys = (
        key,
        rollout.key("max_num_seqs"),
        ctx.cfg.data.key("max_prompt_length"),
        rollout.key("response_length"),
    )
    return [
        Finding(
            keys + ((warmup_key,) if batches > 1 else ()),
            f"the KV cache holds {est.kv_tokens:,} tokens; {sequences} at their longest need "
            f"{needed:,}: the rollout preempts (frees and later recomputes sequences) when they run long",
            "warning",
            why="a preempted sequence's prefill and decode are done again, so generation slows as the cache "
            "falls short (docs/levers.md)",
            fix=fix,
        )
    ]


def device_bandwidth(ctx: DoctorContext) -> tuple[float | None, bool]:
    """(bytes/s, known): the visible CUDA device's HBM bandwidth (None for a card fulcrum does not know),
    else an assumed H200's, as `device_memory` assumes its memory."""
    import torch

    if ctx.device == "cuda" and ctx.n_visible > 0 and torch.cuda.is_available():
        return device_hbm_bandwidth(torch.device("cuda", 0)), True
    return hbm_bandwidth("H200"), False


def decode_floor_line(ctx: DoctorContext) -> str | None:
    """The native engine's memory floor for a step's decoding at the longest prompts and responses
    (`decode_floor_s`: bf16 weights read a decode step, the LM head once and the embedding not, of a
    mixture of experts only the experts a token runs, and each context's K/V), or None without a model
    shape, another rollout or an unknown card."""
    cfg = ctx.cfg
    rollout = cfg.actor_rollout_ref.rollout
    shape = read_model_shape(cfg.actor_rollout_ref.model.path) if rollout.name == "native" else None
    bandwidth, known = device_bandwidth(ctx)
    if shape is None or bandwidth is None:
        return None
    responses = cfg.data.train_batch_size * rollout.n // max(world_size(cfg), 1)
    response_len = rollout.response_length or cfg.data.max_response_length
    kv = kv_bytes_per_token(shape)
    weights = 2 * matmul_param_count(shape, lm_head=False)
    floor = decode_floor_s(responses, cfg.data.max_prompt_length, response_len, weights, kv, bandwidth)
    card = f"{bandwidth / 1e12:.2f} TB/s" + ("" if known else " (assumed: an H200)")
    return (
        f"decode floor: a step's {responses} responses at their longest take at least {floor:.3g} s at {card} "
        f"(each decode step reads every weight and each context's K/V, {kv:,} B a token; docs/levers.md, \"Long "
        'responses")'
    )


def memory_lines(ctx: DoctorContext) -> list[str]:
    est = memory_estimate(ctx)
    if est is None:
        return [f"memory estimate: no model config.json to read ({ModelConfig.key('path')})"]
    floor = decode_floor_line(ctx)
    return format_estimate(est) + ([f"  {floor}"] if floor else [])


LEVER_CHECKS: list[Callable[[Any], list[Finding]]] = [
    check_response_length,
    check_epoch_drop,
    check_token_limits,
    check_tensor_parallel_heads,
    check_sequence_parallel_heads,
    check_target_kl_fixed,
    check_use_shm,
    check_rollout_waves,
    check_memory,
    check_kv_preemption,
    check_partial_rollout_cache,
]
