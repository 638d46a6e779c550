"""The actor's loss: a list of terms built once from its keys, added up on each micro-batch.

    loss = pg_loss − entropy_coeff · H + kl_loss_coef · KL(π ‖ π_ref) + router_aux_loss_coef · share · LB

each aggregated by actor.loss_agg_mode over the mini-batch's counts (`agg_loss`), so the micro-batch
losses add up to the mini-batch's; a term is in the list only when its key switches it on. pg_loss is the
registered policy loss actor.policy_loss.loss_mode (`fulcrum.algo.policy_losses`), or "bypass_mode"
when rollout correction's bypass mode is on (as verl switches it); LB is a mixture of experts'
load-balancing loss when its config sets output_router_logits (`fulcrum.models.router_loss`), weighted by
the micro-batch's share of the mini-batch's response tokens. A term reads the micro-batch's forward
(`PolicyForward`) and gives its part of the loss and its detached metrics.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from fulcrum.algo.kl import kl_penalty
from fulcrum.algo.losses import agg_loss
from fulcrum.algo.policy_losses import LossConfig, get_policy_loss_fn, import_policy_losses
from fulcrum.algo.rollout_correction import RolloutCorrection
from fulcrum.config.schema import ActorConfig
from fulcrum.models.router_loss import load_balancing_loss, recorded_router_logits, router_loss_settings
from fulcrum.workers.forwards import ModelForwards
from fulcrum.workers.micro_batch import MicroInputs
from fulcrum.workers.update import Metrics


@dataclass
class PolicyForward:
    """What the loss terms read of one micro-batch: its inputs, the current policy's log-probs (and
    entropies when a term needs them), its response mask as float, the routers' logits (a mixture of
    experts'), and whether the old log-probs are the forward's own, detached (`ratio_one`)."""

    inputs: MicroInputs
    log_prob: torch.Tensor
    entropy: torch.Tensor | None
    mask: torch.Tensor
    router_logits: list[torch.Tensor]
    ratio_one: bool


Term = Callable[[PolicyForward], tuple[torch.Tensor, Metrics]]


def policy_term(cfg: ActorConfig, bypass: RolloutCorrection | None) -> Term:
    """pg_loss: the registered policy loss on (old log-probs, log-probs, advantages). A loss reports what it
    defines; one that clips nothing reports no clip fractions, which are then 0."""
    import_policy_losses(cfg.policy_loss.path)
    loss_fn = get_policy_loss_fn("bypass_mode" if bypass is not None else cfg.policy_loss.loss_mode)

    def policy(f: PolicyForward) -> tuple[torch.Tensor, Metrics]:
        rows = f.inputs.rows
        old = f.log_prob.detach() if f.ratio_one else rows["old_log_probs"]
        config = LossConfig.of(cfg, f.inputs.agg, bypass)  # type: ignore[arg-type]
        loss, metrics = loss_fn(
            old,
            f.log_prob,
            rows["advantages"],
            f.mask,
            cfg.loss_agg_mode,
            config,
            rows.get("rollout_is_weights"),
        )
        return loss, {
            "actor/pg_loss": loss.detach(),
            "actor/pg_clipfrac": 0.0,
            "actor/pg_clipfrac_lower": 0.0,
            **metrics,
        }

    return policy


def entropy_term(cfg: ActorConfig) -> Term:
    """−entropy_coeff · H, the entropy aggregated as the loss."""

    def entropy(f: PolicyForward) -> tuple[torch.Tensor, Metrics]:
        assert f.entropy is not None
        return -(
            float(cfg.entropy_coeff) * agg_loss(f.entropy, f.mask, cfg.loss_agg_mode, **f.inputs.agg)
        ), {}

    return entropy


def kl_term(cfg: ActorConfig) -> Term:
    """kl_loss_coef · KL(π ‖ π_ref) of kl_loss_type, aggregated as the loss."""

    def kl(f: PolicyForward) -> tuple[torch.Tensor, Metrics]:
        kld = kl_penalty(f.log_prob, f.inputs.rows["ref_log_prob"], cfg.kl_loss_type)
        kl_loss = agg_loss(kld, f.mask, cfg.loss_agg_mode, **f.inputs.agg)
        return float(cfg.kl_loss_coef) * kl_loss, {
            "actor/kl_loss": kl_loss.detach(),
            "actor/kl_coef": float(cfg.kl_loss_coef),
        }

    return kl


def router_term(forwards: ModelForwards, coef: float, top_k: int) -> Term:
    """coef · share · LB: this micro-batch's share of the mini-batch by response tokens, as the policy
    loss's; with sequence parallelism LB is the whole stream's (`load_balancing_loss`)."""

    def router(f: PolicyForward) -> tuple[torch.Tensor, Metrics]:
        balance = load_balancing_loss(f.router_logits, top_k, forwards.token_mask(f.inputs), forwards.sp)
        share = f.inputs.rows["response_mask"].sum() / f.inputs.agg.get("batch_num_tokens", 1.0)
        return coef * share * balance, {
            "actor/load_balancing_loss": balance.detach(),
            "actor/load_balancing_coef": coef,
        }

    return router


class ActorLoss:
    """The actor's terms (policy, entropy, KL, router), in that order, built once."""

    def __init__(self, cfg: ActorConfig, forwards: ModelForwards, bypass: RolloutCorrection | None) -> None:
        self.terms = [policy_term(cfg, bypass)]
        self.entropy = float(cfg.entropy_coeff) != 0.0
        if self.entropy:
            self.terms.append(entropy_term(cfg))
        self.kl = bool(cfg.use_kl_loss)
        if self.kl:
            self.terms.append(kl_term(cfg))
        self.model = forwards.model
        self.router = router_loss_settings(forwards.model)
        if self.router is not None:
            self.terms.append(router_term(forwards, *self.router))

    def keys(self, ratio_one: bool, weighted: bool) -> list[str]:
        """The batch's (B, R) columns the terms read (`weighted`: the batch has rollout_is_weights)."""
        keys = ["response_mask", "advantages"] + ([] if ratio_one else ["old_log_probs"])
        return keys + (["ref_log_prob"] if self.kl else []) + (["rollout_is_weights"] if weighted else [])

    @contextlib.contextmanager
    def routed(self) -> Iterator[list[torch.Tensor]]:
        """Around the forward: the routers' logits recorded when the router term reads them."""
        with (
            contextlib.nullcontext([])
            if self.router is None
            else recorded_router_logits(self.model) as logits
        ):
            yield logits

    def __call__(self, f: PolicyForward) -> tuple[torch.Tensor, Metrics]:
        loss, metrics = self.terms[0](f)
        for term in self.terms[1:]:
            part, more = term(f)
            loss = loss + part
            metrics.update(more)
        return loss, metrics
