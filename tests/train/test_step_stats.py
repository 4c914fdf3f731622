"""PendingSteps: skip flags read once per log interval, in iteration order."""

import torch

from hybrid.testing.host_syncs import HostReads
from hybrid.train.step_stats import PendingSteps
from hybrid.zero import StepResult


def _result(skipped: bool, host: bool) -> StepResult:
    return StepResult(torch.zeros((), dtype=torch.float64), torch.tensor(skipped), 1.0,
                      skipped if host else None)


def test_device_flags_wait_for_a_forced_settle_and_are_read_at_once():
    pending = PendingSteps()
    pending.add(1, _result(False, host=False))
    pending.add(2, _result(True, host=False))
    with HostReads() as reads:
        assert pending.settle(force=False) == []  # nothing read between log lines
    assert reads.count == 0
    with HostReads() as reads:
        settled = pending.settle(force=True)
    assert reads.count == 1  # one read for the whole batch
    assert [(it, skipped) for it, _, skipped in settled] == [(1, False), (2, True)]
    assert pending.settle(force=True) == []


def test_flags_the_host_already_read_pass_straight_through():
    """Dynamic fp16: the engine read the flag to adjust its scale (host_skipped)."""
    pending = PendingSteps()
    pending.add(1, _result(True, host=True))
    pending.add(2, _result(False, host=True))
    with HostReads() as reads:
        settled = pending.settle(force=False)
    assert reads.count == 0
    assert [(it, skipped) for it, _, skipped in settled] == [(1, True), (2, False)]
