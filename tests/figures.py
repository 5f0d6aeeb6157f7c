"""What a matplotlib figure shows, read in tests: the figures a command saves, captured as
they are saved, and their axes, lines and bands."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Iterator

import pytest


@contextlib.contextmanager
def saved_figures() -> Iterator[dict[str, Any]]:
    """The matplotlib figures saved inside the block, by file name, as they are when saved."""
    from matplotlib.figure import Figure

    saved: dict[str, Any] = {}
    original = Figure.savefig

    def savefig(fig, fname, *args, **kwargs):
        saved[Path(fname).name] = fig
        return original(fig, fname, *args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Figure, "savefig", savefig)
        yield saved


def axes_titled(fig, title: str):
    (ax,) = [ax for ax in fig.axes if ax.get_title() == title]
    return ax


def lines_of(ax) -> dict[str, Any]:
    """An axes' labelled lines by label."""
    return {line.get_label(): line for line in ax.get_lines() if not line.get_label().startswith("_")}


def spans_of(ax, label_start: str) -> list[tuple[float, float]]:
    """(low, high) of the horizontal bands (``axhspan``) whose label starts with ``label_start``."""
    return sorted((p.get_y(), p.get_y() + p.get_height()) for p in ax.patches
                  if p.get_label().startswith(label_start))
