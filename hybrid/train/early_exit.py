"""Stopping before the schedule ends: ``--exit-interval``, ``--exit-duration-in-mins``
and ``--exit-signal-handler``. The training loop then saves (with ``--save``) and
returns, so a resumed run continues exactly.

[Note: every rank stops at the same iteration]
A stop that one rank decides alone would leave the others waiting in the next
step's collectives. The interval is the same arithmetic everywhere; the clock
and the signal are not (a scheduler may signal one node first, clocks drift),
so they are judged together in one two-element MAX all-reduce over the world
after each iteration: the slowest clock, and whether any rank got the signal.
That is one small collective and one host read per iteration, only when one
of the two flags is given.

``--exit-signal-handler`` replaces SIGTERM's default (die at once) with a note
that the next check reads. torchrun passes a SIGTERM it gets (``scancel``, a
preemption) on to its workers and waits for them before it kills them, so the
job saves the iteration in progress within that grace period. The previous
handler comes back in :meth:`EarlyExit.close`.

[Note: a stop by signal ends with the signal's code]
A job the signal stopped ends as a job a signal ended: exit code 128 + 15, not
0, whether the launcher got the signal (torchrun then exits with it) or one
worker did (then the workers' own codes are the job's). A scheduler reads 0 as
"done" and would not requeue. The trainer returns normally after the save, so
the stop is noted in the process, where signal dispositions live too, and the
entry point reads :func:`stopped_by_signal` once training has returned. Every
rank notes it, not only the one signalled: all of them stopped for it.
"""

from __future__ import annotations

import signal
import time

from hybrid.config.sections import LoopConfig
from hybrid.parallel.agree import max_over_ranks
from hybrid.parallel.state import ParallelState

EXIT_SIGNAL = signal.SIGTERM
_stopped_by: signal.Signals | None = None  # see [Note: a stop by signal ends with ...]


def stopped_by_signal() -> signal.Signals | None:
    """The signal that stopped this process's latest training run (``--exit-signal-handler``,
    received by any rank), or None when it ran to its end or stopped for another reason."""
    return _stopped_by


class EarlyExit:
    """The early-exit conditions of one training run; ``reason`` after each iteration.

    Construct in the main thread (a signal handler can only be set there) and
    call :meth:`close` when training returns.
    """

    def __init__(self, s: LoopConfig, ps: ParallelState, started: float):
        global _stopped_by  # noqa: PLW0603 - process-wide: stopped_by_signal() reads it
        _stopped_by = None  # a new run (a pooled test rank runs many)
        self.s, self.ps, self.started = s, ps, started
        self.received: str | None = None
        self._previous = None
        if s.exit_signal_handler:
            self._previous = signal.signal(EXIT_SIGNAL, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        self.received = signal.Signals(signum).name

    def reason(self, iteration: int) -> str | None:
        """Why to stop after ``iteration`` (the flag and what tripped it), or None.
        Collective over the world when ``--exit-duration-in-mins`` or
        ``--exit-signal-handler`` is given (see the module note)."""
        global _stopped_by  # noqa: PLW0603 - process-wide: stopped_by_signal() reads it
        s = self.s
        if s.exit_interval and iteration % s.exit_interval == 0:
            return f"--exit-interval {s.exit_interval}"
        if s.exit_duration_in_mins is None and not s.exit_signal_handler:
            return None
        elapsed, signalled = max_over_ranks(
            self.ps, [time.monotonic() - self.started, float(self.received is not None)])
        if signalled:
            _stopped_by = EXIT_SIGNAL
            return f"--exit-signal-handler: {EXIT_SIGNAL.name} received"
        if s.exit_duration_in_mins is not None and elapsed >= s.exit_duration_in_mins * 60:
            return f"--exit-duration-in-mins {s.exit_duration_in_mins}"
        return None

    def close(self) -> None:
        """Give SIGTERM its previous handler back."""
        if self._previous is not None:
            signal.signal(EXIT_SIGNAL, self._previous)
            self._previous = None
