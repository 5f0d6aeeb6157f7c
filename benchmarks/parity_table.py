"""The README's Numerics table: the parity studies' final validation losses side by side (bench
``parity``, ``scripts/parity_study.py``), each arm and seed of a study from the newest run file
that has it, with the report's STALE marks. ``benchmarks/report.py`` writes it between ``BEGIN``
and ``END``; a study without rows yet shows as not measured.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

BEGIN, END = "<!-- numerics:begin -->", "<!-- numerics:end -->"
# The studies the table shows, in its order: the row's label and what it runs.
STUDIES = (
    ("dsv3", "DeepSeek-V3-like 117M (32 experts top-4 + shared), EP=1, every row quantized"),
    ("dsv3_symm", "DeepSeek-V3-like 117M, EP=2 over symm, the 2 ranks sharing one GPU"),
    ("llama4", "Llama4-like 141M (16 experts top-1 + shared), EP=1, every row quantized"),
    ("cpu_ep2", "DeepSeek-V3-like 5.4M, EP=2 over gloo (CPU), 500 steps"),
)
ARMS = ("mxfp8", "mxfp8_all")
BASELINE = "bf16"
NOT_MEASURED = "not measured"
CURVES = "docs/parity/{study}_loss.png"  # a study's loss curves, linked where the file exists


def study_runs(runs: dict[str, Any], study: str) -> list[Any]:
    """The run files (file names sort by date) with rows of ``study``, oldest first."""
    return [run for name, run in sorted(runs.items())
            if run.first["bench"] == "parity" and any(r.get("study") == study for r in run.rows)]


def study_rows(files: list[Any], study: str) -> tuple[list[dict], list[Any]]:
    """The study's rows, each arm and seed from the newest file that has it, and the files they
    come from (oldest first). A row measured without the study's bf16 runs (a later file that
    adds seeds of an arm) is judged against the bf16 rows' reference and bound, as its study
    judged the others."""
    newest: dict[tuple, tuple[dict, Any]] = {}
    for run in files:
        for r in run.rows:
            if r.get("study") == study:
                newest[r["arm"], r.get("seed")] = (r, run)
    rows = [r for r, _ in newest.values()]
    used = [run for run in files if any(run is used_run for _, used_run in newest.values())]
    ref = next((r for r in rows if r["arm"] == BASELINE and r.get("reference")
                and r.get("val_loss_delta") is not None and r.get("tolerance") is not None), None)
    if ref is not None:
        value = ref["final_val_loss"] - ref["val_loss_delta"]
        bound = ref["tolerance"]
        rows = [r if r["arm"] == BASELINE or r.get("within_tolerance") is not None else
                {**r, "reference": ref["reference"], "val_loss_delta": r["final_val_loss"] - value,
                 "tolerance": bound, "within_tolerance": abs(r["final_val_loss"] - value) <= bound}
                for r in rows]
    return rows, used


def _seed_order(row: dict) -> tuple:
    return (row.get("seed") is None, row.get("seed") or 0)


def bf16_cell(rows: list[dict]) -> str:
    """The bf16 runs' final validation losses: each (seed order), or their mean ± sample std
    where the verdicts took the mean as their reference."""
    from launch.tools.compare_runs import SEED_STATS_MIN

    bf16 = sorted((r for r in rows if r["arm"] == BASELINE), key=_seed_order)
    by_mean = [r for r in rows if (r.get("bf16_seeds") or 0) >= SEED_STATS_MIN]
    if by_mean:
        r = by_mean[0]
        return f"{r['bf16_mean_val_loss']:.4f} ± {r['bf16_std_val_loss']:.4f} ({r['bf16_seeds']} seeds)"
    return " / ".join(f"{r['final_val_loss']:.4f}" for r in bf16) or "–"


def arm_cell(rows: list[dict], arm: str) -> str:
    """An MXFP8 arm's final validation loss per seed, with its distance from the bf16 reference in
    % of that reference; – where the study has no such arm."""
    mine = sorted((r for r in rows if r["arm"] == arm), key=_seed_order)
    cells = []
    for r in mine:
        delta = r.get("val_loss_delta")
        pct = "" if delta is None else f" ({100 * delta / (r['final_val_loss'] - delta):+.2f}%)".replace("-", "−")
        cells.append(f"{r['final_val_loss']:.4f}{pct}")
    return " / ".join(cells) or "–"


def within_cell(rows: list[dict]) -> str:
    """Whether every MXFP8 run lies within the bound, else which do not."""
    judged = [r for r in rows if r["arm"] in ARMS and r.get("within_tolerance") is not None]
    if not judged:
        return ""
    out = [f"{r['arm']}" + (f" seed {r['seed']}" if sum(x["arm"] == r["arm"] for x in judged) > 1 else "")
           for r in sorted(judged, key=lambda r: (r["arm"], *_seed_order(r))) if not r["within_tolerance"]]
    return "yes" if not out else "no: " + ", ".join(out)


def hardware(run: Any, rows: list[dict]) -> str:
    text = run.hardware().replace("× ", "×").replace(", ", " ")
    shared = [r for r in rows if r.get("gpu_shared")]
    return text + (f", {shared[0]['world_size']} ranks on it" if shared else "")


def render(runs: dict[str, Any], status: Callable[[Any], str], marks: dict[str, str], repo: Path) -> str:
    """The block: a lead (the rule, the marks used) and one row per study of ``STUDIES``.
    ``status(run)``: ``current``, ``STALE`` or ``unknown`` (``benchmarks.report.History``)."""
    from launch.tools.compare_runs import PARITY_SHARE, SEED_STATS_MIN, SPREAD_STDS

    body, used = [], set()
    for study, label in STUDIES:
        files = study_runs(runs, study)
        curves = CURVES.format(study=study)
        name = f"{label} ([curves]({curves}))" if (repo / curves).is_file() else label
        if not files:
            body.append([name, NOT_MEASURED, "", "", "", "", "", ""])
            continue
        rows, sources = study_rows(files, study)
        run = sources[-1]
        states = {status(source) for source in sources}
        mark = marks.get(next((s for s in ("STALE", "unknown") if s in states), "current"), "")
        used.add(mark)

        def marked(cell: str) -> str:
            return f"{cell} {mark}" if mark and cell != "–" else cell

        bound = next((r["tolerance"] for r in rows if r["arm"] in ARMS and r.get("tolerance") is not None), None)
        when = ", ".join(f"`{source.first['commit'][:7]}` {source.first['date'][:10]}" for source in sources)
        body.append([name, marked(bf16_cell(rows)), *(marked(arm_cell(rows, arm)) for arm in ARMS),
                     "" if bound is None else f"±{bound:.4f}", within_cell(rows), hardware(run, rows), when])
    lead = (f"Final validation loss per arm, in brackets its distance from the bf16 reference in % of it; "
            f"within: every MXFP8 run within the bound of that distance. With {SEED_STATS_MIN} or more bf16 seeds "
            f"the reference is their mean (shown ± their sample standard deviation) and the bound max({SPREAD_STDS} × "
            f"that deviation, {100 * PARITY_SHARE:g}% of the loss); with one or two, the lowest seed and max(their "
            f"distance, {100 * PARITY_SHARE:g}% of the loss).")
    if marks.get("STALE") in used:
        lead += (f" {marks['STALE']}: the code these runs measured has changed since their commit; they hold for "
                 "that commit.")
    if marks.get("unknown") in used:
        lead += f" {marks['unknown']}: whether that code changed cannot be told here."
    header = ["setup", BASELINE, *ARMS, "bound", "within", "hardware", "commit, date"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in body]
    return "\n".join([BEGIN, lead, "", *lines, END])
