"""The README's elastic-capacity figures, generated from the rows like the tables: the layer's
peak memory per rank, whole and above its expert weights (bench ``layer_memory``), the memory
estimate of a real model at the capacity's start, its ceiling and the worst case
(``memory_estimate``), how often long runs replayed and where their capacity ended
(``capacity_replays``), and what the activation pool and the capacity do at EP 2, 4 and 8 over a
measured routing (``capacity_study``). Each from its newest run file by date (the layer and the replays:
per EP degree), with the
report's STALE marks;
``benchmarks/report.py`` writes it between ``BEGIN`` and ``END``.
"""

from __future__ import annotations

from typing import Any, Callable

BEGIN, END = "<!-- capacity:begin -->", "<!-- capacity:end -->"
NOT_MEASURED = "not measured"
ESTIMATE = {"model": "deepseek_v3/16B", "ep": 8, "activation_checkpoint": "selective"}


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}×"


def _link(bench: str) -> str:
    return f"[{bench}](docs/results.md#{bench})"


def _when(run: Any, mark: str) -> str:
    return f"`{run.first['commit'][:7]}` {run.first['date'][:10]}{' ' + mark if mark else ''}"


def layer_memory(run: Any, mark: str, eps: list[int] | None = None) -> str:
    """Peak per rank against torchtitan's, whole and above the weights, per EP degree (``eps``:
    those of the run's rows to show; None: all)."""
    rows = [r for r in run.rows if r.get("pass") == "fwd+bwd" and (eps is None or r["ep"] in eps)]
    by = {(r["ep"], r["arm"]): r for r in rows}
    whole, above, weights, held = [], [], [], []
    for ep in sorted({r["ep"] for r in rows}):
        base, elastic = by.get((ep, "torchtitan")), by.get((ep, "mxfp8/symm"))
        if not (base and elastic):
            continue
        grown = [(f"at the {name}", by[ep, f"mxfp8/symm:{arm}"]) for arm, name in (("ceiling", "ceiling"),
                                                                                  ("worst", "worst case"))
                 if (ep, f"mxfp8/symm:{arm}") in by]
        for out, key in ((whole, "peak_gib"), (above, "above_weights_gib")):
            more = ", ".join(f"{_ratio(r[key], base[key])} {name}" for name, r in grown)
            out.append(f"{_ratio(elastic[key], base[key])} at EP={ep}{f' ({more})' if more else ''}")
        weights.append(f"{base['peak_gib'] - base['above_weights_gib']:.1f} of {base['peak_gib']:.1f} GiB at EP={ep}")
        if "peer_buffers_gib" in elastic:
            held.append(f"{elastic['peer_buffers_gib']:.2f} GiB peer buffers and {elastic['activation_pool_gib']:.2f} "
                        f"GiB activation pool at EP={ep}")
    held_text = f" (of it symm holds {'; '.join(held)})" if held else ""
    dims = rows[0].get("dims", {}) if rows else {}
    shape = (f"dim {dims['dim']}, {dims['experts']} experts top-{dims['top_k']}, {dims['tokens_per_rank']:,} "
             f"tokens per rank" if dims else "")
    return (f"- Measured, one DeepSeek-V3-like MoE layer ({shape}) forward and backward, "
            f"{run.hardware()}, {_when(run, mark)} ({_link('layer_memory')}): symm's peak per "
            f"rank at the starting capacity is {', '.join(whole)} of torchtitan's. Most of a peak is the layer's "
            f"expert weights and their gradients ({'; '.join(weights)}); above them symm needs "
            f"{', '.join(above)} of torchtitan's memory{held_text}.")


def memory_estimate(run: Any, mark: str) -> str:
    """The estimate of the real model at the start, the ceilings (where rows hold them) and the
    worst case, against the all-to-all."""
    rows = [r for r in run.rows if all(r.get(k) == v for k, v in ESTIMATE.items())]
    arms = {r["arm"]: r for r in rows}
    if "nccl" not in arms or "symm" not in arms:
        return f"- Estimated: {NOT_MEASURED}."

    def pool(r: dict) -> str:
        return f", activation pool {r['pool_factor']}×" if r.get("pool_factor") is not None else ""

    parts = [f"{arms['symm']['gib']:.1f} GiB per GPU at the start ({arms['symm']['capacity_factor']}× the "
             f"balanced case{pool(arms['symm'])})"]
    ceiling = arms.get("symm:ceiling")
    if ceiling is not None:
        parts.append(f"{ceiling['gib']:.1f} at the ceiling ({ceiling['capacity_factor']}×{pool(ceiling)})")
    if "symm:worst" in arms:
        parts.append(f"{arms['symm:worst']['gib']:.1f} with every layer at the worst case")
    first = rows[0]
    return (f"- Estimated before launch (`launch/config/memory.py`), DeepSeek-V3 16B at EP={first['ep']}, seq "
            f"{first['seq_len']}, local batch {first['local_batch_size']}, {first['activation_checkpoint']} "
            f"checkpointing, {_when(run, mark)} ({_link('memory_estimate')}): {', '.join(parts)}, against "
            f"{arms['nccl']['gib']:.1f} on nccl.")


