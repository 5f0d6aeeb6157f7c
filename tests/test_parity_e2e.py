"""The CPU parity recipe end to end on a small corpus folder: `python launch/train.py
+recipe=parity_cpu` (DeepSeek-V3-like, EP 2 over 2 gloo processes, MXFP8 on every leg) with
the validation loss, checkpoints and a resume, as the console, summary.json and wandb show
them. About a minute on 2 cores."""

from __future__ import annotations

import math
import re

from tests.corpus_files import sample_texts, write_corpus
from tests.train_cli import run_train

from launch.run_dir import checkpoint_steps
from launch.run_summary import VAL_LOSS, RunSummary
from launch.wandb_offline import read_runs


def test_validation_checkpoints_and_resume_on_a_corpus(tmp_path):
    corpus = write_corpus(tmp_path / "corpus", sample_texts(60), sample_texts(40, offset=300))
    run_dir = tmp_path / "run"
    common = ["+recipe=parity_cpu", "a2a=mxfp8_all", f"training.dataset_path={corpus}",
              "training.seq_len=32", "training.local_batch_size=2", "training.warmup_steps=1",
              "training.val_every=2", "training.val_batches=2", "training.checkpoint_interval=2",
              "logging.log_freq=1"]
    proc = run_train(tmp_path, *common, "training.steps=3", f"hydra.run.dir={run_dir}")
    assert proc.returncode == 0, f"{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
    s = RunSummary.read(run_dir)
    assert s.model == "parity_tiny_dsv3" and s.ep == 2 and s.a2a == "mxfp8_all" and s.seed == 0
    # every val_every steps and at the last step
    assert s.val_logged_steps == [2, 3] and all(math.isfinite(x) for x in s.val_losses)
    assert s.final_val_loss == s.val_losses[-1]
    assert [line for line in proc.stdout.splitlines() if "val loss" in line][:2] == [
        f"step 2/3  val loss {s.val_losses[0]:.4f}", f"step 3/3  val loss {s.val_losses[1]:.4f}"]
    assert re.search(rf"  val loss +{s.val_losses[1]:.4f} at step 3\n", proc.stdout)
    assert checkpoint_steps(run_dir, "checkpoint") == [2, 3]

    proc = run_train(tmp_path, *common, "training.steps=5", f"training.resume={run_dir}")
    assert proc.returncode == 0, f"{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
    r = RunSummary.read(run_dir)
    assert r.start_step == 3 and r.logged_steps == [1, 2, 3, 4, 5]
    assert r.val_logged_steps == [2, 3, 4, 5] and r.val_losses[:2] == s.val_losses
    # training.checkpoint_keep=2: saving step 4 purged step 2 (torchtitan purges in a
    # background thread, so step 3's removal may not have happened when the run exits)
    saved = checkpoint_steps(run_dir, "checkpoint")
    assert saved[-2:] == [4, 5] and 2 not in saved
    (run,) = read_runs(str(run_dir))
    steps = [row["_step"] for row in run.history]
    assert steps == sorted(set(steps)) == [1, 2, 3, 4, 5]
    assert run.series(VAL_LOSS) == r.val_losses
    assert run.summary[VAL_LOSS] == r.final_val_loss
