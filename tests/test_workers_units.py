"""Workers' building blocks on a tiny model: padded log-probs equal unpadded ones, micro-batching,
LR schedules (hand-computed values), the value head's layout."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import log_probs_of, values_of

from fulcrum.batch import Batch
from fulcrum.models.load import load_backbone, load_causal_lm
from fulcrum.models.logprob import logprob_and_entropy
from fulcrum.models.value_head import CriticModel
from fulcrum.workers.micro_batch import (
    make_micro_batches,
    restore_order,
    token_budget_groups,
)
from fulcrum.workers.optim import build_lr_scheduler, warmup_steps

CPU = torch.device("cpu")


def make_batch(b: int = 6, p: int = 10, r: int = 7, seed: int = 0) -> Batch:
    """Prompts of 3..(3+b) tokens left-padded, responses of 1..b tokens right-padded (verl layout)."""
    g = torch.Generator().manual_seed(seed)
    prompts = torch.zeros(b, p, dtype=torch.long)
    prompt_mask = torch.zeros(b, p, dtype=torch.long)
    responses = torch.zeros(b, r, dtype=torch.long)
    response_mask = torch.zeros(b, r, dtype=torch.long)
    for i in range(b):
        lp, lr = min(3 + i, p), min(1 + i, r)
        prompts[i, p - lp :] = torch.randint(5, 1000, (lp,), generator=g)
        prompt_mask[i, p - lp :] = 1
        responses[i, :lr] = torch.randint(5, 1000, (lr,), generator=g)
        response_mask[i, :lr] = 1
    attention_mask = torch.cat([prompt_mask, response_mask], 1)
    return Batch(
        {
            "prompts": prompts,
            "responses": responses,
            "input_ids": torch.cat([prompts, responses], 1),
            "attention_mask": attention_mask,
            "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0),
            "response_mask": response_mask,
        }
    )


def unpadded_log_probs(model: torch.nn.Module, batch: Batch, temperature: float) -> torch.Tensor:
    """Reference: each sample alone, without any padding, full log_softmax in float64."""
    out = torch.zeros(batch["responses"].shape, dtype=torch.float64)
    p = batch.prompt_length
    for i in range(len(batch)):
        keep = batch["attention_mask"][i].bool()
        ids = batch["input_ids"][i][keep][None]
        n = int(batch["response_mask"][i].sum())
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, -n - 1 : -1].double() / temperature
        out[i, :n] = torch.log_softmax(logits, -1).gather(-1, batch["responses"][i, :n, None]).squeeze(-1)
        assert batch["attention_mask"][i, p:].sum() == n
    return out


def test_padded_log_probs_equal_unpadded(tiny_dir: str) -> None:
    model = load_causal_lm(tiny_dir, CPU).eval()
    batch = make_batch()
    expected = unpadded_log_probs(model, batch, temperature=0.7)
    with torch.no_grad():
        got, entropy = log_probs_of(model, batch, 0.7, True, CPU)
    mask = batch["response_mask"].bool()
    assert torch.allclose(got.double()[mask], expected[mask], atol=1e-5)
    assert (got[~mask] == 0).all()
    assert entropy is not None and (entropy[mask] > 0).all()


def test_logprob_and_entropy_hand_values() -> None:
    # Two tokens over a vocab of 3: uniform logits → log(1/3), entropy log 3.
    logits = torch.zeros(1, 2, 3)
    logits[0, 1] = torch.tensor([math.log(2.0), 0.0, 0.0])  # probs 1/2, 1/4, 1/4
    labels = torch.tensor([[0, 1]])
    logp, ent = logprob_and_entropy(logits, labels, with_entropy=True)
    assert logp[0, 0].item() == pytest.approx(math.log(1 / 3))
    assert logp[0, 1].item() == pytest.approx(math.log(1 / 4))
    assert ent[0, 0].item() == pytest.approx(math.log(3))
    assert ent[0, 1].item() == pytest.approx(-(0.5 * math.log(0.5) + 2 * 0.25 * math.log(0.25)))
    with torch.no_grad():  # the chunked no-grad path gives the same numbers
        logp2, ent2 = logprob_and_entropy(logits, labels, with_entropy=True)
    assert torch.equal(logp, logp2) and torch.equal(ent, ent2)


def test_logprob_and_entropy_match_float64_references_and_temperature() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 5, 50, generator=gen) * 5
    labels = torch.randint(0, 50, (4, 5), generator=gen)
    tau = 0.7
    z = logits.double() / tau
    ref_logp = torch.log_softmax(z, -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    ref_ent = -(torch.softmax(z, -1) * torch.log_softmax(z, -1)).sum(-1)
    logp, ent = logprob_and_entropy(logits, labels, temperature=tau, with_entropy=True)
    torch.testing.assert_close(logp.double(), ref_logp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent.double(), ref_ent, atol=1e-5, rtol=1e-5)
    # bf16 logits (the autocast forward) are computed in float32.
    logp_bf, ent_bf = logprob_and_entropy(logits.bfloat16(), labels, with_entropy=True)
    assert logp_bf.dtype == torch.float32 and ent_bf.dtype == torch.float32
    zb = logits.bfloat16().double()
    torch.testing.assert_close(
        ent_bf.double(), -(torch.softmax(zb, -1) * torch.log_softmax(zb, -1)).sum(-1), atol=1e-5, rtol=1e-5
    )


def test_dynamic_micro_batches_fit_budget_and_restore_order(tiny_dir: str) -> None:
    model = load_causal_lm(tiny_dir, CPU).eval()
    batch = make_batch(b=8, p=12, r=9)
    budget = 40
    micro, order = make_micro_batches(batch, None, True, budget, "actor.ppo_max_token_len_per_gpu")
    assert sorted(order) == list(range(8)) and len(micro) > 1
    for mb in micro:  # padded cost (rows × longest prompt + longest response) within the budget
        p = mb["attention_mask"][:, : mb.prompt_length].sum(-1).max()
        r = mb["response_mask"].sum(-1).max()
        assert len(mb) * int(p + r) <= budget
    with torch.no_grad():
        parts = [log_probs_of(model, mb, 1.0, False, CPU)[0] for mb in micro]
        fixed = torch.cat([log_probs_of(model, mb, 1.0, False, CPU)[0] for mb in batch.split(3)])
    assert torch.allclose(restore_order(parts, order), fixed, atol=1e-5)
    # Fixed size, sorted by length (the no-grad passes): same numbers back in the original order.
    micro, order = make_micro_batches(batch, 3, False, None, "k", sort_by_length=True)
    assert order is not None and order != list(range(8))
    with torch.no_grad():
        parts = [log_probs_of(model, mb, 1.0, False, CPU)[0] for mb in micro]
    assert torch.allclose(restore_order(parts, order), fixed, atol=1e-5)


def test_a_sequence_over_the_token_budget_takes_a_micro_batch_alone() -> None:
    """A direct caller's budget below one sequence (the configuration refuses it, naming the key): that
    sequence runs alone, the others still share their budget."""
    assert token_budget_groups([8, 2, 2], [5, 1, 1], 10) == [[0], [1, 2]]


def lr_multipliers(optim_cfg: dict, total: int, steps: int) -> list[float]:
    """The lr (÷ peak lr) the schedule gives to each of `steps` optimiser steps."""
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=2.0)
    schedule = build_lr_scheduler(optimizer, optim_cfg, total, "actor_rollout_ref.actor.optim")
    out = []
    for _ in range(steps):
        out.append(schedule.get_last_lr()[0] / 2.0)
        optimizer.step()
        schedule.step()
    return out


def test_lr_schedules_hand_values() -> None:
    constant = {"lr_warmup_steps": 4, "lr_scheduler_type": "constant"}
    assert lr_multipliers(constant, 10, 6) == [0.0, 0.25, 0.5, 0.75, 1.0, 1.0]
    assert lr_multipliers({"lr_warmup_steps": 0}, 10, 2) == [1.0, 1.0]
    # cosine after 2 warm-up steps over 10 total: progress (s - 2) / 8, floor 0.1
    cosine = {"lr_warmup_steps": 2, "lr_scheduler_type": "cosine", "min_lr_ratio": 0.1}
    got = lr_multipliers(cosine, 10, 11)
    assert got[:3] == pytest.approx([0.0, 0.5, 1.0])
    assert got[6] == pytest.approx(0.1 + 0.9 * 0.5)
    assert got[10] == pytest.approx(0.1)
    # num_cycles=1: a full cosine wave, back to the peak at the end.
    wave = lr_multipliers({**cosine, "num_cycles": 1.0, "min_lr_ratio": 0.0}, 10, 11)
    assert wave[6] == pytest.approx(0.0, abs=1e-12) and wave[10] == pytest.approx(1.0)
    with pytest.raises(ValueError, match=r"actor_rollout_ref\.actor\.optim\.lr_scheduler_type"):
        lr_multipliers({"lr_scheduler_type": "linear"}, 10, 1)


def test_lr_schedule_resumes_exactly_from_its_state_dict() -> None:
    cfg = {"lr_warmup_steps": 3, "lr_scheduler_type": "cosine", "min_lr_ratio": 0.05}
    expected = lr_multipliers(cfg, 12, 12)
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=2.0)
    first = build_lr_scheduler(optimizer, cfg, 12, "critic.optim")
    for _ in range(5):
        optimizer.step()
        first.step()
    state = first.state_dict()
    fresh_optimizer = torch.optim.SGD([param], lr=2.0)
    resumed = build_lr_scheduler(fresh_optimizer, cfg, 12, "critic.optim")
    resumed.load_state_dict(state)
    after = []
    for _ in range(7):
        after.append(resumed.get_last_lr()[0] / 2.0)
        fresh_optimizer.step()
        resumed.step()
    assert after == expected[5:]


def test_warmup_steps_follow_verl_rule() -> None:
    assert warmup_steps({"lr_warmup_steps": 5, "lr_warmup_steps_ratio": 0.5}, 100) == 5
    assert warmup_steps({"lr_warmup_steps": -1, "lr_warmup_steps_ratio": 0.1}, 100) == 10
    assert warmup_steps({"lr_warmup_steps": None, "lr_warmup_steps_ratio": 0.0}, 100) == 0


def test_value_head_layout_and_masking(tiny_dir: str) -> None:
    critic = CriticModel(load_backbone(tiny_dir, CPU))
    keys = set(critic.state_dict())
    assert {"score.weight", "score.bias"} <= keys and any(k.startswith("model.layers.0.") for k in keys)
    batch = make_batch()
    with torch.no_grad():
        values = values_of(critic, batch, CPU)
    assert values.shape == batch["responses"].shape and values.dtype == torch.float32
    assert (values[batch["response_mask"] == 0] == 0).all()


def test_sdpa_mask_leaves_no_empty_row_and_keeps_results(tiny_dir: str) -> None:
    from fulcrum.models.logprob import no_empty_rows_mask

    model = load_causal_lm(tiny_dir, CPU).eval()
    assert model.config._attn_implementation == "sdpa"
    mask2d = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    mask4d = no_empty_rows_mask(model, mask2d)
    assert mask4d.shape == (2, 1, 4, 4) and mask4d.any(dim=-1).all()  # every query row sees a key
    # real queries never see pad keys, and stay causal
    assert not mask4d[0, 0, 2:, :2].any() and not mask4d[1, 0].triu(1).any()
    ids = torch.randint(5, 1000, (2, 4))
    pos = (mask2d.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        plain = model(input_ids=ids, attention_mask=mask2d, position_ids=pos).logits
        fixed = model(input_ids=ids, attention_mask=mask4d, position_ids=pos).logits
    assert torch.allclose(plain[mask2d.bool()], fixed[mask2d.bool()], atol=1e-6)
