"""Sharded, atomic, layout-independent checkpoints (see :mod:`hybrid.checkpoint.save`).

:func:`allow_client_state_types`: the types, beyond the defaults, that an API
checkpoint's ``client_state`` may hold (:mod:`hybrid.checkpoint.client_state`).
"""

from hybrid.checkpoint.client_state import allow_client_state_types
from hybrid.checkpoint.files import find_checkpoint, read_metadata, resolve_checkpoint
from hybrid.checkpoint.load import load_checkpoint
from hybrid.checkpoint.reader import RangeReader
from hybrid.checkpoint.reshard import iter_full_params, merged_state
from hybrid.checkpoint.save import save_checkpoint

__all__ = ["save_checkpoint", "load_checkpoint", "find_checkpoint", "read_metadata",
           "resolve_checkpoint", "RangeReader", "iter_full_params", "merged_state",
           "allow_client_state_types"]
