"""How often the GPU workers' compiled regions compile: the graphs dynamo makes on the CPU (aot_eager).

Each compile of a decoder layer or a log-softmax chunk is paid again by every new process (a run's first
step, each `fulcrum tune` trial): a pass must compile its graph once whatever its micro-batches' sizes, and
the passes that differ only in what no compiled op reads (the `requires_grad` flag of a tensor no chunk or
no-grad region records autograd for) must share one graph. A checkpointed region must compile whole: after a
graph break inside it dynamo runs the layers eagerly, silently.

The CPU's packed attention reads the longest sequence on the host (a graph break of its own), so these
tests give the layers an opaque varlen attention op, as CUDA's flash kernel is to dynamo.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters

from fulcrum.models import linear_logprob, packed_attention
from fulcrum.models.linear_logprob import linear_log_softmax, use_compiled_chunks
from fulcrum.models.load import load_causal_lm
from fulcrum.models.packed import (
    PackedMicroBatch,
    compile_decoder_layers,
    enable_packed_attention,
    pack_micro_batch,
    packed_hidden_states,
)
from fulcrum.models.tiny import build_tiny_model

CPU = torch.device("cpu")


@torch.library.custom_op("fulcrum_test::varlen_attention", mutates_args=())
def varlen_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int
) -> torch.Tensor:
    """The CPU's packed attention behind an op boundary (what dynamo sees of aten's flash kernel)."""
    return packed_attention.right_padded_causal_attention(q, k, v, cu_seqlens, None).contiguous()


@varlen_attention.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int):
    return torch.empty_like(q)


@torch.library.custom_op("fulcrum_test::varlen_attention_backward", mutates_args=())
def varlen_attention_backward(
    grad: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A stand-in gradient (these tests count compiles, not values)."""
    return grad.clone(), torch.zeros_like(k), torch.zeros_like(v)


