"""launch/titan/metrics.py's wandb logger at the end of a run: a connection lost to wandb's
service process while the run finishes (seen once on the 2-core CI machine, after every
training step had run) is a warning, not a failed job; any other error still raises."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from launch.titan.metrics import RecipeWandBLogger


def _logger(finish):
    """A RecipeWandBLogger over a stand-in ``wandb`` module (no wandb service started)."""
    log = object.__new__(RecipeWandBLogger)
    log.wandb = SimpleNamespace(run=object(), finish=finish)
    log.run = SimpleNamespace(dir="/runs/x/wandb/offline-run")
    return log


def test_a_lost_wandb_service_connection_at_close_is_a_warning(caplog):
    calls = []

    def finish(exit_code):
        calls.append(exit_code)
        raise ConnectionResetError("Connection lost")

    with caplog.at_level(logging.WARNING):
        _logger(finish).close()
    assert calls == [0]
    assert any("could not finish" in r.getMessage() and "/runs/x/wandb/offline-run" in r.getMessage()
               for r in caplog.records), caplog.text


def test_other_errors_at_close_still_raise():
    def finish(exit_code):
        raise ValueError("bad summary")

    with pytest.raises(ValueError):
        _logger(finish).close()


def test_close_without_a_run_does_nothing():
    log = _logger(lambda exit_code: pytest.fail("finish called without a run"))
    log.wandb.run = None
    log.close()
