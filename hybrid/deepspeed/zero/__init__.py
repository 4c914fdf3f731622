"""``deepspeed.zero``: DeepSpeed's two ZeRO-3 context managers, over hybrid's.

    torch.manual_seed(1234)                      # the same on every rank
    with deepspeed.zero.Init():                  # hybrid.zero_init(): each rank keeps its part
        model = MyModel()
    engine, *_ = deepspeed.initialize(model=model, config=ds)   # the engine takes the parts
    with deepspeed.zero.GatheredParameters(model.head.weight, modifier_rank=0):
        model.head.weight.zero_()                # full values inside; rank 0's kept

This package is DeepSpeed's ``deepspeed.zero`` names only; hybrid's ZeRO engine
itself is :mod:`hybrid.zero`. A model built under :class:`Init` keeps what its
constructors write into its parameters (``nn.init.normal_`` in ``__init__``, a
parent's ``self.fc.weight.data.zero_()``, a ``GatheredParameters`` block with a
``modifier_rank``), and each rank holds only its part of a parameter once the
constructor of its module has returned ([Note: building under zero_init] in
:mod:`hybrid.engine.zero_build`).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, NoReturn

import torch
from torch import nn

from hybrid.deepspeed.comm import init_distributed
from hybrid.engine.zero_context import GatheredParameters as _gathered, zero_init
from hybrid.errors import ConfigError

if TYPE_CHECKING:
    import torch.distributed as dist

    from hybrid.parallel.comm import CommGroup

__all__ = ["GatheredParameters", "Init"]


class Init:
    """``with deepspeed.zero.Init(): model = ...`` -- :func:`hybrid.zero_init`.

    Like DeepSpeed's, it joins torchrun's job first (:func:`hybrid.deepspeed.init_distributed`)
    and cuts over the data-parallel ranks: ``data_parallel_group`` (a ProcessGroup), or
    ``mpu``'s (a ParallelState, or an object with ``get_data_parallel_group()``), else
    the world -- the ranks of the engine's data-parallel group. Unlike DeepSpeed's, the
    ranks do not broadcast rank 0's values: every rank draws them, so seed every rank
    the same before building (``initialize`` refuses ranks that drew differently).
    Where the shards live and in what dtype is the config's (``initialize`` reads
    ``zero_optimization.offload_param`` and the fp16/bf16 blocks), so
    ``remote_device``, ``pin_memory``, ``config_dict_or_path``/``config`` and
    ``dtype`` are accepted and left to it; parameters are made where the model's
    constructors make them. ``enabled=False`` builds the model as usual. ``module=``
    (partition a model already built) and quantized weights are refused with what
    to do instead.
    """

    def __init__(self, module: nn.Module | None = None,
                 data_parallel_group: dist.ProcessGroup | CommGroup | None = None,
                 mem_efficient_linear: bool = True, remote_device: str | None = None,
                 pin_memory: bool = False,
                 config_dict_or_path: str | os.PathLike | Mapping | None = None,
                 config: str | os.PathLike | Mapping | None = None, enabled: bool = True,
                 dtype: torch.dtype | None = None, mpu: object = None,
                 zero_param_parallel_group: dist.ProcessGroup | None = None,
                 zero_quantized_weights: bool = False,
                 zero_quantized_nontrainable_weights: bool = False,
                 sequence_data_parallel_group: dist.ProcessGroup | None = None,
                 param_swapper: object = None):
        if module is not None:
            raise ConfigError("deepspeed.zero.Init(module=...): hybrid shards a built model "
                              "when initialize() wraps it; pass the model to initialize() "
                              "as it is, or build it inside `with deepspeed.zero.Init():`")
        if zero_quantized_weights or zero_quantized_nontrainable_weights:
            raise ConfigError("deepspeed.zero.Init(zero_quantized_weights=...): hybrid "
                              "communicates parameters in the training dtype; drop it")
        if param_swapper is not None:
            raise ConfigError("deepspeed.zero.Init(param_swapper=...): hybrid's NVMe tier is "
                              "configured by zero_optimization.offload_param; drop it")
        self.enabled = enabled
        self.group = data_parallel_group
        if self.group is None and mpu is not None:
            get = getattr(mpu, "get_data_parallel_group", None)
            self.group = get() if get is not None else getattr(mpu, "dp_cp_group", None)
        self._stack: contextlib.ExitStack | None = None

    def __enter__(self) -> Init:
        self._stack = contextlib.ExitStack()
        if self.enabled:
            init_distributed()  # (nothing when joined, or for one process)
            self._stack.enter_context(zero_init(self.group))
        return self

    def __exit__(self, *exc: object) -> None:
        stack, self._stack = self._stack, None
        if stack is not None:
            stack.close()


def GatheredParameters(params: torch.Tensor | Iterable[torch.Tensor],
                       modifier_rank: int | None = None, fwd_module: nn.Module | None = None,
                       enabled: bool = True) -> contextlib.AbstractContextManager[None]:
    """``with deepspeed.zero.GatheredParameters(params, modifier_rank=0):`` --
    :func:`hybrid.GatheredParameters` (full values inside; ``modifier_rank``'s changes
    kept on every rank and in the fp32 master, or in the parts of a model built under
    :class:`Init`, also inside its ``__init__``). ``fwd_module`` is not needed: stage
    3's gathers follow the modules that run."""
    return _gathered(params, modifier_rank=modifier_rank, enabled=enabled)


def __getattr__(name: str) -> NoReturn:
    raise AttributeError(f"hybrid.deepspeed.zero has no {name!r} (DeepSpeed's deepspeed.zero."
                         f"{name}): it holds Init and GatheredParameters; hybrid's ZeRO is "
                         f"configured by the ds_config's zero_optimization block")