@varlen_attention_backward.register_fake
def _(grad: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    return torch.empty_like(grad), torch.empty_like(k), torch.empty_like(v)


def _save(ctx: object, inputs: tuple[object, ...], output: object) -> None:
    ctx.save_for_backward(inputs[1], inputs[2])  # type: ignore[attr-defined]


def _backward(ctx: object, grad: torch.Tensor) -> tuple[object, ...]:
    k, v = ctx.saved_tensors  # type: ignore[attr-defined]
    return (*varlen_attention_backward(grad, k, v), None, None)


varlen_attention.register_autograd(_backward, setup_context=_save)


@pytest.fixture
def opaque_attention(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Packed calls through `varlen_attention`; dynamo's caches and counters empty before and after."""
    monkeypatch.setattr(packed_attention, "has_flash_varlen", lambda x: True)
    monkeypatch.setattr(
        packed_attention,
        "varlen_causal_attention",
        lambda q, k, v, cu, max_seqlen, scale, window=None: varlen_attention(q, k, v, cu, max_seqlen),
    )
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()
    counters.clear()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    size = {"hidden_size": 32, "num_hidden_layers": 3, "num_attention_heads": 2, "num_key_value_heads": 1}
    return build_tiny_model(tmp_path_factory.mktemp("tiny"), intermediate_size=64, **size)


def micro_batch(rows: int, seed: int, prompt: int = 12, response: int = 9) -> PackedMicroBatch:
    """`rows` sequences of random lengths (1..prompt prompt tokens, 1..response response tokens)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 100, (rows, prompt + response), generator=g)
    mask = torch.ones_like(ids)
    for i in range(rows):
        mask[i, : int(torch.randint(0, prompt, (1,), generator=g))] = 0
        mask[i, prompt + int(torch.randint(1, response + 1, (1,), generator=g)) :] = 0
    return pack_micro_batch(ids, mask, (mask.cumsum(-1) - 1).clamp(min=0), prompt)


def compiled_model(model_dir: Path) -> torch.nn.Module:
    """The causal LM with transformers' gradient checkpointing (as the workers load it), its layers
    compiled."""
    model = load_causal_lm(str(model_dir), CPU, gradient_checkpointing=True)
    enable_packed_attention(model)
    compile_decoder_layers(model.model, backend="aot_eager")
    return model


def graphs() -> int:
    """Graphs dynamo has made (a recompile makes one more; a frame it gave up on, none)."""
    return counters["stats"]["unique_graphs"]


def test_a_no_grad_pass_compiles_its_layers_once(model_dir: Path, opaque_attention: None) -> None:
    """The old-log-prob and values passes (eval, no grad) over micro-batches of other token and sequence
    counts: one graph for every region and micro-batch. Transformers' checkpointing marks the embedding's
    output as requiring grad and the regions' outputs are not: the first region alone compiled a graph
    of its own."""
    model = compiled_model(model_dir)
    model.eval()
    with torch.no_grad():
        sizes = [
            packed_hidden_states(model.model, micro_batch(rows, seed)).shape[0]
            for seed, rows in enumerate((4, 2, 5))
        ]
    assert len(set(sizes)) == 3  # three token counts
    assert graphs() == 1


def test_a_checkpointed_update_compiles_its_layers_whole(model_dir: Path, opaque_attention: None) -> None:
    """Train mode with gradients: the layers checkpointed inside one compiled graph, micro-batches of other
    sizes included. The attention module's forward sets a context variable (transformers' kernels hub
    wrapper), a side effect dynamo refuses to replay in the recomputation by default: the region broke
    and its layers ran eagerly."""
    model = compiled_model(model_dir)
    model.train()
    for seed, rows in enumerate((4, 2, 5)):
        packed_hidden_states(model.model, micro_batch(rows, seed)).square().mean().backward()
    assert not counters["graph_break"]
    assert graphs() == 1


def test_the_log_softmax_chunks_compile_once_for_every_caller(opaque_attention: None) -> None:
    """The chunked LM head's forward chunk is called by the no-grad passes with the actor's weights
    (which require grad) and a frozen reference's (which do not), and by the update's autograd function
    with hidden states that require grad: one graph for all of them, and one for the backward's chunk."""
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(50, 8, generator=g, requires_grad=True)
    frozen = weight.detach().clone()
    use_compiled_chunks(True, backend="aot_eager")
    try:
        for rows, w in ((7, weight), (5, frozen)):
            with torch.no_grad():
                linear_log_softmax(
                    torch.randn(rows, 8, generator=g), w, torch.randint(0, 50, (rows,)), 1.0, True
                )
        hidden = torch.randn(6, 8, generator=g, requires_grad=True)
        logp, _ = linear_log_softmax(hidden, weight, torch.randint(0, 50, (6,)), 1.0, True)
        logp.sum().backward()
    finally:
        use_compiled_chunks(False)
    assert linear_logprob._CHUNK_FNS["forward"] is linear_logprob._chunk_forward
    assert graphs() == 2  # the forward chunk and the backward's


# A process that compiles the checkpointed update with inductor (the GPU's backend; on the CPU its C++
# kernels) over one micro-batch and prints AOTAutograd's cache counters.
UPDATE_IN_A_NEW_PROCESS = """
import json, sys
import torch
from torch._dynamo.utils import counters
import test_compiled_regions as t
from fulcrum.models import packed_attention
from fulcrum.models.packed import compile_decoder_layers, packed_hidden_states
packed_attention.has_flash_varlen = lambda x: True
packed_attention.varlen_causal_attention = (
    lambda q, k, v, cu, max_seqlen, scale, window=None: t.varlen_attention(q, k, v, cu, max_seqlen)
)
model = t.load_causal_lm(sys.argv[1], t.CPU, gradient_checkpointing=True)
t.enable_packed_attention(model)
compile_decoder_layers(model.model, backend="inductor", cpp_wrapper=False)
model.train()
packed_hidden_states(model.model, t.micro_batch(4, 0)).square().mean().backward()
print(json.dumps(dict(counters["aot_autograd"])))
"""


def test_a_second_process_takes_the_checkpointed_update_from_the_compile_cache(
    model_dir: Path, tmp_path: Path
) -> None:
    """A run's first step compiles its passes; the next run on the machine (a second seed, each `fulcrum
    tune` trial, a resume) should find them in torch's on-disk caches. AOTAutograd caches a selectively
    checkpointed graph only when the checkpoint's context function carries a `cache_hash` and pickles;
    without, it bypassed its cache and every new process traced and partitioned the update again."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor_cache")}

    def aot_counters() -> dict[str, int]:
        out = subprocess.run(
            [sys.executable, "-c", UPDATE_IN_A_NEW_PROCESS, str(model_dir)],
            cwd=Path(__file__).parent,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    first = aot_counters()
    assert first.get("autograd_cache_bypass", 0) == 0 and first.get("autograd_cache_saved", 0) >= 1, first
    second = aot_counters()
    assert second.get("autograd_cache_hit", 0) >= 1, second
    assert second.get("autograd_cache_bypass", 0) == 0 and second.get("autograd_cache_miss", 0) == 0, second


def test_each_checkpoint_setting_has_its_own_cache_hash_the_same_in_every_process() -> None:
    """AOTAutograd reuses a cached checkpointed graph when the hash matches: a hash shared by two settings
    of the checkpoint flags would hand one setting the other's saved tensors; one that moves from process
    to process would never hit."""
    from fulcrum.models.checkpoint_policy import CHECKPOINT_CONTEXTS

    here = {flags: bound.cache_hash for flags, bound in CHECKPOINT_CONTEXTS.items()}
    assert len(set(here.values())) == 4
    code = "from fulcrum.models.checkpoint_policy import CHECKPOINT_CONTEXTS as c; print(sorted((k, v.cache_hash) for k, v in c.items()))"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == str(sorted(here.items()))
