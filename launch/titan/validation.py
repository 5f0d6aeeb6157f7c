"""Validation loss on the held-out split, inside torchtitan's training loop (0.2.2 and 0.3.0).

torchtitan's own ``Validator`` streams its dataloader on from wherever the previous call
stopped, so consecutive evaluations score different tokens, and it counts its tokens into the
training throughput. :class:`HeldOutLoss` instead scores the same batches every time
(``launch.titan.data.validation_batches``, built once), leaves the training metrics and the
MoE load-balancing counters as they were, and reports through
``RecipeMetricsProcessor.log_validation``. Where a symm or two_hop dispatch may run at an elastic
capacity (``trainer.checks_capacity``), each batch runs through a ``mxfp8_ep.elastic.ReplayGuard``:
a batch whose routing overflows the capacity runs again at the grown one (counted and logged
as the training steps' replays are), so no loss comes from cut rows.

The trainer calls ``should_validate(step)`` after every step (after the checkpoint save) and
``validate(model_parts, step)`` when it says yes: every ``training.val_every`` steps and at
the last step. A batch's loss is the trainer's (``RecipeTrainerMixin.held_out_loss``: each
torchtitan release runs its model and loss its own way).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torchtitan.components.loss import IGNORE_INDEX
from torchtitan.components.validate import BaseValidator

from launch.titan.data import validation_batches
from mxfp8_ep import elastic


class HeldOutLoss(BaseValidator):
    """Mean cross-entropy per token over a fixed set of validation batches.

    Args:
        trainer: the recipe's trainer being run (``launch.titan.recipe_trainer.RecipeTrainerMixin``:
            its ``held_out_loss``, device, parallel dims, tokenizer and recipe config).
        path: the validation split (``.jsonl`` / ``.jsonl.gz``).
        every: validate every this many steps (and at the last step).
        batches: validation batches per evaluation, of the training batch shape.
    """

    def __init__(self, trainer: Any, path: Path, every: int, batches: int) -> None:
        self.trainer = trainer
        self.every = every
        t = trainer.cfg.training
        self.last_step = int(t.steps)
        dims = trainer.parallel_dims
        if dims.dp_enabled:
            mesh = dims.get_mesh("batch")
            self.group = mesh.get_group()
            dp_rank, dp_degree = mesh.get_local_rank(), mesh.size()
        else:
            self.group, dp_rank, dp_degree = None, 0, 1
        self.batches = validation_batches(
            path, trainer.tokenizer, batches=batches, batch_size=int(t.local_batch_size),
            seq_len=int(t.seq_len), dp_rank=dp_rank, dp_degree=dp_degree)

    def should_validate(self, step: int) -> bool:
        return step % self.every == 0 or step == self.last_step

    @torch.no_grad()
    def validate(self, model_parts: list[torch.nn.Module], step: int) -> None:
        start = time.perf_counter()
        t = self.trainer
        (model,) = model_parts
        # The router's token counts feed the next optimizer step's expert-bias update:
        # validation tokens must not.
        counters = [(b, b.clone()) for name, b in model.named_buffers() if name.endswith("tokens_per_expert")]
        model.eval()
        totals = torch.zeros(2, dtype=torch.float64, device=t.device)  # loss sum, tokens
        try:
            for inputs, labels in self.batches:
                inputs, labels = inputs.to(t.device), labels.to(t.device)
                for _ in self._attempts(model):
                    loss = t.held_out_loss(model, inputs, labels)
                totals[0] += loss
                totals[1] += (labels != IGNORE_INDEX).sum()
        finally:
            model.train()
            for buffer, saved in counters:
                buffer.copy_(saved)
        if self.group is not None:
            dist.all_reduce(totals, group=self.group)
        loss = (totals[0] / totals[1]).item()
        t.metrics_processor.log_validation(loss, step, seconds=time.perf_counter() - start)

    def _attempts(self, model: torch.nn.Module):
        """One batch's forward passes: one, or through a ``ReplayGuard`` where a symm or two_hop
        dispatch may overflow (every rank validates alike, so every rank checks alike)."""
        t = self.trainer
        if not getattr(t, "checks_capacity", False):
            return range(1)

        def counted(overflow: elastic.Overflow) -> None:
            t.capacity_replays += 1
            t.capacity_spills += overflow.spill
            t.on_capacity_replay(overflow, what="validation batch")

        return elastic.ReplayGuard(model.modules(), owns_gradients=False, on_replay=counted).attempts()
