"""The critic worker: HF backbone + scalar value head, `compute_values` and the clipped value update.

Its sizes (`critic.ppo_mini_batch_size`, `ppo_micro_batch_size_per_gpu`, `forward_micro_batch_size_per_gpu`,
`ppo_epochs`, token budgets) are independent of the actor's; null ones follow the actor as in verl,
resolved in its `CriticSection` (fulcrum.config.sections).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch

from fulcrum.algo.losses import compute_value_loss
from fulcrum.batch import Batch, host_to_device
from fulcrum.config.sections import CriticSection
from fulcrum.models.load import load_backbone
from fulcrum.models.value_head import CriticModel
from fulcrum.parallel import rank_rows, reduce_metrics
from fulcrum.workers.actor import global_agg_kwargs, mean_metrics
from fulcrum.workers.micro_batch import restore_order
from fulcrum.workers.optim import build_lr_scheduler, build_optimizer, clip_and_step
from fulcrum.workers.placement import place_on_ranks
from fulcrum.workers.runner import ModelRunner


class CriticWorker:
    def __init__(
        self, section: CriticSection, device: torch.device, total_training_steps: int, tokenizer: Any = None
    ) -> None:
        c = section.critic
        self.cfg = c
        self.device = device
        self.tokenizer = tokenizer
        self.model = CriticModel(load_backbone(c.model.path, device, key="critic.model.path"))
        if c.model.enable_gradient_checkpointing:
            self.model.gradient_checkpointing_enable({"use_reentrant": False})
        self.model.train()
        self.placement = place_on_ranks(  # sharded: the value head a float32 unit of its own
            self.model, device, c.model.fsdp_config, "critic.model", keep_fp32=("score",)
        )
        # The value head stays float32 (keep): values are not rounded to bf16.
        self.runner = ModelRunner(
            self.model,
            device,
            bool(c.model.use_remove_padding),
            "critic",
            keep=("score",),
            use_torch_compile=section.use_torch_compile,
        )
        self.optimizer = build_optimizer(self.model.parameters(), c.optim, device)
        self.lr_scheduler = build_lr_scheduler(self.optimizer, c.optim, total_training_steps, "critic.optim")
        self.mini_batch_size = section.mini_batch_size
        self.micro_batch_size = section.micro_batch_size
        self.values_sizes = section.values
        self.use_dynamic_bsz = bool(c.use_dynamic_bsz)
        assert c.ppo_epochs is not None and c.loss_agg_mode is not None, "a resolved configuration"
        self.ppo_epochs = c.ppo_epochs
        self.loss_agg_mode = c.loss_agg_mode
        self.shuffle_seed = section.seed

    def compute_values(self, batch: Batch) -> torch.Tensor:
        """V(s_t) for every response position (B, R), float32 on the CPU, zero outside the response mask."""
        sizes = self.values_sizes
        micro, order = self.runner.micro_batches(
            batch,
            sizes.micro_batch_size,
            sizes.use_dynamic_bsz,
            sizes.max_token_len,
            sizes.key,
            sort_by_length=True,
        )
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad(), self.runner.active():
                parts = [self.runner.values(mb) for mb in micro]
        finally:
            self.model.train(was_training)
        return restore_order(parts, order).cpu()

    def update_critic(self, batch: Batch, global_step: int = 0) -> dict[str, float]:
        """ppo_epochs × shuffled mini-batches × micro-batches of the clipped value loss (needs values, returns).

        Each micro-batch's loss is its share of the mini-batch loss (global-token normalisation, as the actor).
        """
        c = self.cfg
        self.model.train()
        metrics: dict[str, list[torch.Tensor | float]] = defaultdict(list)
        generator = torch.Generator().manual_seed(self.shuffle_seed * 1_000_003 + global_step)
        for _ in range(self.ppo_epochs):
            order = torch.randperm(len(batch), generator=generator)
            for mini in batch.select(order).split(self.mini_batch_size):
                agg = global_agg_kwargs(mini["response_mask"])  # the whole mini-batch's counts
                micro, _ = self.runner.micro_batches(
                    mini.select(rank_rows(len(mini))),  # this rank's share (all of it in one process)
                    self.micro_batch_size,
                    self.use_dynamic_bsz,
                    c.ppo_max_token_len_per_gpu,
                    "critic.ppo_micro_batch_size_per_gpu",
                )
                self.optimizer.zero_grad(set_to_none=True)
                loss_shares: list[torch.Tensor] = []
                with self.runner.active():
                    for mb in micro:
                        mask = host_to_device(mb["response_mask"], self.device).float()
                        vpreds = self.runner.values(mb, mask)
                        vf_loss, vf_clipfrac = compute_value_loss(
                            vpreds=vpreds,
                            values=host_to_device(mb["values"], self.device),
                            returns=host_to_device(mb["returns"], self.device),
                            response_mask=mask,
                            cliprange_value=float(c.cliprange_value),
                            loss_agg_mode=self.loss_agg_mode,
                            **agg,
                        )
                        vf_loss.backward()
                        self.runner.accumulate_grads()
                        loss_shares.append(vf_loss.detach())
                        metrics["critic/vf_clipfrac"].append(vf_clipfrac)
                        metrics["critic/vpred_mean"].append(
                            (vpreds.detach() * mask).sum() / mask.sum().clamp(min=1)
                        )
                metrics["critic/vf_loss"].append(torch.stack(loss_shares).sum())
                metrics["critic/grad_norm"].append(
                    clip_and_step(self.model, self.optimizer, float(c.grad_clip), "critic", self.placement)
                )
        metrics["critic/lr"].append(self.lr_scheduler.get_last_lr()[0])
        self.lr_scheduler.step()
        return reduce_metrics(mean_metrics(metrics), sums=frozenset({"critic/vf_loss"}))
