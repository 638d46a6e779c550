"""The mixture-of-experts router's load-balancing loss, as a training term of the actor.

Hugging Face's MoE causal LMs (Qwen3-MoE, Mixtral, ...) add `router_aux_loss_coef` ·
`load_balancing_loss_func(router_logits)` to their language-model loss when their config's
`output_router_logits` is true. verl's FSDP actor never passes labels nor that switch, so it adds
nothing and reports nothing; its Megatron backend takes `moe_aux_loss_coeff` from the same
`router_aux_loss_coef` and switches the loss off by default (`moe_router_load_balancing_type="none"`,
"it hurts perf in RL"), and Megatron-LM logs the loss, divided by its coefficient, as
`load_balancing_loss`. fulcrum follows: off unless the model's config has `output_router_logits`
true; then the actor adds coef · loss to its policy loss and reports the loss alone as
`actor/load_balancing_loss` (and `actor/load_balancing_coef`).

The router logits are read by forward hooks on the routers (`mlp.gate` of the expert layers), so the
packed path, which runs the decoder layers itself, and the padded one see the same thing.

Under Ulysses sequence parallelism (`fulcrum.parallel.ulysses`) each rank's routers see only its slice
of the micro-batch's stream, padded at the stream's end. The loss is not a sum over tokens (Σ_e f_e · P_e
of a slice is not the stream's), so it is not formed per slice: each rank sums its real tokens' per-expert
statistics (top-k picks, softmax probabilities, row count), the sums are added up over the group
(`sum_over_group`: all-reduce forward, identity backward) and every rank forms the same whole-micro-batch
loss from them, reports it, and back-propagates only through its own tokens' probabilities; the group's
gradients then add up to that loss's, as without SP. The stream's pad tokens do not count.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from fulcrum.parallel.ulysses import SequenceParallel, sum_over_group


def load_balancing_loss(
    router_logits: Sequence[torch.Tensor],
    top_k: int,
    token_mask: torch.Tensor | None = None,
    sp: SequenceParallel | None = None,
) -> torch.Tensor:
    """Switch Transformer's auxiliary loss over all expert layers, as Hugging Face's
    `load_balancing_loss_func`: E · Σ_e f_e · P_e, where over the (layer, token) rows that count
    f_e = mean number of a row's top-k experts that are e and P_e = mean softmax probability of e.

    router_logits: one (N, E) tensor per expert layer; token_mask: (N,) 1 = a real token (None: all
    count). Equals top_k when routing is uniform, up to E · top_k when every token picks the same
    experts. Returns a float32 scalar; gradients reach the routers through P_e.

    sp: the sequence-parallel group whose ranks each hold a slice of the stream (router_logits and
    token_mask this rank's): the sums behind f_e and P_e are taken over the whole group's rows, so every
    rank returns the whole stream's loss; its gradient reaches only this rank's routers' rows.
    """
    mask = None if token_mask is None else token_mask.reshape(-1).float()
    experts = router_logits[0].shape[-1]
    counts = torch.zeros(experts, dtype=torch.float32, device=router_logits[0].device)
    probs = torch.zeros_like(counts)
    rows = counts.new_zeros(())
    for logits in router_logits:
        p = torch.softmax(logits.float(), dim=-1)  # (N, E)
        picked = torch.zeros_like(p).scatter_(1, torch.topk(p, top_k, dim=-1).indices, 1.0)  # (N, E)
        weight = torch.ones_like(p[:, 0]) if mask is None else mask.to(p.device)  # (N,)
        counts = counts + (picked * weight[:, None]).sum(0)
        probs = probs + (p * weight[:, None]).sum(0)
        rows = rows + weight.sum()
    if sp is not None:  # one all-reduce of the group's [counts, probs, rows]
        counts, probs, rows = sum_over_group(torch.cat([counts, probs, rows[None]]), sp).split(
            [experts, experts, 1]
        )
    return experts * ((counts / rows) * (probs / rows)).sum()


def routers_of(model: nn.Module) -> list[nn.Module]:
    """The router modules of a Hugging Face MoE decoder: `mlp.gate` of each layer whose MLP has experts."""
    base = getattr(model, "model", model)
    layers = getattr(base, "layers", [])
    return [layer.mlp.gate for layer in layers if hasattr(getattr(layer, "mlp", None), "experts")]


def router_loss_settings(model: nn.Module) -> tuple[float, int] | None:
    """(router_aux_loss_coef, num_experts_per_tok) when the model's config switches the loss on
    (`output_router_logits`) and it has routers; None otherwise."""
    config = getattr(model, "config", None)
    if not getattr(config, "output_router_logits", False) or not routers_of(model):
        return None
    return float(getattr(config, "router_aux_loss_coef", 0.0)), int(config.num_experts_per_tok)


@contextmanager
def recorded_router_logits(model: nn.Module) -> Iterator[list[torch.Tensor]]:
    """Inside the block, every router call appends its logits (N, E) to the yielded list."""
    logits: list[torch.Tensor] = []

    def keep(_module: nn.Module, _inputs: Any, output: Any) -> None:
        logits.append(output[0] if isinstance(output, tuple) else output)

    handles = [router.register_forward_hook(keep) for router in routers_of(model)]
    try:
        yield logits
    finally:
        for handle in handles:
            handle.remove()
