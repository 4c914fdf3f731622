"""The end of a process that joined a job: finish what is in flight, then destroy the
process groups, while the interpreter is still whole.

    teardown(ps, engine)           # now: the engine closes, then the groups go
    teardown_at_exit(ps, engine)   # the same at interpreter exit, for a script that
                                   # never says so (hybrid.initialize, init_distributed)

[Note: why a finished run could abort at exit]
A gloo collective runs on one of its process group's worker threads
("pt_gloo_runloop"). The caller's ``wait`` returns once the work has completed, but
the worker thread destroys the work object a moment later, and that destructor
drops the work's tensors: with a Python object alive it must take the GIL to let
go of it. If the main thread has begun interpreter finalization meanwhile, Python
ends a thread that asks for the GIL (``pthread_exit``); the forced unwind crosses
the destructor, which is ``noexcept``, and C++ calls ``std::terminate``:
"terminate called without an active exception", SIGABRT, and torchrun reports the
run that trained as failed. No un-waited collective is needed: a plain synchronous
``all_reduce`` as a script's last collective aborts about 4 runs in 10 (torch 2.13,
2 gloo ranks); a collective left in flight only widens the window.

What closes it is destroying each ``ProcessGroupGloo``: its destructor (run with the
GIL released) drains the queue and joins the worker threads, so no thread of theirs
is left to ask for the GIL. Gloo's ``shutdown()`` does nothing, so
``dist.destroy_process_group()`` destroys a group only when it drops the last
reference: the :class:`~hybrid.parallel.comm.CommGroup` objects of every
:class:`~hybrid.parallel.state.ParallelState` still alive (an API user's engine, a
module global of the script, holds one) must let go of theirs first
(:meth:`ParallelState.release`). Engines are closed before that, so what they
still had in flight is waited for on live groups.

At exit the teardown runs only when the interpreter is not ending on an uncaught
exception: then this rank's peers may never match a collective still in flight, and
waiting for it would turn a failed job's fast exit into a hang until the
collective timeout.
"""

from __future__ import annotations

import atexit
import gc
import sys
import weakref
from typing import Protocol

import torch.distributed as dist


class _Releasable(Protocol):
    """A :class:`~hybrid.parallel.state.ParallelState` (its ``release``)."""

    def release(self) -> None: ...


class _Closable(Protocol):
    def close(self) -> None: ...


# What teardown_at_exit was given, oldest first, held weakly: whatever the program
# dropped is gone already (its groups with it, unless dist's registry holds them,
# which destroy_process_group empties).
_states: list[weakref.ref] = []
_closing: list[weakref.ref] = []
_hooked = False


def teardown(ps: _Releasable | None, *closing: _Closable) -> None:
    """Now: close each of ``closing`` in the order given (an engine finishes the work it
    has in flight), then close ``ps`` and let go of its process groups
    (:meth:`ParallelState.release <hybrid.parallel.state.ParallelState.release>`), then
    destroy every process group of torch.distributed. Collective in effect (a close
    may wait for a collective); safe to call again, and after
    ``dist.destroy_process_group()``."""
    _teardown([ps] if ps is not None else [], closing)


def teardown_at_exit(ps: _Releasable | None, *closing: _Closable) -> None:
    """:func:`teardown` of ``ps`` and ``closing`` at interpreter exit, unless the
    interpreter is ending on an uncaught exception (see the module note). One exit
    hook per process, registered on the first call; each call adds its parts, held
    weakly (the hook keeps nothing alive), and a part given again is closed once. At
    exit every engine closes, newest first, before any state lets go of its groups."""
    global _hooked  # noqa: PLW0603 - one exit hook per process, registered once
    for kept, parts in ((_states, [ps] if ps is not None else []), (_closing, closing)):
        kept[:] = [r for r in kept if r() is not None]
        known = {id(r()) for r in kept}
        for part in parts:
            if id(part) not in known:
                kept.append(weakref.ref(part))
                known.add(id(part))
    if not _hooked:
        atexit.register(_teardown_at_exit)
        _hooked = True


def _teardown(states, closing) -> None:
    try:
        for part in closing:
            part.close()
    finally:
        for ps in states:
            ps.release()
        gc.collect()  # cycles (a model's hooks, an engine) holding groups outside a state
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


def _ending_on_exception() -> bool:
    return (getattr(sys, "last_exc", None) is not None  # (Python 3.12 on)
            or getattr(sys, "last_value", None) is not None)


def _teardown_at_exit() -> None:
    if _ending_on_exception():
        return
    states = [p for p in (r() for r in _states) if p is not None]
    closing = [p for p in (r() for r in reversed(_closing)) if p is not None]
    _states.clear()
    _closing.clear()
    _teardown(states, closing)
