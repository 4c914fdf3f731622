"""``deepspeed.accelerator.get_accelerator()``: the device calls training scripts make.

    from hybrid.deepspeed.accelerator import get_accelerator
    device = get_accelerator().current_device_name()     # "cuda:0", or "cpu"
    if get_accelerator().is_bf16_supported(): ...

One object per process: a GPU's (CUDA) when torch sees one, else the CPU's, as
hybrid's engine picks its device (``hybrid.parallel.state.init_distributed``).
Only the calls listed in docs/deepspeed.md are here; another is an
AttributeError that says so.
"""

from __future__ import annotations

import contextlib
import os
import resource
import types
from typing import NoReturn

import torch


def _local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


class Accelerator:
    """The calls of DeepSpeed's accelerator object, for CUDA or the CPU."""

    def __init__(self, name: str):
        self._name = name  # "cuda" or "cpu"
        self._cuda = name == "cuda"

    # -- devices --------------------------------------------------------------------
    def device_name(self, device_index: int | None = None) -> str:
        return self._name if device_index is None or not self._cuda else f"cuda:{device_index}"

    def device(self, device_index: int | None = None) -> torch.device:
        return torch.device(self.device_name(device_index))

    def set_device(self, device_index: int) -> None:
        if self._cuda:
            torch.cuda.set_device(device_index)

    def current_device(self) -> int:
        """The device index (a GPU's), or this process's LOCAL_RANK on the CPU."""
        return torch.cuda.current_device() if self._cuda else _local_rank()

    def current_device_name(self) -> str:
        return f"cuda:{torch.cuda.current_device()}" if self._cuda else "cpu"

    def device_count(self) -> int:
        """GPUs on this node; on the CPU, the processes torchrun started on it."""
        if self._cuda:
            return torch.cuda.device_count()
        return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))

    def is_available(self) -> bool:
        return torch.cuda.is_available() if self._cuda else True

    def synchronize(self, device_index: int | None = None) -> None:
        if self._cuda:
            torch.cuda.synchronize(device_index)

    def communication_backend_name(self) -> str:
        return "nccl" if self._cuda else "gloo"

    def is_synchronized_device(self) -> bool:
        return not self._cuda

    # -- dtypes ---------------------------------------------------------------------
    def is_bf16_supported(self) -> bool:
        return torch.cuda.is_bf16_supported() if self._cuda else True

    def is_fp16_supported(self) -> bool:
        return True

    def supported_dtypes(self) -> list[torch.dtype]:
        return [torch.float32, torch.float16] + ([torch.bfloat16]
                                                 if self.is_bf16_supported() else [])

    # -- random numbers -------------------------------------------------------------
    def manual_seed(self, seed: int) -> None:
        if self._cuda:
            torch.cuda.manual_seed(seed)
        else:
            torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        if self._cuda:
            torch.cuda.manual_seed_all(seed)
        else:
            torch.manual_seed(seed)

    def initial_seed(self) -> int:
        return torch.cuda.initial_seed() if self._cuda else torch.initial_seed()

    def get_rng_state(self, device_index: int | None = None) -> torch.Tensor:
        if self._cuda:
            return torch.cuda.get_rng_state(device_index if device_index is not None
                                            else "cuda")
        return torch.get_rng_state()

    def set_rng_state(self, new_state: torch.Tensor, device_index: int | None = None) -> None:
        if self._cuda:
            torch.cuda.set_rng_state(new_state, device_index if device_index is not None
                                     else "cuda")
        else:
            torch.set_rng_state(new_state)

    def random(self) -> types.ModuleType:
        return torch.random

    # -- memory ---------------------------------------------------------------------
    def empty_cache(self) -> None:
        if self._cuda:
            torch.cuda.empty_cache()

    def memory_allocated(self, device_index: int | None = None) -> int:
        """Bytes allocated on the GPU; on the CPU this process's resident set."""
        if self._cuda:
            return torch.cuda.memory_allocated(device_index)
        with contextlib.suppress(OSError, ValueError, IndexError), open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        return 0

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        """Peak bytes on the GPU; on the CPU this process's peak resident set."""
        if self._cuda:
            return torch.cuda.max_memory_allocated(device_index)
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    def memory_reserved(self, device_index: int | None = None) -> int:
        if self._cuda:
            return torch.cuda.memory_reserved(device_index)
        return self.memory_allocated()

    def max_memory_reserved(self, device_index: int | None = None) -> int:
        if self._cuda:
            return torch.cuda.max_memory_reserved(device_index)
        return self.max_memory_allocated()

    def reset_peak_memory_stats(self, device_index: int | None = None) -> None:
        if self._cuda:
            torch.cuda.reset_peak_memory_stats(device_index)

    def reset_max_memory_allocated(self, device_index: int | None = None) -> None:
        self.reset_peak_memory_stats(device_index)

    def total_memory(self, device_index: int | None = None) -> int:
        if self._cuda:
            return torch.cuda.get_device_properties(device_index or 0).total_memory
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        return tensor.pin_memory() if self._cuda else tensor

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == self._name

    # -- profiling marks (no-ops on the CPU) ----------------------------------------
    def range_push(self, msg: str) -> None:
        if self._cuda:
            torch.cuda.nvtx.range_push(msg)

    def range_pop(self) -> None:
        if self._cuda:
            torch.cuda.nvtx.range_pop()

    def __getattr__(self, name: str) -> NoReturn:
        raise AttributeError(f"hybrid's get_accelerator() has no {name!r} (DeepSpeed's "
                             f"accelerator.{name}); docs/deepspeed.md lists the calls it has")


_ACCELERATOR: list[Accelerator] = []  # the one of this process, made on first use


def get_accelerator() -> Accelerator:
    if not _ACCELERATOR:
        _ACCELERATOR.append(Accelerator("cuda" if torch.cuda.is_available() else "cpu"))
    return _ACCELERATOR[0]