def capacity_replays(run: Any, mark: str, ep: int) -> str:
    """How many runs at ``ep``, how often and how late they replayed or spilled, and where their
    capacity ended."""
    rows = [r for r in run.rows if r["ep"] == ep]
    steps = max(r["steps"] for r in rows)
    replays = sorted({r["capacity_replays"] for r in rows})
    spills = sum(r.get("capacity_spills") or 0 for r in rows)
    last = max(r["last_replay_step"] or 0 for r in rows)
    ended = sorted({r["capacity_rows"] for r in rows})
    start = rows[0]["start_capacity_rows"]
    models = sorted({r["model"] for r in rows})
    runs = f"{len(rows)} runs" if len(rows) > 1 else "1 run"
    each = " per run" if len(rows) > 1 else ""
    return (f"- Replays, {runs} of `{'`, `'.join(models)}` at EP={ep} over {steps:,} steps, {run.hardware()}, "
            f"{_when(run, mark)} ({_link('capacity_replays')}): {' or '.join(map(str, replays))} replays{each}, the "
            f"last at step {last}, {spills} spills; the capacity started at {start:,} rows and ended at "
            f"{' / '.join(f'{e:,}' for e in ended)} ({' / '.join(_ratio(e, start) for e in ended)} the start).")


def _factor(value: float | None) -> str:
    return "the worst case" if value is None else f"{value}×"


def capacity_study(run: Any, mark: str) -> str:
    """What the activation pool and the capacity do, at the defaults, over the routing the study
    measured, per EP degree of the target: the busiest layer's load and the busiest rank's sum
    over the layers, reruns per 1,000 steps, the memory at the ceilings against nccl's."""
    rows = sorted((r for r in run.rows if r.get("kind") == "policy" and r.get("defaults")), key=lambda r: r["ep"])
    if not rows:
        return f"- capacity_study: {NOT_MEASURED} at the defaults."
    routing = {r["ep"]: r for r in run.rows if r.get("kind") == "routing"}
    first = rows[0]

    def at(r: dict) -> str:
        loads = routing.get(r["ep"])
        seen = (f"busiest layer up to {loads['max_layer_load']:.2f}× balanced, busiest rank's sum over the layers "
                f"up to {loads['max_rank_sum']:.2f}× ({loads['max_rank_sum_second_half']:.2f}× in the second half)"
                + (" (an upper bound)" if loads["rank_sum_bound"] else "") + ", " if loads else "")
        return (f"EP={r['ep']}: {seen}{r['reruns_per_1000']:g} reruns per 1,000 steps ({r['replays']} replays, "
                f"{r['spills']} spills), {r['gib_ceiling']:.1f} GiB per GPU at the ceilings, "
                f"{r['vs_nccl_routed']:.2f}× nccl's {r['gib_nccl_routed']:.1f} on the same routing "
                f"({r['gib_nccl']:.1f} balanced)")

    return (f"- Activation pool and capacity over a measured routing (`benchmarks/capacity_study.py`: "
            f"{first['steps']:,} steps of a {first['study_moe_layers']}-MoE-layer model's routing, measured at EP=1, "
            f"applied to {first['target']} on {first['gpus']} GPUs, {first['activation_checkpoint']} checkpointing; "
            f"only estimated at these EP degrees), at the defaults (pool {first['pool_factor']}× growing +"
            f"{100 * first['pool_headroom']:g}% up to {first['pool_ceiling']}×; capacity {first['capacity_factor']}× "
            f"growing +{100 * first['headroom']:g}% up to {_factor(first['capacity_ceiling'])}), {_when(run, mark)} "
            f"({_link('capacity_study')}): {'; '.join(at(r) for r in rows)}.")


def newest_at(files: list[Any], ep: int) -> Any:
    """The newest of ``files`` (oldest first) with rows at EP ``ep``."""
    return next(run for run in reversed(files) if any(r["ep"] == ep for r in run.rows))


def render(runs: dict[str, Any], status: Callable[[Any], str], marks: dict[str, str]) -> str:
    """The block: one bullet per bench, each saying what it measured and where (a bench without
    rows says so); the STALE mark where the measured code changed since."""
    lines, used = [], set()
    for bench, line in (("layer_memory", layer_memory), ("memory_estimate", memory_estimate),
                        ("capacity_replays", capacity_replays), ("capacity_study", capacity_study)):
        files = sorted((run for run in runs.values() if run.first["bench"] == bench), key=lambda run: run.first["date"])
        if not files:
            lines.append(f"- {bench}: {NOT_MEASURED}.")
            continue
        if bench == "capacity_replays":  # each EP degree from the newest file that has runs at it
            shown = [(newest_at(files, ep), ep) for ep in sorted({r["ep"] for run in files for r in run.rows})]
        elif bench == "layer_memory":  # likewise, the degrees one file measured in one line
            newest = {ep: newest_at(files, ep) for ep in sorted({r["ep"] for run in files for r in run.rows})}
            shown = [(run, [ep for ep, r in newest.items() if r is run]) for run in files if run in newest.values()]
        else:
            shown = [(files[-1], None)]
        for run, ep in shown:
            mark = marks.get(status(run), "")
            used.add(mark)
            lines.append(line(run, mark) if ep is None else line(run, mark, ep))
    if marks.get("STALE") in used:
        lines.append(f"\n{marks['STALE']}: the code these figures measured has changed since their commit; they "
                     "hold for that commit.")
    return "\n".join([BEGIN, *lines, END])
