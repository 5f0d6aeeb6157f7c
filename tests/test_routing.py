"""``mxfp8_ep.routing``'s chunk-major layout of a chunked exchange: the device mapping
(``chunk_major_rows``) puts every row where the host's chunk splits (``chunk_splits``) send it."""

from __future__ import annotations

import random

import pytest
import torch

from mxfp8_ep import routing


def _layout(rows: list[int], chunks: int) -> dict[tuple[int, int], int]:
    """(peer, index in its segment) -> row of the chunk-major buffer, from the host splits:
    chunk after chunk, each carrying its piece of every peer's segment in rank order."""
    where, pos = {}, 0
    for c, pieces in enumerate(routing.chunk_splits(rows, chunks)):
        for p, piece in enumerate(pieces):
            first = c * rows[p] // chunks
            for k in range(first, first + piece):
                where[p, k] = pos
                pos += 1
    return where


@pytest.mark.parametrize("seed", range(4))
def test_chunk_major_rows_follow_the_host_splits(seed):
    rng = random.Random(seed)
    for _ in range(100):
        world, chunks = rng.randint(1, 5), rng.randint(1, 6)
        rows = [rng.choice([0, 1, rng.randint(0, 12)]) for _ in range(world)]
        layout = _layout(rows, chunks)
        assert sorted(layout.values()) == list(range(sum(rows)))  # every row once
        assert [sum(pieces) for pieces in zip(*routing.chunk_splits(rows, chunks))] == rows  # per peer
        members = [(p, k) for p in range(world) for k in range(rows[p])]
        start = [sum(rows[:p]) for p in range(world)]
        row = torch.tensor([start[p] + k for p, k in members] + [123], dtype=torch.int64)
        peer = torch.tensor([p for p, _ in members] + [-1], dtype=torch.int64)
        moves = torch.tensor([True] * len(members) + [False])  # the last row stays as it is
        got = routing.chunk_major_rows(row, peer, moves, torch.tensor(rows, dtype=torch.int64), chunks)
        assert got.tolist() == [layout[m] for m in members] + [123], (rows, chunks)


def test_one_chunk_is_the_rank_major_layout():
    rows = torch.tensor([3, 0, 5])
    row = torch.arange(8)
    peer = torch.tensor([0, 0, 0, 2, 2, 2, 2, 2])
    assert torch.equal(routing.chunk_major_rows(row, peer, torch.ones(8, dtype=torch.bool), rows, 1), row)
    assert routing.chunk_splits([3, 0, 5], 1) == [[3, 0, 5]]
