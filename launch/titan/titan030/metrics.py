"""The recipe's metrics processor on torchtitan 0.3.0: ``launch.titan.metrics.RecipeMetrics`` over
0.3.0's ``MetricsProcessor``, which the trainer builds from its config (``config.metrics.build``):
what the recipe adds travels in the config. torchtitan's own loggers stay off; the wandb run is
the recipe's (``RecipeWandBLogger``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from torchtitan.components.metrics import MetricsProcessor

from launch.titan.metrics import RecipeMetrics
from launch.titan.wandb_run import WandbSettings

__all__ = ["RecipeMetricsProcessor"]


class RecipeMetricsProcessor(RecipeMetrics, MetricsProcessor):
    """:class:`~launch.titan.metrics.RecipeMetrics` over torchtitan 0.3.0's ``MetricsProcessor``."""

    @dataclass(kw_only=True, slots=True)
    class Config(MetricsProcessor.Config):
        total_steps: int = 0
        a2a_name: str = "bf16"
        console_path: Optional[str] = None
        wandb: Optional[WandbSettings] = None
        # The wandb run's config but torchtitan's (the trainer hands that over as ``config_dict``).
        # A leading underscore keeps it out of the config's ``to_dict``: out of torchtitan's own.
        _wandb_config: dict[str, Any] = field(default_factory=dict)

    def __init__(self, config: Config, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        self.start_recipe_metrics(
            total_steps=config.total_steps, a2a_name=config.a2a_name, wandb_settings=config.wandb,
            wandb_config={**config._wandb_config, "torchtitan": kwargs.get("config_dict") or {}},
            console_path=config.console_path)
