"""SignalWatch in-process: it takes SIGTERM/SIGINT only while entered, gives the previous handlers
back, leaves a signal the parent ignored (a shell's background job) ignored, and a signal it
took stops fit after the step in flight (the subprocess tests are tests/test_faults.py)."""

from __future__ import annotations

import os
import signal

import pytest

from flaxheads.training.preemption import Interrupted, SignalWatch, StopOnSignal


def test_watch_records_and_restores():
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    with SignalWatch(multihost=False) as w:
        assert not w.due(1)
        os.kill(os.getpid(), signal.SIGTERM)  # handled, not fatal: the step finishes
        assert w.due(2) and w.signum == signal.SIGTERM
        with pytest.raises(Interrupted) as e:
            StopOnSignal(w, None).on_step_end(None, 2)
    assert e.value.exit_code == 143 and "interrupted at step 2; no checkpoint saved" in e.value.line()
    assert {s: signal.getsignal(s) for s in before} == before


def test_an_ignored_signal_stays_ignored():
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with SignalWatch(multihost=False) as w:
            assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
            os.kill(os.getpid(), signal.SIGINT)
            assert not w.due(1)
    finally:
        signal.signal(signal.SIGINT, old)
