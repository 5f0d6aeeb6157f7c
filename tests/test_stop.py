"""launch/run/stop.py: stop signals are noted, not acted on, and the previous handlers come back
(the end-to-end stops are in test_train_e2e.py and tests/slurm)."""

from __future__ import annotations

import os
import signal

from launch.run.stop import StopSignals, Stopped, signal_name


def test_signals_are_noted_and_handlers_restored():
    before = signal.getsignal(signal.SIGUSR2)
    with StopSignals() as outer:
        with StopSignals() as inner:  # the runner inside a worker entry point: one instance
            assert inner is outer
        assert signal.getsignal(signal.SIGUSR2) == outer._note  # the inner exit kept them
        os.kill(os.getpid(), signal.SIGUSR2)
        os.kill(os.getpid(), signal.SIGTERM)  # a second signal does not replace the first
        assert outer.received == signal.SIGUSR2
        assert outer.agreed() == signal.SIGUSR2  # no process group: this process's own
    assert signal.getsignal(signal.SIGUSR2) == before
    assert signal_name(signal.SIGINT) == "SIGINT" and signal_name(None) is None
    assert str(Stopped(signal.SIGTERM)) == "SIGTERM"
