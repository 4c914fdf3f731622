"""A failed worker's one error line, handed to the launcher that says it for the job.

[Note: one line, whichever ranks fail]
When every rank of a job hits the same bad input (an empty data file, a checkpoint of
another model), every rank fails with the same line, at about the same moment. Printed
by each worker, the job's report is as many lines as ranks got that far before the
launcher stopped the others: one on a quiet machine, several on a loaded one. So a
worker under pretrain_gpt.sh's launcher does not print its line: it writes it to the
error file torchrun gives each worker (``TORCHELASTIC_ERROR_FILE``, in torchrun's own
format, so torchrun's failure record carries it), and the launcher prints the line of
the job's root failure once (``scripts/torchrun_quiet.py``). The launcher says it
reads the files by exporting :data:`LAUNCHER_REPORTS`; under any other launcher a
worker prints its own line.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping

# Exported by scripts/torchrun_quiet.py to its workers: "I print your error files' lines".
LAUNCHER_REPORTS = "HYBRID_LAUNCHER_REPORTS"
# Set by torchrun's agent in each worker's environment: where that worker's error goes.
ERROR_FILE = "TORCHELASTIC_ERROR_FILE"
_MARK = "hybrid_error_line"


def report_error_line(line: str, environ: Mapping[str, str]) -> bool:
    """Hand ``line`` to the launcher when it reads error files (True); otherwise do
    nothing and return False, and the caller prints it.

    ``environ``: the worker's environment, passed by the entry point. The file is
    written whole or not at all (a temporary file renamed over it): the launcher
    may read it the moment this process exits, or stop this process mid-write.
    """
    path = environ.get(ERROR_FILE, "")
    if environ.get(LAUNCHER_REPORTS) != "1" or not path:
        return False
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        # torchrun's error-file format with a plain message ({"message", "timestamp"}),
        # and a key of ours: torchrun's parse of a worker without a file has a message too
        json.dump({"message": line, "timestamp": int(time.time()), _MARK: 1}, f)
    os.replace(tmp, path)
    return True


def reported_line(error_file_data: Mapping) -> str | None:
    """The line :func:`report_error_line` wrote, from torchrun's parsed error file of a
    failed worker (``ProcessFailure.error_file_data``); None when the worker wrote none
    (it died, or failed with a traceback it printed itself)."""
    message = error_file_data.get("message")
    return message if error_file_data.get(_MARK) == 1 and isinstance(message, str) else None
