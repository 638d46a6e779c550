"""Per-token log-probabilities and entropies of a response, from a causal LM's logits.

Memory is the concern: the LM head runs only on the positions that predict response tokens
(`logits_to_keep`), and the float32 softmax is taken over row chunks when no gradient is needed,
so the full (B, T, V) float32 tensor of a batch is never materialised.
"""

from __future__ import annotations

import torch
from torch import nn

from fulcrum.models.arch import spec_for
from fulcrum.models.packed import PACKED_ATTENTION

# Rows of (T, V) logits turned into float32 at once in no-grad mode (about 0.6 GB at V=152k, T=1024).
_NO_GRAD_ROW_CHUNK = 1


def logprob_and_entropy(
    logits: torch.Tensor,  # (B, T, V), any float dtype
    labels: torch.Tensor,  # (B, T) token ids
    temperature: float = 1.0,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(labels) and, optionally, the entropy of softmax(logits / temperature), both float32 (B, T).

    log p_t = z_t[y_t] - logsumexp(z_t),  H_t = logsumexp(z_t) - sum_v softmax(z_t)_v z_t,v,  z = logits / τ
    (verl's `logprobs_from_logits_v2` and `entropy_from_logits`); half-precision logits are computed in float32.
    Under `torch.no_grad` the float32 conversion is done a few rows at a time.
    """
    if torch.is_grad_enabled():
        return _logprob_and_entropy_dense(logits, labels, temperature, with_entropy)
    logps, ents = [], []
    for start in range(0, logits.shape[0], _NO_GRAD_ROW_CHUNK):
        sl = slice(start, start + _NO_GRAD_ROW_CHUNK)
        lp, ent = _logprob_and_entropy_dense(logits[sl], labels[sl], temperature, with_entropy)
        logps.append(lp)
        if ent is not None:
            ents.append(ent)
    return torch.cat(logps), (torch.cat(ents) if with_entropy else None)


def _logprob_and_entropy_dense(
    logits: torch.Tensor, labels: torch.Tensor, temperature: float, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    z = logits.float() / temperature  # (B, T, V)
    log_norm = torch.logsumexp(z, dim=-1)  # (B, T)
    logp = torch.gather(z, -1, labels.unsqueeze(-1)).squeeze(-1) - log_norm  # (B, T)
    entropy = None
    if with_entropy:
        probs = torch.softmax(z, dim=-1)
        entropy = log_norm - (probs * z).sum(-1)  # (B, T)
    return logp, entropy


def response_logits(
    model: nn.Module,
    input_ids: torch.Tensor,  # (B, P + R): left-padded prompt then right-padded response
    attention_mask: torch.Tensor,  # (B, P + R)
    position_ids: torch.Tensor,  # (B, P + R)
    response_length: int,
) -> torch.Tensor:
    """Logits at the positions that predict the R response tokens: (B, R, V).

    Position t predicts token t + 1, so the response's tokens are predicted by positions
    [-R-1, -1). Asking the model for only the last R + 1 positions skips the LM head on the prompt.
    A mixture of experts' own load-balancing loss is not asked for (`output_router_logits=False`):
    the actor computes it (`fulcrum.models.router_loss`), and Hugging Face's would read this
    function's 4-D mask as a 2-D one.
    """
    routers = {"output_router_logits": False} if hasattr(model.config, "output_router_logits") else {}
    out = model(
        input_ids=input_ids,
        attention_mask=no_empty_rows_mask(model, attention_mask),
        position_ids=position_ids,
        use_cache=False,
        logits_to_keep=response_length + 1,
        **routers,
    )
    return out.logits[:, :-1, :]  # (B, R, V)


def trim_padding(
    input_ids: torch.Tensor,  # (B, P + R)
    attention_mask: torch.Tensor,  # (B, P + R)
    position_ids: torch.Tensor,  # (B, P + R)
    prompt_length: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Drop the columns that are padding in every row: left of the prompts and right of the responses.

    Returns the trimmed (input_ids, attention_mask, position_ids) and the kept response length R'.
    Each micro-batch then costs what its longest sequence costs, not the batch-wide maximum; the
    caller pads the (B, R') results back to R with zeros (those positions are masked out anyway).
    """
    valid_cols = attention_mask.bool().any(dim=0)  # (P + R,)
    prompt_cols = valid_cols[:prompt_length]
    response_cols = valid_cols[prompt_length:]
    first = int(prompt_cols.nonzero()[0].item()) if prompt_cols.any() else prompt_length
    # Keep at least one response column so the shapes stay valid for an all-empty micro-batch.
    kept_response = int(response_cols.nonzero()[-1].item()) + 1 if response_cols.any() else 1
    end = prompt_length + kept_response
    return (
        input_ids[:, first:end],
        attention_mask[:, first:end],
        position_ids[:, first:end],
        kept_response,
    )


def no_empty_rows_mask(
    model: nn.Module, attention_mask: torch.Tensor
) -> torch.Tensor | dict[str, torch.Tensor]:
    """For SDPA: a (B, 1, T, T) boolean causal mask in which every left-padding query attends to itself.

    With left padding, the query rows of pad tokens are fully masked (causal and padding leave them
    nothing to attend to). Softmax over an empty row is 0/0, and SDPA's fused backward kernels can turn
    that into NaN gradients that poison the whole batch, although those rows never reach the loss
    (pytorch#41508, #103749). Letting each pad query see its own key changes nothing for real tokens
    (they still never attend to pads) and leaves no row empty. A family whose every layer slides a
    window (Mistral, `fulcrum.models.arch`) gets it here, as Hugging Face's own mask would have it:
    query i sees key j when i - window < j (real tokens are contiguous in a row, so column distance
    is position distance). A config whose layers differ (Gemma 3's local and global layers, Qwen2's
    sliding ones) gets one such mask per layer type, the dict its Hugging Face model takes; a hybrid one
    (Qwen3.5) gives its linear-attention layers the 2-D padding mask. Other attention implementations
    (eager, flash) get the 2-D mask unchanged.
    """
    if getattr(getattr(model, "config", None), "_attn_implementation", None) not in (
        "sdpa",
        PACKED_ATTENTION,
    ):
        return attention_mask
    spec = spec_for(model.config)
    if spec is not None and any(spec.linear_layers(model.config)):
        # Linear-attention layers take the 2-D padding mask: they zero the pad tokens' inputs, so that a
        # left-padded row's recurrent state starts at its first real token.
        return {"full_attention": _self_seeing_mask(attention_mask, None), "linear_attention": attention_mask}
    windows = spec.layer_windows(model.config) if spec is not None else [None]
    if spec is not None and spec.windows_by_layer_type is not None and len(set(windows)) > 1:
        by_type = spec.windows_by_layer_type(model.config)
        return {kind: _self_seeing_mask(attention_mask, window) for kind, window in by_type.items()}
    return _self_seeing_mask(attention_mask, windows[0])


def _self_seeing_mask(attention_mask: torch.Tensor, window: int | None) -> torch.Tensor:
    """`no_empty_rows_mask`'s (B, 1, T, T) mask for one window (None: full causal attention)."""
    length = attention_mask.shape[1]
    real = attention_mask.bool()  # (B, T)
    causal = torch.ones(length, length, dtype=torch.bool, device=real.device).tril()  # (T, T)
    if window is not None and window < length:
        causal = causal.triu(1 - int(window))  # (T, T): only the window latest keys
    mask = causal[None] & real[:, None, :]  # (B, T_q, T_k): causal and key is a real token
    mask |= torch.eye(length, dtype=torch.bool, device=real.device)[None]  # every query sees itself
    return mask[:, None]  # (B, 1, T, T)


def sum_pi_squared(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """sum_v softmax(logits / temperature)_v^2 per position: (B, T, V) -> (B, T) float32, in row chunks.

    The optimal-token-baseline estimator's path-variance proxy reads it (actor.calculate_sum_pi_squared).
    """
    out = []
    for start in range(0, logits.shape[0], _NO_GRAD_ROW_CHUNK):
        probs = torch.softmax(logits[start : start + _NO_GRAD_ROW_CHUNK].float() / temperature, dim=-1)
        out.append(probs.square().sum(-1))
    return torch.cat(out)
