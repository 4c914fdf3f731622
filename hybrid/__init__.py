"""hybrid: Megatron-style tensor parallelism with ZeRO data parallelism for GPT training.

``hybrid.initialize(model=..., config=...)`` is the library door (DeepSpeed's verbs on any
``nn.Module``: :mod:`hybrid.engine.api`); it is imported on first use, so ``import
hybrid.config`` (the launcher's preflight) stays free of torch.

The packages, bottom up (tests/test_layout.py holds the order):

* :mod:`.errors`          errors a user can act on; each message names the flag or file to change
* :mod:`.diagnostics`     when something goes wrong on many ranks, say where
* :mod:`.parallel`        where each rank sits and how ranks talk
* :mod:`.config`          the run's configuration, torch-free: Megatron flags -> checked,
                          frozen sections
* :mod:`.kernels`         fused kernels from ``csrc/`` with their exact PyTorch fallbacks
* :mod:`.data`            tokenizer -> token stream -> fixed-length samples -> micro-batches
* :mod:`.estimate`        bytes before the cluster, torch-free: what a layout holds and moves
* :mod:`.tensor_parallel` tensor (intra-layer) parallelism: Megatron's layers and the ops
                          joining them
* :mod:`.recompute`       ZeRO-R activation checkpointing, applied to blocks from outside
* :mod:`.zero`            ZeRO-DP over the data-parallel group: stages 0-3, from outside
* :mod:`.pipeline`        pipeline parallelism: the model cut into stages over the PP group
* :mod:`.checkpoint`      sharded, atomic, layout-independent checkpoints
* :mod:`.hf`              Hugging Face names and layouts, as pure tensor functions
* :mod:`.train`           the training loop and what only it uses
* :mod:`.engine`          ``hybrid.initialize``'s engine: DeepSpeed's verbs on any ``nn.Module``
* :mod:`.testing`         what tests and benchmarks use; nothing in the library imports it
* :mod:`.deepspeed`       DeepSpeed's module layout over hybrid's engine
                          (``import hybrid.deepspeed as deepspeed``)
"""

__version__ = "0.1.0"


def __getattr__(name):
    if name == "initialize":
        from hybrid.engine import build
        return build.initialize
    if name == "Engine":
        from hybrid.engine import api
        return api.Engine
    if name in ("zero_init", "GatheredParameters"):
        from hybrid.engine import zero_context
        return getattr(zero_context, name)
    raise AttributeError(f"module 'hybrid' has no attribute {name!r}")
