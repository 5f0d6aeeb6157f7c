"""A run's headline numbers, from the trainer's return value and/or its offline wandb run.

Written to ``<run dir>/summary.json`` at the end of every local run (and waited-for SLURM
run); ``launch/compare_runs.py`` reads those files, or the wandb runs directly.
"""

from __future__ import annotations

import json
import math
import os
import re
from typing import Any, Optional

from launch.wandb_offline import OfflineRun, find_runs, read_run

SUMMARY_FILE = "summary.json"

# Canonical metric -> names it may have in run_training's result dict / in the wandb history
# (torchtitan's MetricsProcessor names first).
RESULT_KEYS = {
    "final_loss": ("final_loss", "loss"),
    "tokens_per_s": ("tokens_per_sec", "tokens_per_s", "tps"),
    "tokens_per_s_global": ("tokens_per_sec_global", "tokens_per_s_global"),
    "step_time_s": ("step_time_s", "avg_step_time_s", "time_per_step_s"),
    "a2a_bytes_per_step": ("a2a_bytes_per_step", "bytes_per_step", "wire_bytes_per_step"),
    "steps": ("steps", "step", "final_step"),
}
HISTORY_KEYS = {
    "final_loss": ("loss_metrics/global_avg_loss", "loss", "train/loss"),
    "tokens_per_s": ("throughput(tps)", "tokens_per_s", "tps"),
    "tokens_per_s_global": ("throughput/global_tps",),
    "step_time_s": ("time_metrics/end_to_end(s)", "step_time_s"),
    "a2a_bytes_per_step": ("a2a/bytes_per_step", "a2a_bytes_per_step", "a2a/bytes_total"),
}
# Last resort for the bytes metric, whatever the trainer called it.
_BYTES_PATTERN = re.compile(r"(a2a|wire).*bytes.*(total|per_step)$|bytes.*(a2a|wire).*total$")


def _finite(x: Any) -> Optional[float]:
    try:
        x = float(x)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


def _steady_mean(values: list[Any]) -> Optional[float]:
    """Mean without the first step (compilation, allocator and wandb warmup)."""
    vals = [v for v in (_finite(x) for x in values) if v is not None]
    if len(vals) > 1:
        vals = vals[1:]
    return sum(vals) / len(vals) if vals else None


def metrics_from_history(run: OfflineRun) -> dict[str, Any]:
    out: dict[str, Any] = {}
    keys = set().union(*(row.keys() for row in run.history)) if run.history else set()
    loss_key = next((k for k in HISTORY_KEYS["final_loss"] if k in keys), None)
    if loss_key:
        losses = [_finite(v) for v in run.series(loss_key)]
        out["final_loss"] = losses[-1] if losses else None
        out["first_loss"] = losses[0] if losses else None
        out["loss_series"] = losses
    for name in ("tokens_per_s", "tokens_per_s_global", "step_time_s", "a2a_bytes_per_step"):
        key = next((k for k in HISTORY_KEYS[name] if k in keys), None)
        if key is None and name == "a2a_bytes_per_step":
            key = next((k for k in sorted(keys) if _BYTES_PATTERN.search(k)), None)
        if key is not None:
            out[name] = _steady_mean(run.series(key))
    steps = run.series("_step")
    if steps:
        out["steps"] = int(max(steps))
    return out


def metrics_from_result(result: Optional[dict]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if not isinstance(result, dict):
        return out
    for name, candidates in RESULT_KEYS.items():
        for key in candidates:
            if key in result and result[key] is not None:
                out[name] = result[key] if name == "steps" else _finite(result[key])
                break
    return out


def collect_metrics(result: Optional[dict], wandb_dirs: list[str]) -> dict[str, Any]:
    """The trainer's own numbers win; the (last) wandb run fills what they lack."""
    merged: dict[str, Any] = {}
    if wandb_dirs:
        try:
            merged.update(metrics_from_history(read_run(wandb_dirs[-1])))
        except (OSError, ValueError) as e:
            merged["wandb_read_error"] = repr(e)
    merged.update({k: v for k, v in metrics_from_result(result).items() if v is not None})
    return merged


def find_wandb_runs(run_dir: str) -> list[str]:
    return find_runs(run_dir)


def _json_safe(x: Any) -> Any:
    try:
        json.dumps(x)
        return x
    except TypeError:
        if isinstance(x, dict):
            return {str(k): _json_safe(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [_json_safe(v) for v in x]
        if hasattr(x, "item"):
            try:
                return x.item()
            except Exception:  # noqa: BLE001
                pass
        return repr(x)


def build_summary(cfg: Any, run_dir: str, result: Optional[dict], extra: dict) -> dict[str, Any]:
    wandb_dirs = find_wandb_runs(run_dir)
    p = cfg.parallelism
    return {
        "run_name": cfg.logging.run_name,
        "experiment": cfg.experiment,
        "group": cfg.logging.group,
        "a2a": cfg.a2a.name,
        "a2a_legs": {leg: cfg.a2a[leg] for leg in
                     ("dispatch_fwd", "dispatch_bwd", "combine_fwd", "combine_bwd")},
        "model": cfg.model.name,
        "model_family": cfg.model.family,
        "model_flavor": cfg.model.flavor,
        "parallelism": p.name,
        "world_size": p.nodes * p.procs_per_node,
        "ep": p.ep,
        "launcher": cfg.launcher.name,
        "run_dir": os.path.abspath(run_dir),
        "wandb_mode": cfg.logging.wandb_mode,
        "wandb_dirs": wandb_dirs,
        "metrics": collect_metrics(result, wandb_dirs),
        "result": _json_safe(result),
        **_json_safe(extra),
    }


def write_summary(cfg: Any, run_dir: str, result: Optional[dict], extra: dict) -> dict[str, Any]:
    summary = build_summary(cfg, run_dir, result, extra)
    with open(os.path.join(run_dir, SUMMARY_FILE), "w") as f:
        json.dump(summary, f, indent=2)
    return summary


def _fmt(x: Any, spec: str) -> str:
    return "n/a" if x is None else format(x, spec)


def format_summary(s: dict[str, Any]) -> str:
    m = s["metrics"]
    wandb_line = ", ".join(s["wandb_dirs"]) if s["wandb_dirs"] else "none"
    if s["wandb_dirs"] and s["wandb_mode"] == "offline":
        wandb_line += "\n    upload later with: wandb sync " + " ".join(s["wandb_dirs"])
    state = f"  SLURM job {s['slurm_job_id']}: {s.get('slurm_state')}\n" if "slurm_job_id" in s else ""
    return (
        f"\n==== mxfp8ep run {s['run_name']} ====\n"
        f"{state}"
        f"  model {s['model']}  a2a {s['a2a']}  parallelism {s['parallelism']} "
        f"(world {s['world_size']}, ep {s['ep']})\n"
        f"  steps           {m.get('steps', 'n/a')}\n"
        f"  final loss      {_fmt(m.get('final_loss'), '.4f')}\n"
        f"  tokens/s        {_fmt(m.get('tokens_per_s_global'), ',.0f')} all ranks, "
        f"{_fmt(m.get('tokens_per_s'), ',.0f')} per rank\n"
        f"  step time (s)   {_fmt(m.get('step_time_s'), '.4f')}\n"
        f"  a2a bytes/step  {_fmt(m.get('a2a_bytes_per_step'), ',.0f')}\n"
        f"  run dir         {s['run_dir']}\n"
        f"  wandb ({s['wandb_mode']})  {wandb_line}\n"
    )
