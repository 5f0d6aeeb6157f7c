"""The recipe's trainer on torchtitan 0.3.0, and what a worker process of a 0.3.0 run sets up
(``launch.titan.runner`` calls this module's :func:`prepare_process`, :func:`install_dispatcher`,
:func:`build_job_config` and :class:`RecipeTrainer`).

0.3.0's ``Trainer`` builds its components from its config (``launch.titan.titan030.job_config``):
the metrics processor is the recipe's through ``config.metrics``, the parallelize function
through the ``ModelSpec``. The EP exchange is the library's override in ``override.imports``,
which also makes torchtitan's ``Trainer`` run an overflowed step again where a symm dispatch may
run at an elastic capacity (``mxfp8_ep.elastic.install_replays``, the same as on a plain
torchtitan run); this trainer counts and logs those replays (``RecipeTrainerMixin``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig
from torchtitan.trainer import Trainer

from launch.titan.a2a import a2a_config
from launch.titan.recipe_trainer import RecipeTrainerMixin
from launch.titan.titan030.job_config import build_job_config

__all__ = ["RecipeTrainer", "build_job_config", "install_dispatcher", "prepare_process"]


def prepare_process(cpu: bool) -> None:
    """torch < 2.15's gaps for 0.3.0 (``torch_compat``), its CPU gaps (``cpu``), the recipe's datasets."""
    from launch.titan.data import register_datasets
    from launch.titan.titan030.cpu_compat import apply_cpu_compat
    from launch.titan.titan030.torch_compat import apply_torch_compat

    apply_torch_compat()
    if cpu:
        apply_cpu_compat()
    register_datasets()


def install_dispatcher(cfg: DictConfig) -> Any:
    """The run's ``A2AConfig``: on 0.3.0 nothing is installed globally; the job config's
    override puts the dispatcher on the model (``job_config.dispatcher_override``)."""
    return a2a_config(cfg)


class RecipeTrainer(RecipeTrainerMixin, Trainer):
    """torchtitan 0.3.0's ``Trainer`` with the recipe's behaviour (``RecipeTrainerMixin``) and
    held-out loss (``launch.titan.validation.HeldOutLoss``, built here: it needs the trainer,
    which 0.3.0's validator config cannot hand it)."""

    def __init__(self, config: Any, cfg: DictConfig, run_dir: str, stop: Any) -> None:
        from launch.titan.data import data_source
        from launch.titan.titan030.models import attention_of
        from launch.titan.validation import HeldOutLoss

        # sdpa models attend causally over the packed sequence: the per-document positions the
        # data loader adds (for flex's document masks) are left out, RoPE counts 0..seq_len-1.
        self._packed_positions = attention_of(config.model_spec.model) == "sdpa"
        super().__init__(config, cfg, run_dir, stop)
        t = cfg.training
        if int(t.val_every) > 0:
            validation = data_source(t.dataset, t.dataset_path, t.tokenizer_path).validation
            self.validator = HeldOutLoss(self, Path(validation), every=int(t.val_every), batches=int(t.val_batches))
            self.config.validator.enable = True  # the loop asks the config whether to validate

    @property
    def checkpoint_config(self) -> Any:
        return self.config.checkpoint

    def post_dataloading_process(self, input_dict: dict[str, torch.Tensor], labels: torch.Tensor) -> Any:
        if self._packed_positions:
            input_dict = {k: v for k, v in input_dict.items() if k != "positions"}
        return super().post_dataloading_process(input_dict, labels)

    def held_out_loss(self, model: torch.nn.Module, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        seen = self.ntokens_seen  # post_dataloading_process counts the training's tokens
        inputs, labels, extra_kwargs = self.post_dataloading_process({"input": inputs}, labels)
        self.ntokens_seen = seen
        with self.train_context():
            pred = model(inputs, **extra_kwargs)
            loss, _ = self.loss_fn(pred, labels)  # without global_valid_tokens: the sum
        return loss.double()
