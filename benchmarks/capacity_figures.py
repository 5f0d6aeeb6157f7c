"""The README's elastic-capacity figures, generated from the rows like the tables: the layer's
peak memory per rank, whole and above its expert weights (bench ``layer_memory``), the memory
estimate of a real model at the capacity's start, its ceiling and the worst case
(``memory_estimate``), and how often long runs replayed and where their capacity ended
(``capacity_replays``). Each from its newest run file, with the report's STALE marks;
``benchmarks/report.py`` writes it between ``BEGIN`` and ``END``.
"""

from __future__ import annotations

from typing import Any, Callable

BEGIN, END = "<!-- capacity:begin -->", "<!-- capacity:end -->"
NOT_MEASURED = "not measured"
ESTIMATE = {"model": "deepseek_v3/16B", "ep": 8, "activation_checkpoint": "selective"}


def newest(runs: dict[str, Any], bench: str) -> Any | None:
    """The newest run file of ``bench`` (file names sort by date), or None."""
    found = [run for name, run in sorted(runs.items()) if run.first["bench"] == bench]
    return found[-1] if found else None


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}×"


def _link(bench: str) -> str:
    return f"[{bench}](docs/results.md#{bench})"


def _when(run: Any, mark: str) -> str:
    return f"`{run.first['commit'][:7]}` {run.first['date'][:10]}{' ' + mark if mark else ''}"


def layer_memory(run: Any, mark: str) -> str:
    """Peak per rank against torchtitan's, whole and above the weights, per EP degree."""
    rows = [r for r in run.rows if r.get("pass") == "fwd+bwd"]
    by = {(r["ep"], r["arm"]): r for r in rows}
    eps = sorted({r["ep"] for r in rows})
    whole, above, weights = [], [], []
    for ep in eps:
        base, elastic, worst = by.get((ep, "torchtitan")), by.get((ep, "mxfp8/symm")), by.get((ep, "mxfp8/symm:worst"))
        if not (base and elastic and worst):
            continue
        ceiling = by.get((ep, "mxfp8/symm:ceiling"))
        for out, key in ((whole, "peak_gib"), (above, "above_weights_gib")):
            grown = f"{_ratio(ceiling[key], base[key])} at the ceiling, " if ceiling else ""
            out.append(f"{_ratio(elastic[key], base[key])} at EP={ep} ({grown}"
                       f"{_ratio(worst[key], base[key])} at the worst case)")
        weights.append(f"{base['peak_gib'] - base['above_weights_gib']:.1f} of {base['peak_gib']:.1f} GiB at EP={ep}")
    dims = rows[0].get("dims", {}) if rows else {}
    shape = (f"dim {dims['dim']}, {dims['experts']} experts top-{dims['top_k']}, {dims['tokens_per_rank']:,} "
             f"tokens per rank" if dims else "")
    return (f"- Measured, one DeepSeek-V3-like MoE layer ({shape}) forward and backward, "
            f"{run.hardware()}, {_when(run, mark)} ({_link('layer_memory')}): symm's peak per "
            f"rank at the starting capacity is {', '.join(whole)} of torchtitan's. Most of a peak is the layer's "
            f"expert weights and their gradients ({'; '.join(weights)}); above them symm needs "
            f"{', '.join(above)} of torchtitan's memory.")


def memory_estimate(run: Any, mark: str) -> str:
    """The estimate of the real model at the start, the ceiling (where rows hold one) and the
    worst case, against the all-to-all."""
    rows = [r for r in run.rows if all(r.get(k) == v for k, v in ESTIMATE.items())]
    arms = {r["arm"]: r for r in rows}
    if "nccl" not in arms or "symm" not in arms:
        return f"- Estimated: {NOT_MEASURED}."
    parts = [f"{arms['symm']['gib']:.1f} GiB per GPU at the start ({arms['symm']['capacity_factor']}× the "
             f"balanced case)"]
    ceiling = arms.get("symm:ceiling")
    if ceiling is not None:
        parts.append(f"{ceiling['gib']:.1f} at the ceiling ({ceiling['capacity_factor']}×)")
    if "symm:worst" in arms:
        parts.append(f"{arms['symm:worst']['gib']:.1f} at the worst case")
    first = rows[0]
    return (f"- Estimated before launch (`launch/config/memory.py`), DeepSeek-V3 16B at EP={first['ep']}, seq "
            f"{first['seq_len']}, local batch {first['local_batch_size']}, {first['activation_checkpoint']} "
            f"checkpointing, {_when(run, mark)} ({_link('memory_estimate')}): {', '.join(parts)}, against "
            f"{arms['nccl']['gib']:.1f} on nccl.")


def capacity_replays(run: Any, mark: str) -> str:
    """How many runs, how often and how late they replayed, and where their capacity ended."""
    rows = run.rows
    eps = sorted({r["ep"] for r in rows})
    steps = max(r["steps"] for r in rows)
    replays = sorted({r["capacity_replays"] for r in rows})
    last = max(r["last_replay_step"] or 0 for r in rows)
    ended = sorted({r["capacity_rows"] for r in rows})
    start = rows[0]["start_capacity_rows"]
    models = sorted({r["model"] for r in rows})
    return (f"- Replays, {len(rows)} `{'`, `'.join(models)}` runs at EP={'/'.join(map(str, eps))} over {steps:,} "
            f"steps, {run.hardware()}, {_when(run, mark)} ({_link('capacity_replays')}): "
            f"{' or '.join(map(str, replays))} replays per run, the last at step {last}; their capacity started at "
            f"{start:,} rows and ended at {' / '.join(f'{e:,}' for e in ended)} "
            f"({' / '.join(_ratio(e, start) for e in ended)} the start).")


def render(runs: dict[str, Any], status: Callable[[Any], str], marks: dict[str, str]) -> str:
    """The block: one bullet per bench, each saying what it measured and where (a bench without
    rows says so); the STALE mark where the measured code changed since."""
    lines, used = [], set()
    for bench, line in (("layer_memory", layer_memory), ("memory_estimate", memory_estimate),
                        ("capacity_replays", capacity_replays)):
        run = newest(runs, bench)
        if run is None:
            lines.append(f"- {bench}: {NOT_MEASURED}.")
            continue
        mark = marks.get(status(run), "")
        used.add(mark)
        lines.append(line(run, mark))
    if marks.get("STALE") in used:
        lines.append(f"\n{marks['STALE']}: the code these figures measured has changed since their commit; they "
                     "hold for that commit.")
    return "\n".join([BEGIN, *lines, END])
