import os

# Many ranks share a few cores: one thread each (pooled ranks inherit the environment).
os.environ.setdefault("OMP_NUM_THREADS", "1")

# This process is an entry point too: kernel settings from HYBRID_* as a script's
# would be (tests that need others call hybrid.kernels.configure themselves).
from hybrid.config import kernel_config_from_env  # noqa: E402
from hybrid.kernels import configure  # noqa: E402

configure(kernel_config_from_env(os.environ))

# ``choose("op=path,...")``: kernel paths for one test (tests/test_kernels_*.py).
import pytest  # noqa: E402

# The 4-process checkpoint I/O session, shared by two test files (runs once).
from tests.helpers.checkpoint_io_session import io_session  # noqa: E402,F401


@pytest.fixture
def choose():
    """``choose("op=path,...")`` configures those paths (as --kernel-choice would);
    the settings of before come back after the test."""
    from dataclasses import replace

    from hybrid import kernels
    from hybrid.config import parse_kernel_choice

    before = kernels.current()
    yield lambda text: kernels.configure(replace(before, choice=parse_kernel_choice(text, "test")))
    kernels.configure(before)


# -- peers: tests that run against DeepSpeed or megatron-core (tests/helpers/peers.py) -----
def pytest_runtest_setup(item):
    """A test marked ``peer(module)`` skips, naming the peer, where it is not installed."""
    from tests.helpers.peers import missing

    for mark in item.iter_markers("peer"):
        reason = missing(*mark.args)
        if reason:
            pytest.skip(reason)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A test that skipped for want of a peer without the ``peer`` mark fails: .ci/run's
    peer step selects by the mark (``-m peer``), so it would run nowhere."""
    from tests.helpers.peers import named_in

    report = (yield).get_result()
    if report.skipped and call.excinfo is not None and not any(item.iter_markers("peer")):
        module = named_in(str(call.excinfo.value))
        if module:
            report.outcome = "failed"
            report.longrepr = (f"{item.nodeid} skipped for want of {module} "
                               f"({call.excinfo.value}) but is not marked "
                               f"@pytest.mark.peer({module!r}): the peer step (pytest -m "
                               f"peer) would never run it")


# -- DeepSpeed's CPU shared-memory buffers ------------------------------------------------
# DeepSpeed on CPU allocates its all-reduce buffers as /dev/shm files
# (deepspeed_allreduce_buffer_*) and leaves them when its processes end: each peer run
# would keep tens of MB of RAM, which on this machine piled up to gigabytes across runs.
# The ones made while the tests ran go when they end: when all of them end, under -n 2
# (pytest-xdist), so the controlling process does it, not a test process that finished
# first while the other may still use its buffers.
_SHM_START = pytest.StashKey[float]()
def pytest_sessionstart(session):
    import time
    if hasattr(session.config, "workerinput"):  # a pytest-xdist test process
        return
    session.config.stash[_SHM_START] = time.time() - 1


def pytest_sessionfinish(session, exitstatus):
    import glob
    start = session.config.stash.get(_SHM_START, None)
    if start is None:
        return
    for path in glob.glob("/dev/shm/deepspeed_allreduce_buffer_*"):
        try:
            if os.path.getmtime(path) >= start:
                os.unlink(path)
        except OSError:
            pass
