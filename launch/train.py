"""Train an expert-parallel MoE with torchtitan, the all-to-all in bf16 or MXFP8.

    python launch/train.py                                  # tiny Llama4, 2 processes, bf16
    python launch/train.py a2a=mxfp8                        # same, tokens sent as MXFP8
    python launch/train.py --multirun a2a=bf16,mxfp8        # both, one after the other
    python launch/train.py --multirun +recipe=llama4_ep8_bf16_vs_mxfp8   # a named sweep
    python launch/train.py launcher=slurm parallelism=2nodes_8gpus model=dsv3_16b \
        launcher.partition=gpu                              # submit to SLURM
    python launch/train.py --cfg job                        # print the composed config

Config groups live in conf/ (see conf/train.yaml); recipes in recipes/.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any, Optional

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

import launch.config_store  # noqa: F401  (registers the schemas)
from launch.summary import format_summary, write_summary
from launch.sweep_check import check_sweep_once
from launch.validate import ConfigError, launcher_kind, validate

log = logging.getLogger("mxfp8ep.train")

# Overrides that say where/how a run is launched or logged, not what it trains: left out of
# the default wandb run name.
_NAME_SKIP_PREFIXES = ("hydra", "launcher", "logging", "+recipe", "recipe")


def default_run_name(cfg: Any, task_overrides: list[str]) -> str:
    """``a2a=mxfp8,model=dsv3_16b``-style name from the command-line overrides; always
    includes the a2a preset so runs of a comparison tell themselves apart."""
    parts = sorted(
        o.lstrip("+~") for o in task_overrides
        if not o.lstrip("+~").split("=", 1)[0].split(".", 1)[0].startswith(_NAME_SKIP_PREFIXES)
    )
    if not any(p.startswith("a2a=") for p in parts):
        parts.insert(0, f"a2a={cfg.a2a.name}")
    return ",".join(parts)


def finalize(cfg: DictConfig, task_overrides: list[str]) -> DictConfig:
    """Fill the fields whose defaults depend on the rest of the config."""
    OmegaConf.set_readonly(cfg, False)
    if not cfg.logging.group:
        cfg.logging.group = cfg.experiment
    if not cfg.logging.run_name:
        cfg.logging.run_name = default_run_name(cfg, task_overrides)
    return cfg


def launch_run(cfg: DictConfig, run_dir: str, task_overrides: list[str],
               hydra_cfg: Any = None) -> Optional[dict]:
    cfg = finalize(cfg, task_overrides)
    try:
        if hydra_cfg is not None:
            check_sweep_once(hydra_cfg)  # --multirun: every point, before the first job runs
        warnings = validate(cfg)
    except ConfigError as e:
        print(f"[mxfp8ep] {e}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    for w in warnings:
        log.warning(w)
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    (Path(run_dir) / "train_config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))

    if launcher_kind(cfg) == "slurm":
        from launch.slurm import submit

        sub = submit(cfg, run_dir)
        if sub.result is not None or sub.state is not None:
            _report(cfg, run_dir, sub.result, extra={"slurm_job_id": sub.job_id,
                                                      "slurm_state": sub.state,
                                                      "slurm_log": sub.log_path})
        return {"slurm_job_id": sub.job_id, "slurm_log": sub.log_path, "state": sub.state,
                "result": sub.result}

    from launch.local import run_local

    result = run_local(cfg, run_dir)
    return _report(cfg, run_dir, result)


def _report(cfg: Any, run_dir: str, result: Optional[dict], extra: Optional[dict] = None) -> dict:
    summary = write_summary(cfg, run_dir, result, extra or {})
    print(format_summary(summary), flush=True)
    return summary


@hydra.main(version_base="1.3", config_path="../conf", config_name="train")
def main(cfg: DictConfig) -> Optional[dict]:
    hc = HydraConfig.get()
    return launch_run(cfg, hc.runtime.output_dir, list(hc.overrides.task), hc)


if __name__ == "__main__":
    main()
