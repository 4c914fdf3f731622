"""``TrainingArguments`` whose ``deepspeed=`` hybrid's engine reads, not DeepSpeed.

transformers' own ``TrainingArguments(deepspeed=...)`` hands the config to accelerate's
DeepSpeed plugin as it is built: it imports DeepSpeed, starts DeepSpeed's process
group and marks the run for DeepSpeed's engine, and a model built afterwards is
partitioned by DeepSpeed's ``zero.Init``. This subclass keeps the field as written and
takes it away from all of that: the run is an ordinary multi-process accelerate run
(its data sharding, metric gathering and logging serve the Trainer as they are), and
:class:`hybrid.deepspeed.hf.Trainer` builds hybrid's engine from the config when
training starts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator
from functools import cached_property

import torch
import transformers

from hybrid.deepspeed.hf import auto
from hybrid.errors import ConfigError


def _processes() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


@dataclasses.dataclass
class TrainingArguments(transformers.TrainingArguments):
    """transformers' TrainingArguments; with ``deepspeed=`` (a ds_config path or dict)
    the run trains on hybrid's ZeRO engine under :class:`hybrid.deepspeed.hf.Trainer`.

    ``deepspeed`` keeps the value given. ``hybrid_ds_config`` is a copy of the config
    with the ``"auto"`` values TrainingArguments decides filled in
    (:mod:`hybrid.deepspeed.hf.auto`; the rest when training starts), or None without
    ``deepspeed``. Without ``deepspeed`` this is transformers' class unchanged.

    With ``deepspeed``: accelerate does no mixed precision (the engine keeps the model
    in fp16/bf16 itself, from the config's filled ``fp16``/``bf16`` blocks); on a
    machine without CUDA a job of several processes (torchrun's ``WORLD_SIZE``) joins
    accelerate's CPU process group (gloo), as DeepSpeed's does without ``use_cpu``;
    ``auto_find_batch_size`` is refused (the engine's batch size is fixed when it is
    built). ``kernel_cache_dir`` (hybrid's own): where hybrid's compiled kernels (the
    host optimizer's CPU Adam) are built and cached; None: ``$HYBRID_KERNEL_CACHE``, else
    ``$TORCH_EXTENSIONS_DIR/hybrid``, else ``~/.cache/hybrid/kernels``.
    """

    kernel_cache_dir: str | None = dataclasses.field(default=None, metadata={
        "help": "where hybrid's compiled kernels are built and cached (default: "
                "$HYBRID_KERNEL_CACHE, else $TORCH_EXTENSIONS_DIR/hybrid, else "
                "~/.cache/hybrid/kernels)"})
    hybrid_ds_config: dict | None = dataclasses.field(default=None, init=False, repr=False)
    hybrid_ds_filler: auto.Filler | None = dataclasses.field(default=None, init=False,
                                                             repr=False)

    def __post_init__(self) -> None:
        self.hybrid_ds_config = self.hybrid_ds_filler = None
        # read by the device setup, which runs inside the post-init with deepspeed hidden
        self._on_hybrid = bool(self.deepspeed)
        with self._deepspeed_hidden():
            super().__post_init__()
        if not self._on_hybrid:
            return
        if self.auto_find_batch_size:
            raise ConfigError("TrainingArguments(deepspeed=..., auto_find_batch_size=True): "
                              "hybrid's engine fixes its batch size when it is built; set "
                              "per_device_train_batch_size and auto_find_batch_size=False")
        # the engine casts the model to the config's dtype and scales the loss itself: an
        # accelerate autocast or GradScaler on top would do it twice
        self.mixed_precision = "no"
        assert self.deepspeed is not None  # (_on_hybrid)
        self.hybrid_ds_config = auto.read(self.deepspeed)
        self.hybrid_ds_filler = auto.Filler(self.hybrid_ds_config)
        auto.fill_from_arguments(self.hybrid_ds_filler, self)

    @contextlib.contextmanager
    def _deepspeed_hidden(self) -> Iterator[dict | str | None]:
        """``deepspeed`` reads None inside (transformers' post-init and device setup build
        DeepSpeed's plugin and process group from it), and is as given again after."""
        given = self.deepspeed
        self.deepspeed = None
        try:
            yield given
        finally:
            self.deepspeed = given

    @cached_property
    def _setup_devices(self) -> torch.device:
        # the uncached body of transformers' property
        setup = vars(transformers.TrainingArguments)["_setup_devices"].func
        if not getattr(self, "_on_hybrid", False):
            return setup(self)
        use_cpu = self.use_cpu
        # accelerate counts the processes of a CUDA-less job only when told to use the CPU
        # (else every rank is a job of one); hybrid's engine runs gloo there
        if not torch.cuda.is_available() and _processes() > 1:
            self.use_cpu = True
        try:
            with self._deepspeed_hidden():
                return setup(self)
        finally:
            self.use_cpu = use_cpu
