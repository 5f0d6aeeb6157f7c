"""Train an expert-parallel MoE with torchtitan, the all-to-all in bf16 or MXFP8.

    python launch/train.py                                  # tiny Llama4, 2 processes, bf16
    python launch/train.py a2a=mxfp8                        # same, tokens sent as MXFP8
    python launch/train.py --multirun a2a=bf16,mxfp8        # both, one after the other
    python launch/train.py --help                           # groups, options, examples

Config groups live in conf/ (see conf/train.yaml); recipes in recipes/. Everything that can be
checked is checked before any process starts (launch/validate.py); a run prints a header, one
line per log window and a summary (launch/console.py); Ctrl-C / SIGTERM stop it cleanly.
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path
from typing import Optional

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from launch import config_store  # noqa: F401  (registers the schemas and resolvers)
from launch import console
from launch.launcher import RunFailed, RunStopped, launcher_for
from launch.run_dir import RUN_CONFIG, earlier_logging
from launch.run_summary import RunSummary
from launch.validate import ConfigError, validate


def finalize(cfg: DictConfig, run_dir: str, override_dirname: str) -> DictConfig:
    """Fill the fields whose defaults depend on the rest of the config or the run dir."""
    OmegaConf.set_readonly(cfg, False)
    lg = cfg.logging
    if not lg.group:
        lg.group = cfg.experiment
    run_id, run_name = earlier_logging(run_dir)  # a resumed run keeps its wandb run
    lg.run_id = lg.run_id or run_id
    lg.run_name = lg.run_name or run_name
    if not lg.run_name:
        # Hydra's override_dirname leaves out launcher/logging keys (conf/train.yaml); the
        # a2a preset is always named so the runs of a comparison tell themselves apart.
        parts = [p for p in override_dirname.split(",") if p]
        if not any(p.lstrip("+").startswith("a2a=") for p in parts):
            parts.insert(0, f"a2a={cfg.a2a.name}")
        lg.run_name = ",".join(parts)
    return cfg


def run(cfg: DictConfig, run_dir: str, override_dirname: str) -> Optional[RunSummary]:
    console.route_logging(verbose=cfg.logging.verbose)
    cfg = finalize(cfg, run_dir, override_dirname)
    try:
        warnings = validate(cfg)
    except ConfigError as e:
        print(f"[mxfp8ep] {e}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    for w in warnings:
        console.warn(w)
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    (Path(run_dir) / RUN_CONFIG).write_text(OmegaConf.to_yaml(cfg, resolve=True))
    try:
        summary = launcher_for(cfg).launch(cfg, run_dir)
    except RunStopped as e:
        print(console.stop_line(e.signum, e.summary, run_dir), file=sys.stderr, flush=True)
        raise SystemExit(128 + e.signum) from None
    except RunFailed as e:
        print(f"[mxfp8ep] {e}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    if summary is not None:
        print(console.format_summary(summary), flush=True)
    return summary


@hydra.main(version_base="1.3", config_path="../conf", config_name="train")
def main(cfg: DictConfig) -> Optional[RunSummary]:
    hc = HydraConfig.get()
    return run(cfg, hc.runtime.output_dir, hc.job.override_dirname)


if __name__ == "__main__":
    sys.stdout.reconfigure(line_buffering=True)  # progress lines appear as they come
    try:
        main()
    except KeyboardInterrupt:  # Ctrl-C before a launcher took over (nothing was started)
        print("[mxfp8ep] interrupted (SIGINT) before anything was started", file=sys.stderr)
        raise SystemExit(128 + signal.SIGINT) from None
