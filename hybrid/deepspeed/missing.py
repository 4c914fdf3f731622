"""A DeepSpeed name ``hybrid.deepspeed`` does not serve, refused in hybrid's words.

Each served module's ``__getattr__`` ends in :func:`refuse`: reading the name
(``deepspeed.utils.see_memory``, ``hasattr``) is an AttributeError, and
``from deepspeed.utils import see_memory`` is an ImportError, both saying what to
use instead. (Python turns an AttributeError raised during ``from X import Y``
into its own bare "cannot import name", so the import is told apart and gets the
ImportError itself.) :func:`advice` holds the words for DeepSpeed's modules below
the ones hybrid serves (``deepspeed.runtime.pipe``, ``deepspeed.ops.lamb``, ...), for the
import hook (:mod:`hybrid.deepspeed.alias`: ``from deepspeed.runtime.pipe.topology import
...`` fails at ``deepspeed.runtime.pipe``, the first name not served) and the served
packages' ``__getattr__``.
"""

from __future__ import annotations

import dis
import sys
from types import FrameType
from typing import NoReturn

_IMPORT_FROM = dis.opmap["IMPORT_FROM"]

# DeepSpeed modules below the served ones: dotted name under deepspeed -> what instead.
# The longest prefix of a name asked for answers.
NESTED = {
    "runtime.pipe": "a pipeline is deepspeed.pipe (PipelineModule, LayerSpec, "
                    "TiedLayerSpec; its topology is PP outermost, then DP, as DeepSpeed's "
                    "PipeDataParallelTopology: pass num_stages) and the engine "
                    "initialize returns for it (hybrid.deepspeed.PipelineEngine)",
    "runtime.zero": "ZeRO is the ds_config's zero_optimization block; the context managers "
                    "are deepspeed.zero (Init, GatheredParameters); for the memory "
                    "estimates (estimate_zero3_model_states_mem_needs_*) run "
                    "scripts/estimate_memory.py",
    "runtime.engine": "the engine is what deepspeed.initialize returns "
                      "(hybrid.deepspeed.DeepSpeedEngine)",
    "runtime.config": "pass the ds_config (a path or a dict) to initialize(config=...)",
    "runtime.dataloader": "initialize(training_data=...) gives the loader; "
                          "deepspeed.utils.RepeatingLoader repeats one",
    "runtime.fp16": "fp16 is the ds_config's fp16 block (hybrid's loss scaler)",
    "runtime.bf16_optimizer": "bf16 is the ds_config's bf16 block",
    "runtime.checkpoint_engine": "checkpoints are engine.save_checkpoint / load_checkpoint "
                                 "(hybrid's format)",
    "ops.lamb": "hybrid has no LAMB: use deepspeed.ops.adam.FusedAdam or a torch.optim "
                "optimizer",
    "ops.lion": "hybrid has no fused Lion: pass a torch.optim optimizer",
    "ops.transformer": "build the layer from torch or transformers modules",
    "ops.op_builder": "hybrid builds its own kernels (python -m hybrid.kernels)",
    "ops.sparse_attention": "hybrid's attention is dense (SDPA, flash or fused)",
    "ops.aio": "hybrid's swap I/O is configured by the ds_config's offload blocks",
    "utils.groups": "the process groups are engine.ps (a hybrid ParallelState)",
    "utils.timer": "hybrid times its own steps (wall_clock_breakdown on the log line)",
}


def advice(dotted: str) -> str | None:
    """What to use instead of DeepSpeed's ``deepspeed.<dotted>``, from the longest known
    prefix of ``dotted`` (None: nothing known)."""
    parts = dotted.split(".")
    for n in range(len(parts), 0, -1):
        why = NESTED.get(".".join(parts[:n]))
        if why is not None:
            return why
    return None


def _importing(frame: FrameType | None) -> bool:
    """Whether ``frame`` is executing ``from X import Y`` (the lookup of Y)."""
    if frame is None:
        return False
    code, at = frame.f_code.co_code, frame.f_lasti
    return 0 <= at < len(code) and code[at] == _IMPORT_FROM


def refuse(module: str, name: str, why: str) -> NoReturn:
    """Raise, for ``deepspeed.<module>.<name>`` (``module`` "" for the top level), hybrid's
    message with ``why`` (what to use instead): an ImportError when the caller of the
    module's ``__getattr__`` is importing the name, else an AttributeError. Call it from
    a module-level ``__getattr__`` only (it reads the frame two up)."""
    ours = "hybrid.deepspeed" + (f".{module}" if module else "")
    theirs = "deepspeed" + (f".{module}" if module else "")
    message = (f"{ours} has no {name!r} (DeepSpeed's {theirs}.{name}): {why}; "
               f"docs/deepspeed.md lists what it serves")
    if _importing(sys._getframe(2)):
        raise ImportError(message, name=ours)
    raise AttributeError(message, name=name)
