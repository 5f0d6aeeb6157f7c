"""The CPU parity recipe end to end on a small corpus folder: `python launch/train.py
+recipe=parity_cpu` (DeepSeek-V3-like, EP 2 over 2 gloo processes) with its two arms side by side,
bf16 and MXFP8 on every leg: the MXFP8 arm at parity with bf16 over the first steps (losses that
differ, as quantized rows make them, by less than compare_runs' parity share; its verdict
"within"), then the MXFP8 arm's validation loss, checkpoints and a resume, as the console,
summary.json and wandb show them. About a minute on 2 cores."""

from __future__ import annotations

import math
import re

from tests.corpus_files import sample_texts, write_corpus
from tests.train_cli import run_side_by_side, run_train

from launch.tools.compare_runs import PARITY_SHARE, collect, compare, verdicts
from launch.run.run_dir import checkpoint_steps
from launch.run.run_summary import VAL_LOSS, RunSummary
from launch.run.wandb_offline import read_runs
from mxfp8_ep.config import LEGS


def test_mxfp8_at_parity_with_bf16_validation_checkpoints_and_resume_on_a_corpus(tmp_path):
    corpus = write_corpus(tmp_path / "corpus", sample_texts(60), sample_texts(40, offset=300))
    run_dir, bf16_dir = tmp_path / "run", tmp_path / "bf16"
    common = ["+recipe=parity_cpu", f"training.dataset_path={corpus}",
              "training.seq_len=32", "training.local_batch_size=2", "training.warmup_steps=1",
              "training.val_every=2", "training.val_batches=2", "training.checkpoint_interval=2",
              "logging.log_freq=1"]
    # the bf16 arm alongside the MXFP8 arm's first launch
    _, proc = run_side_by_side(tmp_path, (*common, "a2a=bf16", "training.steps=3", f"hydra.run.dir={bf16_dir}"),
                               (*common, "a2a=mxfp8_all", "training.steps=3", f"hydra.run.dir={run_dir}"))
    s, b = RunSummary.read(run_dir), RunSummary.read(bf16_dir)
    assert s.model == "parity_tiny_dsv3" and s.ep == 2 and s.a2a == "mxfp8_all" and s.seed == 0
    assert [s.a2a_legs[leg] for leg in LEGS] == ["mxfp8"] * 4 and [b.a2a_legs[leg] for leg in LEGS] == ["bf16"] * 4

    # Parity. Both arms start from the same weights and read the same batches; at EP 2 every token
    # row crosses the all-to-all, so the MXFP8 arm's rows are quantized on all four legs and each of
    # its losses differs from bf16's (equal losses: nothing was quantized), by no more than the
    # parity share of the loss compare_runs judges a study by (a wrong scale, rows off by 2x,
    # moves the third step's losses by ~1%).
    assert (s.logged_steps, s.val_logged_steps) == (b.logged_steps, b.val_logged_steps)
    for what, steps, mine, theirs in (("loss", s.logged_steps, s.losses, b.losses),
                                      ("val loss", s.val_logged_steps, s.val_losses, b.val_losses)):
        for step, m, t in zip(steps, mine, theirs, strict=True):
            assert m != t, f"step {step}: the MXFP8 arm's {what} is bf16's, {m}: its rows were not quantized"
            assert abs(m - t) <= PARITY_SHARE * t, f"step {step}: {what} {m} vs bf16's {t}"
    (verdict,) = verdicts(compare(collect([str(run_dir), str(bf16_dir)])))
    assert verdict["baseline"] == b.run_name and verdict["within"] is True, verdict["text"]

    # every val_every steps and at the last step
    assert s.val_logged_steps == [2, 3] and all(math.isfinite(x) for x in s.val_losses)
    assert s.final_val_loss == s.val_losses[-1]
    assert [line for line in proc.stdout.splitlines() if "val loss" in line][:2] == [
        f"step 2/3  val loss {s.val_losses[0]:.4f}", f"step 3/3  val loss {s.val_losses[1]:.4f}"]
    assert re.search(rf"  val loss +{s.val_losses[1]:.4f} at step 3\n", proc.stdout)
    assert checkpoint_steps(run_dir, "checkpoint") == [2, 3]

    # Training on past the 3-step schedule the run started with takes a schedule of that length.
    proc = run_train(tmp_path, *common, "a2a=mxfp8_all", "training.steps=5", "training.lr_schedule_steps=5",
                     f"training.resume={run_dir}")
    assert proc.returncode == 0, f"{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
    r = RunSummary.read(run_dir)
    assert r.start_step == 3 and r.logged_steps == [1, 2, 3, 4, 5]
    assert r.val_logged_steps == [2, 3, 4, 5] and r.val_losses[:2] == s.val_losses
    # training.checkpoint_keep=2: two checkpoints are left, the last step's save included
    assert checkpoint_steps(run_dir, "checkpoint") == [4, 5]
    (run,) = read_runs(str(run_dir))
    steps = [row["_step"] for row in run.history]
    assert steps == sorted(set(steps)) == [1, 2, 3, 4, 5]
    assert run.series(VAL_LOSS) == r.val_losses
    assert run.summary[VAL_LOSS] == r.final_val_loss
