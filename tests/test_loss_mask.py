"""A batch carries a per-token loss mask (`response_mask`) apart from the attention mask: a two-turn
sample (policy tokens, a 5-token tool answer with loss mask 0, policy tokens) runs every token through
the forwards, while losses, advantages and log-probs count only the policy's; response lengths, reward
placement and `response_length/*` read the attention mask."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from helpers import log_probs_of, ppo_loss
from test_packed import grads

from fulcrum.algo.advantages import compute_advantage
from fulcrum.algo.masked import masked_whiten
from fulcrum.batch import Batch, assemble_batch, response_lengths, reward_positions
from fulcrum.models.load import load_causal_lm
from fulcrum.models.packed import enable_packed_attention
from fulcrum.reward.scoring import RewardResult, score_batch
from fulcrum.trainer.metrics import compute_data_metrics

CPU = torch.device("cpu")
TOL = 1e-5
P, R = 8, 12
TOOL = [0] * 5  # a tool's answer inside the response: in the sequence, out of every loss

# (prompt length, loss mask of the response): two two-turn samples around a single-turn one; the last
# fills the response width exactly (clipped), its final tokens after the tool answer are the policy's.
SHAPES = [(4, [1] * 3 + TOOL + [1] * 2), (6, [1] * 4), (3, [1] * 2 + TOOL + [1] * 5)]


def two_turn_batch(seed: int = 0, tool_ids: list[int] | None = None) -> Batch:
    g = torch.Generator().manual_seed(seed)
    items, token_ids, masks = [], [], []
    for p, mask in SHAPES:
        items.append({"input_ids": torch.randint(5, 1000, (p,), generator=g).tolist()})
        ids = torch.randint(5, 1000, (len(mask),), generator=g).tolist()
        if tool_ids is not None:
            ids = [
                tool_ids[j % len(tool_ids)] if m == 0 else t
                for j, (t, m) in enumerate(zip(ids, mask, strict=True))
            ]
        token_ids.append(ids)
        masks.append(mask)
    logprobs = [[0.0] * len(t) for t in token_ids]
    return assemble_batch(items, token_ids, logprobs, [0, 1, 2], P, R, 0, "u", loss_masks=masks)


def test_assemble_batch_keeps_tool_tokens_in_the_sequence_and_out_of_the_loss() -> None:
    batch = two_turn_batch()
    for i, (p, mask) in enumerate(SHAPES):
        n = len(mask)
        assert batch["attention_mask"][i, P - p :].tolist() == [1] * (p + n) + [0] * (R - n)
        assert batch["response_mask"][i].tolist() == mask + [0] * (R - n)
    assert response_lengths(batch).tolist() == [10, 4, 12]
    # Positions run on through the tool answer: the forward sees one continuous sequence.
    assert batch["position_ids"][0, P - 4 : P + 10].tolist() == list(range(14))
    with pytest.raises(ValueError, match="loss_masks"):
        assemble_batch([{"input_ids": [5]}], [[6, 7]], [[0.0, 0.0]], [0], P, R, 0, "u", loss_masks=[[1]])


def test_packed_equals_padded_with_a_non_contiguous_loss_mask(tiny_dir: str) -> None:
    padded = load_causal_lm(tiny_dir, CPU)
    packed_model = load_causal_lm(tiny_dir, CPU)
    enable_packed_attention(packed_model)
    batch = two_turn_batch()
    mask = batch["response_mask"].float()
    g = torch.Generator().manual_seed(1)
    advantages = torch.randn(mask.shape, generator=g) * mask
    old = (torch.randn(mask.shape, generator=g) * 0.1 - 5.0) * mask
    results = {}
    for name, model, packed in (("padded", padded, False), ("packed", packed_model, True)):
        logp, ent = log_probs_of(model, batch, 1.0, True, CPU, packed=packed)
        loss, _ = ppo_loss(old, logp, advantages, mask)
        (loss - 0.01 * (ent * mask).sum() / mask.sum()).backward()
        results[name] = (logp.detach(), ent.detach(), grads(model))
    (lp_a, ent_a, g_a), (lp_b, ent_b, g_b) = results["padded"], results["packed"]
    assert torch.allclose(lp_a, lp_b, atol=TOL, rtol=0)
    assert torch.allclose(ent_a, ent_b, atol=TOL, rtol=0)
    assert (lp_b[~batch["response_mask"].bool()] == 0).all() and (lp_b[mask.bool()] != 0).all()
    assert g_a.keys() == g_b.keys()
    for name in g_a:
        assert torch.allclose(g_a[name], g_b[name], atol=TOL, rtol=1e-4), name


def hand_log_probs(model: torch.nn.Module, batch: Batch, i: int) -> torch.Tensor:
    """Row i's response log-probs (n_i,), the sample alone and unpadded: every response token is input."""
    p = int(batch["attention_mask"][i, :P].sum())
    n = int(response_lengths(batch)[i])
    ids = torch.cat([batch["prompts"][i, P - p :], batch["responses"][i, :n]])
    logits = model(input_ids=ids[None]).logits[0].float()  # (p + n, V)
    logp = torch.log_softmax(logits[p - 1 : p + n - 1], -1)  # (n, V): position t predicts token t + 1
    return logp.gather(1, ids[p:, None]).squeeze(1)


