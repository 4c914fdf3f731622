"""DeepSpeed's module layout over hybrid's engine: ``import hybrid.deepspeed as deepspeed``.

    import hybrid.deepspeed as deepspeed           # the one line a DeepSpeed script changes
    parser = deepspeed.add_config_arguments(argparse.ArgumentParser())
    args = parser.parse_args()                     # --deepspeed --deepspeed_config ds.json
    engine, optimizer, loader, sched = deepspeed.initialize(args=args, model=net,
                                                            model_parameters=net.parameters())

What is here runs on :func:`hybrid.initialize`'s engine (one engine, not a second
implementation): :func:`initialize` with DeepSpeed's signature,
:func:`add_config_arguments`, :func:`init_distributed`, and the submodules ``zero``
(``Init``, ``GatheredParameters``), ``comm``, ``accelerator`` (``get_accelerator``, also
at the top as DeepSpeed has it), ``checkpointing`` and ``pipe`` (``PipelineModule``,
``LayerSpec``, ``TiedLayerSpec``: a model as a list of layers on hybrid's pipeline, its
engine's ``train_batch``), ``utils`` (``RepeatingLoader``, ``logger``, ``log_dist``, the
``safe_get_full_*`` readers, ``zero_to_fp32``), ``runtime`` (``utils``,
``lr_schedules``) and ``ops.adam`` (``FusedAdam``, ``DeepSpeedCPUAdam``).
docs/deepspeed.md has the table: each name "same", "mapped" (what it becomes) or
"refused" (what to use instead). A DeepSpeed name that is not here is an AttributeError
that says so, and what hybrid cannot honour (a client optimizer with the optimizer on
NVMe, ...) is one ConfigError naming the call and what to use instead.

* :mod:`.door`          ``deepspeed.initialize`` and ``deepspeed.add_config_arguments`` over
                        hybrid's engine
* :mod:`.accelerator`   ``get_accelerator()``: the device calls training scripts make
* :mod:`.comm`          the collectives a training script calls, over torch.distributed
* :mod:`.zero`          DeepSpeed's two ZeRO-3 context managers (``Init``,
                        ``GatheredParameters``), over hybrid's
* :mod:`.checkpointing` activation checkpointing called from a model's forward
* :mod:`.pipe`          a model as a list of layers (``PipelineModule``), cut into pipeline stages
* :mod:`.pipe_engine`   the pipeline engine's verbs over hybrid's pipeline: ``train_batch``,
                        ``eval_batch``
* :mod:`.utils`         ``RepeatingLoader``, ``logger``, ``log_dist``, the ZeRO-partitioned
                        values gathered (``safe_get_full_fp32_param``, ...), ``zero_to_fp32``
* :mod:`.runtime`       ``runtime.utils`` (``set_random_seed``, ``see_memory_usage``) and
                        ``runtime.lr_schedules`` (the scheduler classes) over hybrid's
* :mod:`.ops`           ``ops.adam``: ``FusedAdam`` and ``DeepSpeedCPUAdam`` as torch's Adam(W)
* :mod:`.moe`           ``moe.layer.MoE`` (DeepSpeed's MoE layer, experts over an EP group)
                        and ``moe.utils``' expert and parameter-group helpers
* :mod:`.missing`       a DeepSpeed name hybrid does not serve, refused in hybrid's words
                        (AttributeError, or ImportError for ``from X import Y``)
* :mod:`.hf`            Hugging Face's Trainer on hybrid's engine: a Trainer script changes
                        its import only
* :mod:`.launcher`      ``hybrid-deepspeed``: DeepSpeed's launcher command line over torchrun,
                        the script run with no line changed
* :mod:`.alias`         ``deepspeed`` and its submodules served by this package, in one
                        worker's process (an import hook)
* :mod:`.__main__`      ``python -m hybrid.deepspeed``: the launcher

``deepspeed.zero`` is :mod:`hybrid.deepspeed.zero`, DeepSpeed's context managers;
hybrid's own ZeRO engine is :mod:`hybrid.zero`, which a script never meets.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from hybrid.deepspeed.missing import refuse

if TYPE_CHECKING:  # (what the names below resolve to, for the type checker)
    from hybrid.deepspeed import (
        accelerator,
        checkpointing,
        comm,
        moe,
        ops,
        pipe,
        runtime,
        utils,
        zero,
    )
    from hybrid.deepspeed.accelerator import get_accelerator
    from hybrid.deepspeed.comm import init_distributed
    from hybrid.deepspeed.door import add_config_arguments, initialize
    from hybrid.deepspeed.pipe import PipelineModule
    from hybrid.deepspeed.pipe_engine import PipelineEngine
    from hybrid.engine.api import Engine as DeepSpeedEngine

__all__ = ["DeepSpeedEngine", "PipelineEngine", "PipelineModule", "accelerator",
           "add_config_arguments", "checkpointing", "comm", "get_accelerator",
           "init_distributed", "initialize",
           "moe", "ops", "pipe", "runtime", "utils", "zero"]

# [Note: imported on first use]
# The launcher (``python -m hybrid.deepspeed``, ``hybrid-deepspeed``) is a submodule of
# this package, so importing it runs this file first; it stays free of torch (about 2.5 s
# of one core, before torchrun starts the workers, which import torch themselves) because
# the names here are imported when a script first reaches for them, as DeepSpeed's
# ``deepspeed.zero`` or ``deepspeed.initialize``.
_SUBMODULES = frozenset(("accelerator", "checkpointing", "comm", "moe", "ops", "pipe",
                         "runtime", "utils", "zero"))
_NAMES = {"get_accelerator": ("accelerator", "get_accelerator"),
          "init_distributed": ("comm", "init_distributed"),
          "add_config_arguments": ("door", "add_config_arguments"),
          "initialize": ("door", "initialize"),
          "PipelineModule": ("pipe", "PipelineModule"),
          "PipelineEngine": ("pipe_engine", "PipelineEngine")}


# DeepSpeed names a script may reach for that hybrid does not have: name -> what instead
_NOT_HERE = {
    "init_inference": "hybrid trains; for generation load a checkpoint with "
                      "scripts/generate.py, or run the module itself",
    "monitor": "hybrid's engine writes no monitor events: log the loss and engine.get_lr() "
               "with torch.utils.tensorboard yourself (pretrain_gpt.py writes TensorBoard "
               "from the ds_config's tensorboard block)",
    "profiling": "hybrid has no flops profiler: count a model's FLOPs with "
                 "torch.utils.flop_counter.FlopCounterMode (pretrain_gpt.py logs TFLOP/s "
                 "per rank, --log-throughput)",
    "DeepSpeedTransformerLayer": "build the layer from torch or transformers modules",
    "DeepSpeedConfig": "pass the ds_config (a path or a dict) to initialize(config=...)",
    "replace_transformer_layer": "hybrid injects no kernels into a model",
    "add_tuning_arguments": "hybrid has no autotuner",
    "module_inject": "hybrid injects no kernels into a model",
}


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f"hybrid.deepspeed.{name}")
    if name in _NAMES:
        module, attr = _NAMES[name]
        value = getattr(importlib.import_module(f"hybrid.deepspeed.{module}"), attr)
        globals()[name] = value  # (once)
        return value
    if name == "DeepSpeedEngine":
        from hybrid.engine.api import Engine
        return Engine
    return refuse("", name, _NOT_HERE.get(
        name, "it is not one of DeepSpeed's names hybrid serves yet"))


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
