"""Checkpoints that are whole or absent.

torchtitan's ``CheckpointManager`` writes ``<checkpoint folder>/step-<N>/`` with DCP, which
writes the ``.metadata`` file last; a job killed while it writes (SLURM's SIGKILL ``KillWait``
seconds after ``scancel``) leaves a ``step-<N>`` without it. :func:`write_whole` makes every
synchronous save write into ``.step<N>.incomplete`` and rename it to ``step-<N>`` once DCP is
done, so a ``step-<N>`` folder is always a whole checkpoint; what a cut-short write left is
removed when the next launch of the run starts (``launch.run.run_dir.remove_incomplete_checkpoints``).
"""

from __future__ import annotations

import os
import shutil
from typing import Any

import torch.distributed as dist

from launch.run.run_dir import incomplete_checkpoint


def write_whole(checkpointer: Any) -> None:
    """Wrap ``checkpointer.dcp_save`` (torchtitan's ``CheckpointManager``, 0.2.2's and 0.3.0's
    alike): a synchronous DCP save goes to the incomplete folder, which rank 0 renames to the
    checkpoint's once ``dcp.save`` has returned (the coordinator writes ``.metadata`` after every
    rank's data)."""
    from torchtitan.components.checkpoint import AsyncMode

    save = checkpointer.dcp_save

    def dcp_save(state_dict: Any, checkpoint_id: str, async_mode: Any, **kwargs: Any) -> Any:
        if async_mode != AsyncMode.DISABLED or kwargs.get("to_hf"):
            return save(state_dict, checkpoint_id=checkpoint_id, async_mode=async_mode, **kwargs)
        writing = str(incomplete_checkpoint(checkpoint_id))
        result = save(state_dict, checkpoint_id=writing, async_mode=async_mode, **kwargs)
        if not dist.is_initialized() or dist.get_rank() == 0:
            shutil.rmtree(checkpoint_id, ignore_errors=True)  # the same step saved again
            os.replace(writing, checkpoint_id)
        return result

    checkpointer.dcp_save = dcp_save


def keep_latest_after_the_last_save(checkpointer: Any) -> None:
    """Make the last step's save purge what ``keep_latest_k`` does not keep, as every other save
    does: torchtitan's ``_save_last_step`` (0.2.2's and 0.3.0's) returns before its purge, which
    left ``keep_latest_k + 1`` checkpoints on disk."""
    save_last_step = checkpointer._save_last_step

    def _save_last_step(curr_step: int) -> None:
        save_last_step(curr_step)
        checkpointer._purge_stale_checkpoints()

    checkpointer._save_last_step = _save_last_step