@pytest.mark.parametrize("packed", [False, True])
def test_policy_gradient_of_a_two_turn_sample_equals_the_hand_computed_one(
    tiny_dir: str, packed: bool
) -> None:
    model = load_causal_lm(tiny_dir, CPU)
    if packed:
        enable_packed_attention(model)
    batch = two_turn_batch()
    mask = batch["response_mask"].float()
    advantages = torch.randn(mask.shape, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        old = log_probs_of(model, batch, 1.0, False, CPU, packed=packed)[0]
    logp, _ = log_probs_of(model, batch, 1.0, False, CPU, packed=packed)
    loss, _ = ppo_loss(old, logp, advantages, mask)
    loss.backward()
    got = grads(model)

    # By hand: ratio = 1 at the old policy (no clipping), so the token-mean loss is
    # -Σ A_t·exp(logp_t - logp_t.detach()) / n over the policy's tokens only; tool tokens are inputs.
    model.zero_grad()
    terms = []
    for i, (_, m) in enumerate(SHAPES):
        lp = hand_log_probs(model, batch, i)  # (n_i,)
        keep = torch.tensor(m, dtype=torch.bool)
        terms.append(advantages[i, : len(m)][keep] * torch.exp(lp[keep] - lp[keep].detach()))
    expected_loss = -torch.cat(terms).sum() / mask.sum()
    expected_loss.backward()
    assert torch.allclose(loss.detach(), expected_loss.detach(), atol=TOL)
    want = grads(model)
    assert got.keys() == want.keys()
    for name in want:
        assert torch.allclose(got[name], want[name], atol=TOL, rtol=1e-4), name


def test_tool_tokens_change_the_log_probs_of_later_policy_tokens(tiny_dir: str) -> None:
    model = load_causal_lm(tiny_dir, CPU)
    a, b = two_turn_batch(tool_ids=[11, 12]), two_turn_batch(tool_ids=[900, 901, 902])
    with torch.no_grad():
        lp_a = log_probs_of(model, a, 1.0, False, CPU)[0]
        lp_b = log_probs_of(model, b, 1.0, False, CPU)[0]
    assert torch.equal(lp_a[:, :3], lp_b[:, :3])  # before the tool answer: the same
    assert not torch.allclose(lp_a[0, 8:10], lp_b[0, 8:10])  # after it: it was attended to
    assert torch.equal(lp_a[1], lp_b[1])  # the single-turn row has no tool answer


class EchoTokenizer:
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return " ".join(map(str, ids))


class FixedScores:
    def __init__(self, scores: list[float]) -> None:
        self.scores = scores
        self.lengths: list[int] = []

    def score(self, texts: list[str], *_: Any) -> RewardResult:
        self.lengths = [len(t.split()) for t in texts]
        return RewardResult(scores=self.scores)


def scored_two_turn_batch() -> Batch:
    batch = two_turn_batch()
    manager = FixedScores([1.0, 0.0, 0.5])
    scores, _ = score_batch(batch, EchoTokenizer(), manager)
    assert manager.lengths == [10, 4, 12]  # the reward sees the whole response, tool answers included
    batch["token_level_scores"] = scores
    batch["token_level_rewards"] = scores
    return batch


def test_reward_sits_on_the_last_response_token() -> None:
    scores = scored_two_turn_batch()["token_level_scores"]
    expected = torch.zeros(3, R)
    expected[0, 9], expected[2, 11] = 1.0, 0.5
    assert torch.equal(scores, expected)


def test_a_response_ending_in_masked_tokens_is_scored_on_the_policys_last_token() -> None:
    """An Interaction's last reply, cut at the budget, ends the response: the score goes on the last
    token the policy wrote, where GRPO's masked sum and GAE's recursion both see it."""
    items = [{"input_ids": [7, 8, 9]}] * 2
    ids = [[11, 12, 13, 14, 15, 16], [21, 22]]
    masks = [[1, 1, 1, 0, 0, 0], [1, 1]]  # the first ends in a masked reply
    batch = assemble_batch(items, ids, [[0.0] * len(t) for t in ids], [0, 1], 4, 8, 0, "u", loss_masks=masks)
    assert reward_positions(batch).tolist() == [2, 1]
    scores, _ = score_batch(batch, EchoTokenizer(), FixedScores([1.0, 0.0]))
    assert scores[0].tolist() == [0, 0, 1.0, 0, 0, 0, 0, 0]
    mask = batch["response_mask"].float()
    grpo, _ = compute_advantage(
        "grpo",
        token_level_rewards=scores,
        response_mask=mask,
        index=["a", "a"],
        norm_adv_by_std_in_grpo=False,
    )
    assert grpo[0, 0] == 0.5 and grpo[1, 0] == -0.5  # the reward counted: mean 0.5 of the group
    _, returns = compute_advantage(
        "gae",
        token_level_rewards=scores,
        response_mask=mask,
        values=torch.zeros_like(mask),
        gamma=1.0,
        lam=1.0,
    )
    assert returns[0, :3].tolist() == [1.0, 1.0, 1.0]
    batch["response_mask"][0] = 0  # a rejected row: no policy token left, the score on the last token
    assert reward_positions(batch).tolist() == [5, 1]


def test_grpo_and_gae_on_a_two_turn_batch() -> None:
    batch = scored_two_turn_batch()
    mask = batch["response_mask"].float()
    adv, _ = compute_advantage(
        "grpo",
        token_level_rewards=batch["token_level_rewards"],
        response_mask=mask,
        index=["a", "a", "b"],
        norm_adv_by_std_in_grpo=True,
    )
    s = torch.tensor([1.0, 0.0])  # group "a": mean 0.5, unbiased std sqrt(0.5)
    per_row = torch.tensor([*((s - 0.5) / (0.5**0.5 + 1e-6)), 0.5 / (1 + 1e-6)])  # a group of one
    assert torch.allclose(adv, per_row[:, None] * mask, atol=1e-6)

    # GAE with lam = 1: returns_t = gamma^(policy tokens after t) * score on the policy's tokens; the
    # tool answer is not a time step (its value and reward do not enter the recursion).
    gamma = 0.9
    values = torch.randn(mask.shape, generator=torch.Generator().manual_seed(3)) * mask
    adv, returns = compute_advantage(
        "gae",
        token_level_rewards=batch["token_level_rewards"],
        response_mask=mask,
        values=values,
        gamma=gamma,
        lam=1.0,
    )
    after = mask.flip(-1).cumsum(-1).flip(-1) - mask  # (B, R) policy tokens strictly after t
    score = batch["token_level_scores"].sum(-1, keepdim=True)
    expected_returns = gamma**after * score * mask
    assert torch.allclose(returns, expected_returns, atol=1e-6)
    assert torch.allclose(adv, masked_whiten(expected_returns - values, mask) * mask, atol=1e-5)


def test_response_length_metrics_count_every_response_token() -> None:
    batch = scored_two_turn_batch()
    mask = batch["response_mask"].float()
    batch["advantages"] = mask * 2.0
    batch["returns"] = mask * 3.0
    m = compute_data_metrics(batch, use_critic=False)
    # The attention-mask length (verl's): 10, 4, 12; the loss counts only 5, 4, 7 of them.
    assert m["response_length/mean"] == pytest.approx(26 / 3)
    assert (m["response_length/max"], m["response_length/min"]) == (12.0, 4.0)
    assert m["response_length/clip_ratio"] == pytest.approx(1 / 3)
    assert m["critic/advantages/mean"] == 2.0 and m["critic/advantages/min"] == 2.0
    assert (m["prompt_length/max"], m["prompt_length/min"]) == (6.0, 3.0)
