"""Sharded, atomic, layout-independent checkpoints (see :mod:`hybrid.checkpoint.save`).

:func:`allow_client_state_types`: the types, beyond the defaults, that an API
checkpoint's ``client_state`` may hold (:mod:`hybrid.checkpoint.client_state`).

* :mod:`.save`         sharded checkpoints: atomic save, exact resume, the files on disk
* :mod:`.single_rank`  one-rank checkpoints of whole parameters (imports, HF weights, upcycling)
* :mod:`.async_save`   ``--async-save``: the files written on a thread, published from the loop
* :mod:`.snapshot`     what an asynchronous save copies while the step waits: host memory, or
                       the nvme tier's swap file copied on disk
* :mod:`.load`         load a checkpoint into a running engine, in the same layout or any other
* :mod:`.files`        finding and reading checkpoints on disk; every error names the file
* :mod:`.layout`       where every saved value lives: the ``zero_layout`` of ``metadata.json``
* :mod:`.reader`       :class:`RangeReader`: the one place a load reads checkpoint bytes, counted
* :mod:`.reshard`      any TP-local range of a parameter, in any new TP layout, from the old files
* :mod:`.integrity`    checksums of a checkpoint's files: written from memory, checked as read
* :mod:`.ownership`    a ``--save`` directory belongs to one run: a lock and an ownership record
* :mod:`.resume`       where a run starts from ``--load``: Megatron's resume, ``--no-load-optim``,
                       ``--no-load-rng`` and ``--finetune``
* :mod:`.api_state`    checkpoints of a ``hybrid.initialize`` engine: the script's format, plus
                       the engine's counters and schedule
* :mod:`.client_state` an API checkpoint's ``client_state``: picklable values, loaded back safely
* :mod:`.module_state` an API checkpoint's frozen parameters and persistent buffers, by name
* :mod:`.full_model`   a whole checkpoint as one single-process model (TP 1), for generation
                       and export checks
* :mod:`.peers`        other frameworks' checkpoints (DeepSpeed, Megatron-LM, DCP): imported
                       with their optimizer state, and written back
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
