"""The end of a process that joined a job: finish what is in flight, then destroy the
process groups, while the interpreter is still whole.

    teardown(engine, ps)           # now: the engine closes, then the groups go
    teardown_at_exit(engine, ps)   # the same at interpreter exit, for a script that
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

import torch.distributed as dist

# What teardown_at_exit was given, oldest first, held weakly: whatever the program
# dropped is gone already (its groups with it, unless dist's registry holds them,
# which destroy_process_group empties).
_at_exit: list[weakref.ref] = []
_hooked = False


def teardown(*parts) -> None:
    """Now: close each of ``parts`` in the order given (an engine finishes the work it has
    in flight), except the :class:`~hybrid.parallel.state.ParallelState` ones (a part
    with ``release()``): those then close and let go of their process groups; then
    every process group of torch.distributed is destroyed. Collective in effect (a
    close may wait for a collective); safe to call again, and after
    ``dist.destroy_process_group()``."""
    try:
        for part in parts:
            if not hasattr(part, "release"):
                part.close()
    finally:
        for part in parts:
            if hasattr(part, "release"):
                part.release()
        gc.collect()  # cycles (a model's hooks, an engine) holding groups outside a state
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


def teardown_at_exit(*parts) -> None:
    """:func:`teardown` of ``parts`` at interpreter exit, if the interpreter is not
    ending on an uncaught exception (see the module note). One exit hook per process,
    registered on the first call; each call adds its parts, held weakly (the hook
    keeps nothing alive), and a part given again is closed once. At exit the engines
    close newest first, then the states let go of their groups."""
    global _hooked
    _at_exit[:] = [r for r in _at_exit if r() is not None]
    known = {id(r()) for r in _at_exit}
    for part in parts:
        if part is not None and id(part) not in known:
            _at_exit.append(weakref.ref(part))
            known.add(id(part))
    if not _hooked:
        atexit.register(_teardown_at_exit)
        _hooked = True


def _ending_on_exception() -> bool:
    return (getattr(sys, "last_exc", None) is not None  # (Python 3.12 on)
            or getattr(sys, "last_value", None) is not None)


def _teardown_at_exit() -> None:
    if _ending_on_exception():
        return
    alive = [p for p in (r() for r in reversed(_at_exit)) if p is not None]
    _at_exit.clear()
    teardown(*alive)
