"""Bounded polling for the SLURM tests: every wait on the live cluster has a deadline."""

from __future__ import annotations

import time

import pytest


def wait_until(pred, timeout: float, what: str, interval: float = 0.3):
    """Return ``pred()``'s first truthy value; fail the test after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)
