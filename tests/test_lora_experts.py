"""LoRA with `all-linear` on a mixture of experts (Qwen3-MoE, Qwen3-Next): peft 0.21 adapts the fused
expert stacks and the routers as parameters (`ParamWrapper`), and the weight sync sends each as W + its
delta under its Hugging Face name, so the engine's model equals the trained one."""

from __future__ import annotations

import copy

import pytest
import torch
from arch_checks import arch_model, require_model_type
from test_lora_memory import HYBRID_AND_EXPERT_SHAPES

from fulcrum.models.lora import Adapters, LoraSettings

FP32 = torch.float32


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen3_next"])
def test_all_linear_on_experts_syncs_the_merged_model(arch: str) -> None:
    require_model_type(arch)
    torch.set_num_threads(1)
    model = arch_model(arch, HYBRID_AND_EXPERT_SHAPES[arch])
    plain = copy.deepcopy(model)  # the engine's copy: the base weights, to be given the merged ones
    adapters = Adapters(model, LoraSettings(rank=4, alpha=8.0, target_modules="all-linear"), "unused", FP32)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # non-zero adapters (peft starts B at zero, where they change nothing)
        for name, p in adapters.module.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)

    merged = dict(adapters.merged_weights())
    assert any(name.endswith("mlp.experts.gate_up_proj") for name in merged)
    assert any(name.endswith("mlp.experts.down_proj") for name in merged)
    assert any(name.endswith("mlp.gate.weight") for name in merged)  # the router

    # What peft itself merges: every weight it changes is sent, with the same value.
    reference = copy.deepcopy(adapters.peft).merge_and_unload().state_dict()
    base = plain.state_dict()
    changed = {name for name, w in reference.items() if not torch.equal(w, base[name])}
    assert changed == set(merged)
    for name, weight in merged.items():
        torch.testing.assert_close(weight, reference[name], atol=1e-6, rtol=1e-6)

    # The engine's model after the sync gives the trained model's logits (float32 summation order aside:
    # peft adds the experts' deltas inside the forward), which the base's are far from.
    ids = torch.tensor([[5, 9, 200, 41, 7, 3, 88, 12]])
    with torch.no_grad():
        before = plain(input_ids=ids).logits
        plain.load_state_dict(merged, strict=False)
        trained = adapters.module(input_ids=ids).logits
        assert (before - trained).abs().max() > 0.1
        torch.testing.assert_close(plain(input_ids=ids).logits, trained, atol=2e-4, rtol=1e-4)
