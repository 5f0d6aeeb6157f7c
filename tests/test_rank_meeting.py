"""launch/run/rank_meeting.py and StopSignals.agreed's deadline: ranks that are not where the
others wait for them are named, with where they are, instead of a hang (gloo, 2 and 3 ranks)."""

from __future__ import annotations

import pytest

from tests.distributed import run_on_ranks


def _split_at_the_end(rank: int, world_size: int) -> None:  # noqa: ARG001 (run_on_ranks' signature)
    """Rank 0 waits at the end of the run while rank 1 waits in the stop agreement of the next
    step boundary: each names the other and where it is."""
    from launch.run.rank_meeting import RanksMissing, meet
    from launch.run.stop import StopSignals

    if rank == 0:
        with pytest.raises(RanksMissing) as e:
            meet("the end of the run", timeout_s=3)
        assert str(e.value).startswith("the end of the run: rank(s) 1 did not arrive within 3 s "
                                       "(rank 1: at the stop agreement of step boundary 1)"), e.value
    else:
        with pytest.raises(RanksMissing) as e:
            StopSignals().agreed(timeout_s=1)
        assert str(e.value).startswith("the stop agreement of step boundary 1: rank(s) 0 did not arrive "
                                       "within 1 s (rank 0: at the end of the run)"), e.value


def test_a_rank_at_another_meeting_is_named_on_both_sides():
    run_on_ranks(2, _split_at_the_end, timeout_s=60)


def _all_meet(rank: int, world_size: int) -> None:  # noqa: ARG001
    """Every rank at both: the agreement carries the stop signal, the end meeting returns."""
    from launch.run.rank_meeting import meet
    from launch.run.stop import StopSignals

    stop = StopSignals()
    stop.received = 15 if rank == 2 else None
    assert stop.agreed(timeout_s=60) == 15
    assert stop.agreed(timeout_s=60) == 15
    meet("the end of the run", timeout_s=60)


def test_ranks_that_all_arrive_agree_and_meet():
    run_on_ranks(3, _all_meet, timeout_s=60)


def _one_rank_never_comes(rank: int, world_size: int) -> None:  # noqa: ARG001
    """Rank 2 never reaches the end of the run: ranks 0 and 1 name it (it has been nowhere)."""
    from launch.run.rank_meeting import RanksMissing, meet

    if rank == 2:
        import time

        time.sleep(4)
        return
    with pytest.raises(RanksMissing, match=r"^the end of the run: rank\(s\) 2 did not arrive within 2 s "
                                           r"\(rank 2: at no meeting yet\)"):
        meet("the end of the run", timeout_s=2)


def test_a_rank_that_never_comes_is_named():
    run_on_ranks(3, _one_rank_never_comes, timeout_s=60)
