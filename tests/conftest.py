import os
import sys

# Tests import the shared harness as `harness`; spawned ranks inherit sys.path.
sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("OMP_NUM_THREADS", "1")

# This process is an entry point too: kernel settings from HYBRID_* as a script's
# would be (tests that need others call hybrid.kernels.configure themselves).
from hybrid.config import kernel_config_from_env  # noqa: E402
from hybrid.kernels import configure  # noqa: E402

configure(kernel_config_from_env(os.environ))

# The 4-process checkpoint I/O session, shared by two test files (runs once).
from checkpoint_io_session import io_session  # noqa: E402,F401
