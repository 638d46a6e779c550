"""Per-device memory of a run, estimated before it starts, from the model's config.json and the sizes.

fulcrum keeps on each device, for the whole run: the actor (fp32 weights + AdamW's two fp32 moments),
the critic likewise (GAE only), the reference policy (fp32 weights, only when a KL uses it) and the
rollout engine. The native engine takes `gpu_memory_utilization` of the device for its bf16 weights, a
workspace and the KV cache (filling the rest); the KV cache is released while the models train
(`free_cache_engine`), its bf16 weights stay. Gradients exist only inside a model's own update: each
optimiser step releases them (`fulcrum.workers.optim.clip_and_step`), so no phase holds the other
model's. `estimate()` returns every phase, itemised:

    generation    = resident + engine weights (2P) + engine workspace + KV cache
    forward pass  = resident + engine weights + bf16 compute weights (2P)
                    + T·2h (the residual stream) + max(T·2(h + 3I), one bf16 logits block)
                    (old log-probs, the reference's log-probs at its own micro-batch, values)
    update        = resident + engine weights + fp32 gradients (4P) + bf16 compute weights (2P)
                    + their bf16 gradients (2P) + activations
                    + max((actor) the LM head's blocks, (checkpointing) the attention backward's workspace)
                    - the other model's AdamW state (one process with a critic, with
                      trainer.park_optimizer_state: it waits in host memory meanwhile)

with resident = 12 B per parameter of each trained model (+ 4 B of the reference's) + the CUDA
context. A LoRA model (`fulcrum.tools.lora_params`) trains only its adapters: 12 B per adapter
parameter, its frozen base 2 B a parameter (held once in bf16), and P above is the adapters' count
(their gradients and bf16 copies; the frozen LM head makes no weight gradient); a LoRA actor's
reference is its base with the adapters off, so no reference weights. The passes run the decoder in bf16 on compute copies of the fp32 weights
(`fulcrum.models.precision`), so every activation is bf16: with gradient checkpointing the backward
keeps each layer's bf16 input and its attention kernel's output and log-sum-exp (L·(2h + 2q + 4H) per
token, `fulcrum.models.packed.SAVE_ATTENTION_OUTPUTS`); without, every layer's tensors
(`layer_activation_bytes`, L·2(6h + q + 2kv + 3I) per token). The LM head runs chunk by chunk
(`fulcrum.models.linear_logprob`, compiled on CUDA): one bf16 (chunk, V) block of logits in a no-grad
forward; in the backward that block, its bf16 gradient and the head's fp32 weight-gradient
accumulator (4·V·h). With checkpointing the attention kernel's backward holds a workspace that grows with
the micro-batch's tokens (`attention_backward_bytes`, 12q + 4kv + 4H a token with grouped heads); the
head's blocks are gone by then, so the update counts the larger of the two.

With CUDA graphs of the micro-batches (`graphs_refused`) a replayed micro-batch's work lives in the graphs'
memory pool, which stays reserved from the first capture on and which every model's graphs share (captured
on one stream, `fulcrum.workers.cuda_graphs.capture_stream`): the pool is resident in every phase, and a
graphed phase adds no work of its own beside it. The pool holds the largest graphed forward's work and,
beside it, the largest graphed update's (with its bf16 gradients): a step's no-grad forwards are captured
first, and the update's capture did not reuse what they had freed (measured at 16k-token sequences: the pool
3.76 GiB after the forwards' captures, 30.51 after the update's, whose eager run had held 25.98).

The model's shape and parameter count come from its family's spec (`fulcrum.models.arch`).
Shapes: P parameters, h hidden, L layers, H / K query / KV heads of dim d (q = H·d, kv = K·d), I
intermediate, V vocab; a micro-batch of m rows of at most T = m × (prompt + response) tokens (a packed
micro-batch's budget), R response tokens a row (the LM head only runs on those).

Its error against the phases' measured `perf/max_memory_allocated_gb/<phase>`: docs/levers.md, "The
memory estimate". torch's allocated figure leaves out the CUDA context (CUDA_CONTEXT_BYTES).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fulcrum.config import world_size
from fulcrum.models.arch import ModelShape, model_shape
from fulcrum.models.arch.spec import kv_bytes_per_token, param_count, recurrent_state_bytes
from fulcrum.rollout.native.config import engine_config_from
from fulcrum.rollout.native.memory import engine_workspace_bytes, kv_cache_budget
from fulcrum.tools.graphs_estimate import graphs_refused
from fulcrum.tools.lora_params import ModelParams, model_params
from fulcrum.trainer.old_log_probs import old_log_prob_pass_runs, update_can_give_old_log_probs

GiB = 1024**3
# The device assumed when none is visible and none is named (`fulcrum doctor --device-memory-gib`): an
# H200, about 140 GiB as torch reports it.
DEFAULT_DEVICE_GIB = 140.0
CUDA_CONTEXT_BYTES = 512 * 1024**2  # CUDA context, cuBLAS workspaces, allocator slack (rough)
# fulcrum.models.linear_logprob.CHUNK_ELEMENTS (a test keeps them equal; not imported, to keep torch out
# of `fulcrum doctor`): the LM head and log-softmax run on float32 (chunk, V) blocks of at most this many.
LOGIT_CHUNK_ELEMENTS = 1 << 27
# fulcrum.models.packed.SAVE_ATTENTION_OUTPUTS (a test keeps them equal; not imported, as above): the
# checkpointed layers also keep the attention kernel's outputs for the backward.
ATTENTION_OUTPUTS_KEPT = True
# With trainer.park_optimizer_state one process with a critic parks each model's AdamW state in host
# memory during the other's update (fulcrum.workers.state_parking). The forward phases count both states
# resident, as after a checkpoint (which brings parked state back).


def read_model_shape(path: str | None) -> ModelShape | None:
    """The shape from `<path>/config.json` (its family's spec, `fulcrum.models.arch`); None when it is
    not a readable local model folder."""
    if not path:
        return None
    config_file = Path(os.path.expanduser(path)) / "config.json"
    try:
        return model_shape(json.loads(config_file.read_text()))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def layer_activation_bytes(shape: ModelShape) -> int:
    """Bytes one token keeps for the backward of one decoder layer, all bf16 (compute copies, no autocast):
    the layer input and its normed copy, q, k, v, the attention output, the residual after attention and
    its normed copy (2·(6h + q + 2kv) together), the MLP's gate, up and their product (2·3I), plus the
    float32 statistics of the two norms and the attention's log-sum-exp per head (4·(2 + H))."""
    h, i = shape.hidden, shape.intermediate
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    return 2 * (6 * h + q + 2 * kv + 3 * i) + 4 * (2 + shape.heads)


def forward_working_bytes(shape: ModelShape) -> int:
    """Bytes a token needs inside one layer of a no-grad forward: the MLP's gate, up and their product
    beside the layer's output, bf16: 2·(h + 3I) (what came before is freed as the layer goes)."""
    return 2 * (shape.hidden + 3 * shape.intermediate)


@dataclass
class Phase:
    """One phase's resident items (name -> bytes); `total` is their sum."""

    name: str
    items: dict[str, float] = field(default_factory=dict)

    @property
    def total(self) -> float:
        return sum(self.items.values())


@dataclass
class Estimate:
    device_bytes: float
    device_known: bool  # a visible device or --device-memory-gib; else the default is assumed
    phases: list[Phase]
    kv_cache_bytes: float
    kv_tokens: int
    graphs: dict[str, str | None] = field(default_factory=dict)  # role -> why it runs eagerly (None: graphed)

    @property
    def peak(self) -> Phase:
        return max(self.phases, key=lambda p: p.total)


@dataclass(frozen=True)
class Sizes:
    """The sizes that set memory, read from a resolved configuration (worst case: full-length rows)."""

    seq_len: int  # prompt + response
    response_len: int
    update_rows: dict[str, int]  # role -> rows of the largest training micro-batch
    forward_rows: dict[str, int]  # role -> rows of the largest no-grad forward micro-batch
    checkpointing: dict[str, bool]  # role -> gradient checkpointing
    with_entropy: bool  # the actor's update also computes the entropy (entropy_coeff != 0, or on-policy)


def _rows(micro: int | None, dynamic: bool, token_limit: int | None, seq_len: int) -> int:
    """Rows of the largest micro-batch: the size, or with dynamic batching what the token budget holds."""
    if dynamic and token_limit:
        return max(1, token_limit // seq_len)
    return max(1, int(micro or 1))


def sizes_from(cfg: Any) -> Sizes:
    arr, critic = cfg.actor_rollout_ref, cfg.critic
    seq = int(arr.rollout.prompt_length) + int(arr.rollout.response_length)
    update = {
        "actor": _rows(
            arr.actor.ppo_micro_batch_size_per_gpu,
            arr.actor.use_dynamic_bsz,
            arr.actor.ppo_max_token_len_per_gpu,
            seq,
        ),
        "critic": _rows(
            critic.ppo_micro_batch_size_per_gpu,
            bool(critic.use_dynamic_bsz),
            critic.ppo_max_token_len_per_gpu,
            seq,
        ),
    }
    forward = {
        "actor": _rows(
            arr.rollout.log_prob_micro_batch_size_per_gpu,
            bool(arr.rollout.log_prob_use_dynamic_bsz),
            arr.rollout.log_prob_max_token_len_per_gpu,
            seq,
        ),
        "reference": _rows(
            arr.ref.log_prob_micro_batch_size_per_gpu,
            bool(arr.ref.log_prob_use_dynamic_bsz),
            arr.ref.log_prob_max_token_len_per_gpu,
            seq,
        ),
        "critic": _rows(
            critic.forward_micro_batch_size_per_gpu,
            bool(critic.use_dynamic_bsz),
            critic.forward_max_token_len_per_gpu,
            seq,
        ),
    }
    return Sizes(
        seq_len=seq,
        response_len=int(arr.rollout.response_length),
        update_rows=update,
        forward_rows=forward,
        checkpointing={
            "actor": bool(arr.model.enable_gradient_checkpointing),
            "critic": bool(critic.model.enable_gradient_checkpointing),
        },
        with_entropy=float(arr.actor.entropy_coeff) != 0.0 or update_can_give_old_log_probs(cfg),
    )


def update_activation_bytes(shape: ModelShape, rows: int, seq_len: int, checkpointing: bool) -> float:
    """Activations of one training micro-batch of T = rows · seq_len tokens: with checkpointing, each
    layer's bf16 input and the attention kernel's bf16 output and float32 log-sum-exp, which the
    checkpoint keeps (L · (2h + 2q + 4H) · T); without, every layer's tensors
    (L · layer_activation_bytes · T)."""
    tokens = rows * seq_len
    if checkpointing:
        attention = 2 * shape.heads * shape.head_dim + 4 * shape.heads if ATTENTION_OUTPUTS_KEPT else 0
        return shape.layers * (2 * shape.hidden + attention) * tokens
    return shape.layers * layer_activation_bytes(shape) * tokens


def attention_backward_bytes(shape: ModelShape, tokens: int) -> float:
    """What a layer's attention backward allocates for a micro-batch of `tokens` (T), FlashAttention-2's
    (aten's `_flash_attention_backward`): the incoming gradient of its output (2q), a float32 accumulator of
    dq (4q), dq itself (2q), dk and dv at every query head before the grouped heads are summed (2 · 2q, only
    when K < H), dk and dv (2 · 2kv) and float32 row statistics (4H): (12q + 4kv + 4H) · T bytes with
    grouped heads. Checkpointing recomputes the layers inside the compiled region, which frees each
    recomputed tensor as soon as its gradient is taken; this workspace is the largest that lives at once,
    and the LM head's blocks (`update_logits_bytes`) are freed before it, so the update holds the larger of
    the two. Measured at 16k-token sequences (Qwen3-0.6B's shape, 131k tokens a micro-batch): the update's
    capture took 26.75 GiB against 22.3 for its checkpoints and bf16 gradients (BENCHMARKS.md, "Training at
    16k tokens a sequence"); this item is 3.5 GiB of the 4.4 between them."""
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    expanded = 4 * q if shape.kv_heads < shape.heads else 0
    return float((8 * q + expanded + 4 * kv + 4 * shape.heads) * tokens)


def logits_block_elements(shape: ModelShape, rows: int, response_len: int) -> int:
    """Elements of the largest (chunk, V) block of logits: min(rows · R · V, LOGIT_CHUNK_ELEMENTS)."""
    return min(rows * response_len * shape.vocab, LOGIT_CHUNK_ELEMENTS)


def update_logits_bytes(
    shape: ModelShape, rows: int, response_len: int, with_entropy: bool, head_trained: bool = True
) -> float:
    """The LM head's backward on the response positions, chunk by chunk (fulcrum.models.linear_logprob):
    one bf16 block of logits recomputed and its bf16 gradient (2 · 2 B a block element; an entropy bonus
    adds one more block, not measured), and, when the head trains (not under LoRA), its float32
    weight-gradient accumulator (4 · V · h)."""
    blocks = 2 + (1 if with_entropy else 0)
    accumulator = 4 * shape.vocab * shape.hidden if head_trained else 0
    return blocks * 2 * logits_block_elements(shape, rows, response_len) + accumulator


def forward_logits_bytes(shape: ModelShape, rows: int, response_len: int) -> float:
    """No-grad log-probs, chunk by chunk: one bf16 block of logits (the softmax is fused over it)."""
    return 2 * logits_block_elements(shape, rows, response_len)


def weight_items(role: str, params: ModelParams) -> dict[str, float]:
    """What `role`'s weights keep resident: fp32 masters and AdamW's two fp32 moments of the trained
    parameters (12 B each), and a LoRA model's frozen base once in bf16 (2 B each)."""
    if not params.lora:
        return {f"{role} weights (fp32)": 4 * params.trained, adamw_item(role, params): 8 * params.trained}
    return {
        f"{role} frozen base (bf16)": 2 * params.frozen,
        f"{role} LoRA adapters (fp32)": 4 * params.trained,
        adamw_item(role, params): 8 * params.trained,
    }


def adamw_item(role: str, params: ModelParams) -> str:
    """The name of `role`'s AdamW state among the resident items."""
    return f"{role} LoRA adapters' AdamW state (fp32)" if params.lora else f"{role} AdamW state (fp32)"


def update_work_items(role: str, shape: ModelShape, sizes: Sizes, head_bytes: float) -> dict[str, float]:
    """One training micro-batch's work (name -> bytes) for `role` ("actor" or "critic"): the activations of
    sizes.update_rows[role] x sizes.seq_len tokens and the larger of the actor's LM head blocks (`head_bytes`,
    `update_logits_bytes`; 0 for the critic) and, with checkpointing, the attention backward's workspace
    (`attention_backward_bytes`), which do not live at once."""
    rows, checkpointing = sizes.update_rows[role], sizes.checkpointing[role]
    items = {
        f"activations, micro-batch of {rows} x {sizes.seq_len} tokens "
        f"(checkpointing {'on' if checkpointing else 'off'})": update_activation_bytes(
            shape, rows, sizes.seq_len, checkpointing
        )
    }
    attention = attention_backward_bytes(shape, rows * sizes.seq_len) if checkpointing else 0.0
    if attention > head_bytes:
        items["the attention kernel's backward"] = attention
    elif head_bytes:
        items["LM head on the response tokens"] = head_bytes
    return items


def forward_work_items(shape: ModelShape, rows: int, sizes: Sizes, lm_head: bool) -> dict[str, float]:
    """One no-grad forward micro-batch's work (name -> bytes) of `rows` x sizes.seq_len tokens: the residual
    stream (2h a token) and the larger of one layer's working set (`forward_working_bytes`) and, with the
    LM head, one bf16 block of logits."""
    tokens = rows * sizes.seq_len
    items = {f"hidden states, micro-batch of {rows} x {sizes.seq_len} tokens": 2.0 * shape.hidden * tokens}
    working = forward_working_bytes(shape) * tokens
    logits = forward_logits_bytes(shape, rows, sizes.response_len) if lm_head else 0.0
    if logits > working:
        items["one block of logits (bf16)"] = logits
    else:
        items["one layer's working set"] = working
    return items


def update_phase(
    role: str, n_params: int, base: dict[str, float], work: dict[str, float], graphed: bool = False
) -> Phase:
    """`role`'s ("actor" or "critic") update phase: `base` (what stays resident, name -> bytes), the fp32
    gradients of its `n_params` trained parameters (4 B each), and unless `graphed` their bf16 compute
    weights and bf16 gradients (2 + 2 B each) and its micro-batch's `work` (`update_work_items`). Graphed,
    those are in `base` already: the compute weights and a buffer of their gradients kept resident, the
    work in the graphs' pool."""
    phase = Phase(f"{role} update", dict(base))
    phase.items[f"{role} gradients (fp32)"] = 4 * n_params
    if not graphed:
        phase.items["bf16 compute weights"] = 2 * n_params
        phase.items["gradients of the bf16 compute weights"] = 2 * n_params
        phase.items.update(work)
    return phase


def forward_phase(
    name: str, n_params: int, base: dict[str, float], work: dict[str, float], graphed: bool = False
) -> Phase:
    """A no-grad forward (old log-probs, reference log-probs, values): `base`, and unless `graphed` the bf16
    compute weights of its `n_params` parameters (2 B each) and its micro-batch's `work`
    (`forward_work_items`); graphed, both are in `base` (the weights kept resident, the work in the
    graphs' pool)."""
    phase = Phase(name, dict(base))
    if not graphed:
        phase.items["bf16 compute weights"] = 2 * n_params
        phase.items.update(work)
    return phase


def estimate(
    cfg: Any,
    shape: ModelShape,
    device_bytes: float,
    device_known: bool,
    uses_critic: bool,
    uses_reference: bool,
    responses_per_device: int,
) -> Estimate:
    """The generation and training phases of one step on one device (see the module docstring)."""
    arr = cfg.actor_rollout_ref
    sizes = sizes_from(cfg)
    p_actor = param_count(shape)
    actor = model_params(arr.model, shape, p_actor)
    head = shape.hidden + 1  # the critic's value head, trained whole
    critic = model_params(cfg.critic.model, shape, param_count(shape, lm_head=False) + head, head)
    resident = weight_items("actor", actor)
    if uses_critic:
        resident |= weight_items("critic", critic)
    if uses_reference and not actor.lora:  # a LoRA actor's reference is its base, adapters off
        resident["reference weights (fp32)"] = 4 * p_actor
    resident["CUDA context and workspaces"] = CUDA_CONTEXT_BYTES

    # CUDA graphs of the micro-batches (`graphs_refused`): each graphed model's compute weights and gradient
    # buffer, the reference's compute weights, and the graphs' pool (the largest forward's and update's work).
    linear = shape.linear_layers > 0
    refused = {"actor": graphs_refused(cfg, "actor", device_bytes, 4 * actor.trained, actor.lora, linear)}
    if uses_critic:
        refused["critic"] = graphs_refused(
            cfg, "critic", device_bytes, 4 * critic.trained, critic.lora, linear
        )
    if uses_reference and not actor.lora:  # a LoRA actor's reference is its base, adapters off
        refused["reference"] = graphs_refused(cfg, "reference", device_bytes, 2 * p_actor, linear=linear)
    graphed = {role: role in refused and refused[role] is None for role in ("actor", "critic", "reference")}
    head = update_logits_bytes(
        shape, sizes.update_rows["actor"], sizes.response_len, sizes.with_entropy, not actor.lora
    )
    update_work = {"actor": update_work_items("actor", shape, sizes, head)}
    if uses_critic:
        update_work["critic"] = update_work_items("critic", shape, sizes, 0.0)
    # The no-grad passes: (phase, parameters, the role whose graphs replay it, its micro-batch's work).
    forwards: list[tuple[str, int, str, dict[str, float]]] = []
    if old_log_prob_pass_runs(cfg):  # not when the update gives them, nor under bypass mode
        work = forward_work_items(shape, sizes.forward_rows["actor"], sizes, True)
        forwards.append(("old log-prob forward", actor.trained, "actor", work))
    if uses_reference:  # its own model, or a LoRA actor's forwards with the adapters off
        n_ref, ref_role = (actor.trained, "actor") if actor.lora else (p_actor, "reference")
        work = forward_work_items(shape, sizes.forward_rows["reference"], sizes, True)
        forwards.append(("reference log-prob forward", n_ref, ref_role, work))
    if uses_critic:
        work = forward_work_items(shape, sizes.forward_rows["critic"], sizes, False)
        forwards.append(("values forward", critic.trained, "critic", work))
    update_pool = forward_pool = 0.0
    for role, params in (("actor", actor), ("critic", critic)):
        if graphed[role]:
            resident[f"{role} compute weights and gradients kept for CUDA graphs (bf16)"] = 4 * params.trained
            update_pool = max(update_pool, 2 * params.trained + sum(update_work[role].values()))
    for _, _, role, work in forwards:
        if graphed[role]:
            forward_pool = max(forward_pool, sum(work.values()))
    pool = forward_pool + update_pool
    if graphed["reference"]:
        resident["reference compute weights kept for CUDA graphs"] = 2 * p_actor
    if pool:
        resident["CUDA graphs' memory pool"] = pool

    rollout = arr.rollout
    generation = Phase("generation", dict(resident))
    training_extra: dict[str, float] = {}
    if rollout.name == "native":
        engine_weights = 2 * p_actor
        workspace = engine_workspace_bytes(
            shape.hidden,
            shape.intermediate,
            shape.vocab,
            int(rollout.max_num_batched_tokens),
            int(rollout.max_num_seqs),
            bool(arr.model.lm_head_fp32),
        )
        free_now = device_bytes - generation.total - engine_weights  # when the engine sizes its cache
        budget = kv_cache_budget(
            device_bytes, float(rollout.gpu_memory_utilization), engine_weights, workspace, free_now
        )
        # A hybrid model's recurrent states (fulcrum.rollout.native.model_runner): a slot for every
        # decoding sequence, one prompt part-way through a chunked prefill and the scratch slot, whatever
        # the sequences' lengths, taken from the budget ahead of the KV blocks.
        slots = int(rollout.max_num_seqs) + 2
        states = slots * recurrent_state_bytes(shape) if shape.linear_layers else 0
        budget -= states
        kv = max(0.0, min(budget, usable_cache_bytes(rollout, shape, sizes.seq_len)))
        if states:
            generation.items[f"recurrent states of the linear-attention layers ({slots} slots)"] = states
        generation.items["engine weights (bf16)"] = engine_weights
        generation.items["engine workspace"] = workspace
        generation.items[f"KV cache (gpu_memory_utilization={rollout.gpu_memory_utilization})"] = kv
        training_extra["engine weights (bf16)"] = engine_weights
        if not rollout.free_cache_engine:
            training_extra["KV cache (free_cache_engine=False)"] = kv + states
    else:  # hf generate shares the actor's module; its cache holds the decoding batch
        batch = min(int(rollout.max_num_seqs), responses_per_device)
        kv = batch * sizes.seq_len * kv_bytes_per_token(shape)
        generation.items["KV cache of generate (bf16)"] = kv
        if shape.linear_layers:
            generation.items["recurrent states of generate"] = batch * recurrent_state_bytes(shape)
        generation.items["decode logits (fp32)"] = batch * shape.vocab * 4 * 2
    kv_tokens = int(kv // kv_bytes_per_token(shape))

    phases = [generation]
    base = {**resident, **training_extra}
    # One process with a critic: during each model's update the other's AdamW state waits in host memory
    # (fulcrum.workers.state_parking).
    parked = bool(cfg.trainer.park_optimizer_state) and uses_critic and world_size(cfg) == 1
    actor_base = without(base, adamw_item("critic", critic)) if parked else base
    critic_base = without(base, adamw_item("actor", actor)) if parked else base
    phases.append(update_phase("actor", actor.trained, actor_base, update_work["actor"], graphed["actor"]))
    if uses_critic:
        phases.append(
            update_phase("critic", critic.trained, critic_base, update_work["critic"], graphed["critic"])
        )
    for name, n_params, role, work in forwards:
        phases.append(forward_phase(name, n_params, base, work, graphed[role]))
    return Estimate(device_bytes, device_known, phases, kv, kv_tokens, refused)


def usable_cache_bytes(rollout: Any, shape: ModelShape, seq_len: int) -> float:
    """The KV cache the native engine stops at whatever the budget (`EngineConfig.usable_cache_blocks`),
    in bytes; unbounded when the engine's configuration does not resolve (doctor reports that elsewhere)."""
    try:
        config = engine_config_from(rollout, seq_len)
    except (ValueError, TypeError, AssertionError):
        return math.inf
    if config.num_kv_blocks is not None:
        return math.inf
    return config.usable_cache_blocks() * config.block_size * kv_bytes_per_token(shape)


def without(items: dict[str, float], name: str) -> dict[str, float]:
    return {k: v for k, v in items.items() if k != name}


def format_estimate(est: Estimate) -> list[str]:
    """Lines for `fulcrum doctor`: the peak phase itemised, the other phases' totals, against the device."""
    device = f"{est.device_bytes / GiB:.1f} GiB" + ("" if est.device_known else " (assumed: an H200)")
    peak = est.peak
    lines = [
        f"memory estimate per device (device {device}): peak {peak.total / GiB:.1f} GiB while in {peak.name}"
    ]
    for name, size in sorted(peak.items.items(), key=lambda kv: -kv[1]):
        lines.append(f"  {size / GiB:8.2f} GiB  {name}")
    for phase in est.phases:
        if phase is not peak:
            lines.append(f"  other phase: {phase.name} {phase.total / GiB:.1f} GiB")
    if est.kv_cache_bytes > 0:
        lines.append(f"  KV cache holds {est.kv_tokens:,} tokens")
    if est.graphs:
        said = [f"{role} " + ("on" if why is None else f"off ({why})") for role, why in est.graphs.items()]
        lines.append("  CUDA graphs of the micro-batches: " + ", ".join(said))
    return lines
