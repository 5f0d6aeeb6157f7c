"""``launch.titan.checkpoints.write_whole`` on the installed torchtitan's ``CheckpointManager``
(0.2.2 here; tests/titan030 runs it on 0.3.0's): a synchronous save is written into
``.step<N>.incomplete`` and renamed to ``step-<N>`` once written; an asynchronous one is left
as torchtitan writes it. Single process, no model."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

from launch.titan.checkpoints import keep_latest_after_the_last_save, write_whole


class _Saving:
    """A checkpointer whose ``dcp_save`` writes a checkpoint as DCP does, ``.metadata`` last."""

    def __init__(self) -> None:
        self.written: list[str] = []

    def dcp_save(self, state_dict: Any, checkpoint_id: str, async_mode: Any, enable_garbage_collection: bool = False,
                 to_hf: bool = False) -> None:
        self.written.append(checkpoint_id)
        Path(checkpoint_id).mkdir(parents=True)
        (Path(checkpoint_id) / ".metadata").write_text("")


def test_the_wrapped_save_is_the_installed_torchtitans():
    """write_whole calls dcp_save(state_dict, checkpoint_id=..., async_mode=..., **kwargs), as the
    installed torchtitan's CheckpointManager declares it."""
    from torchtitan.components.checkpoint import CheckpointManager

    params = list(inspect.signature(CheckpointManager.dcp_save).parameters)
    assert params[:4] == ["self", "state_dict", "checkpoint_id", "async_mode"], params


def test_a_synchronous_save_is_renamed_once_whole(tmp_path: Path):
    from torchtitan.components.checkpoint import AsyncMode

    saving = _Saving()
    write_whole(saving)
    step = tmp_path / "checkpoint" / "step-5"
    saving.dcp_save({}, checkpoint_id=str(step), async_mode=AsyncMode.DISABLED, enable_garbage_collection=True)
    assert saving.written == [str(tmp_path / "checkpoint" / ".step5.incomplete")]
    assert sorted(p.name for p in step.parent.iterdir()) == ["step-5"] and (step / ".metadata").is_file()
    # the same step saved again (a stop right after an interval's save) replaces it
    saving.dcp_save({}, checkpoint_id=str(step), async_mode=AsyncMode.DISABLED)
    assert sorted(p.name for p in step.parent.iterdir()) == ["step-5"]


def test_an_asynchronous_save_is_left_as_torchtitan_writes_it(tmp_path: Path):
    from torchtitan.components.checkpoint import AsyncMode

    saving = _Saving()
    write_whole(saving)
    step = tmp_path / "step-5"
    saving.dcp_save({}, checkpoint_id=str(step), async_mode=AsyncMode.ASYNC)
    assert saving.written == [str(step)]


def test_the_last_save_keeps_checkpoint_keep_checkpoints(tmp_path: Path):
    """torchtitan's CheckpointManager, keep_latest_k=2, saving steps 1-5 (5 the last step): two
    checkpoints are left, not three (its last-step save skipped the purge)."""
    import torch
    import torch.distributed as dist
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.config import JobConfig

    class _Nothing:
        def state_dict(self) -> dict:
            return {}

        def load_state_dict(self, state_dict: dict) -> None:
            pass

    config = JobConfig().checkpoint
    config.enable, config.interval, config.keep_latest_k = True, 1, 2
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        manager = CheckpointManager(dataloader=None, model_parts=[torch.nn.Linear(2, 2)], optimizers=_Nothing(),
                                    lr_schedulers=_Nothing(), states={}, checkpoint_config=config, sd_adapter=None,
                                    base_folder=str(tmp_path))
        write_whole(manager)
        keep_latest_after_the_last_save(manager)
        for step in range(1, 6):
            manager.save(step, last_step=step == 5)
        manager.close()  # the purge thread has removed what it was given
    finally:
        dist.destroy_process_group()
    assert sorted(p.name for p in (tmp_path / "checkpoint").iterdir()) == ["step-4", "step-5"]
