import os
import sys

# Tests import the shared harness as `harness`; spawned ranks inherit sys.path.
sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("OMP_NUM_THREADS", "1")
# torch's store sockets name their peers with a reverse lookup (getnameinfo), and
# ::ffff:127.0.0.1 is not in /etc/hosts, so each connect asks DNS; where the resolver
# drops a query (this machine's, about once in 20) the lookup waits glibc's default
# 5 s before retrying. Retrying after 1 s keeps the ranks' connects from stalling.
os.environ.setdefault("RES_OPTIONS", "timeout:1 attempts:2")

# This process is an entry point too: kernel settings from HYBRID_* as a script's
# would be (tests that need others call hybrid.kernels.configure themselves).
from hybrid.config import kernel_config_from_env  # noqa: E402
from hybrid.kernels import configure  # noqa: E402

configure(kernel_config_from_env(os.environ))

# ``choose("op=path,...")``: kernel paths for one test (tests/test_kernels_*.py).
import pytest  # noqa: E402

# The 4-process checkpoint I/O session, shared by two test files (runs once).
from checkpoint_io_session import io_session  # noqa: E402,F401


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
