"""Other frameworks' checkpoints: read them in (with their optimizer state) and write them back.

* :mod:`.base`       :class:`~.base.PeerCheckpoint`, what every reader provides
* :mod:`.importing`  a peer checkpoint written as a hybrid one, which ``--load`` then reads
                     at any layout (:func:`~.importing.import_peer`)
* :mod:`.deepspeed`  DeepSpeed ZeRO 0-3 (``global_stepN/``) and its universal format, read
                     with the optimizer state
* :mod:`.deepspeed_pipe` DeepSpeed pipeline (PipelineModule) checkpoints: layer files and
                     per-stage optimizer state, in the loading PipelineModule's names
* :mod:`.deepspeed_gptpipe` Megatron-DeepSpeed's GPT (GPTModelPipe) pipeline checkpoints,
                     in hybrid's GPT names (``pretrain_gpt.py --load``)
* :mod:`.deepspeed_files` DeepSpeed's files: names, pickles read without DeepSpeed, the
                     flat partitions' layout
* :mod:`.deepspeed_bf16` DeepSpeed's bf16 saves: file names, BF16_Optimizer's partitions,
                     the fp32 masters without ZeRO
* :mod:`.deepspeed_names` a DeepSpeed checkpoint's names -> hybrid's (GPT-2, Llama, Qwen2
                     through the Hugging Face import's tables)
* :mod:`.deepspeed_export` the way back: a hybrid checkpoint as DeepSpeed's ZeRO 0-3 files, bf16 too
* :mod:`.megatron`   Megatron-LM ``torch_dist`` (and the legacy ``torch`` format): detect,
                     open, write back
* :mod:`.megatron_args` Megatron-LM's ``args`` read against the run's flags
* :mod:`.megatron_dist` Megatron-LM's ``torch_dist`` iterations read
* :mod:`.megatron_distopt_export` the way back for megatron-core's DistributedOptimizer:
                     its ``dp_reshardable`` buckets or ``fully_reshardable`` state
* :mod:`.megatron_moe_export` the way back for a mixture of experts: megatron-core's
                     chained dense and expert optimizers, its MoE args
* :mod:`.megatron_legacy` Megatron-LM's legacy ``torch`` format (``mp_rank_XX/``) read
* :mod:`.megatron_files` Megatron's torch files (data only) and torch DCP's chunks, on one
                     process
* :mod:`.megatron_names` megatron-core's GPTModel names and layouts <-> hybrid's
* :mod:`.dcp`        torch DCP as torchtitan writes it (FSDP2 / TP DTensors)
* :mod:`.dcp_export` the way back: a hybrid checkpoint as torchtitan's DCP ``step-N/``
* :mod:`.spill`      tensors parked in mapped scratch files, for the exports' writers

:func:`open_peer` finds which format a directory holds (or takes the one a flag names)
and opens it (a DeepSpeed save of Megatron-DeepSpeed's GPTModelPipe with
:mod:`.deepspeed_gptpipe`, which knows its layer files); each format module has
``detect(path) -> bool``, ``open(path) -> PeerCheckpoint`` and ``write(...)`` (the way
back, :mod:`scripts.convert_checkpoint`).
"""

from __future__ import annotations

import importlib

from hybrid.checkpoint.peers.base import PeerCheckpoint
from hybrid.errors import CheckpointError

# format name (--load-format) -> its module; detection tries them in this order
FORMATS = {"deepspeed": "hybrid.checkpoint.peers.deepspeed",
           "megatron": "hybrid.checkpoint.peers.megatron",
           "dcp": "hybrid.checkpoint.peers.dcp"}


def _module(fmt: str):
    if fmt not in FORMATS:
        raise CheckpointError(f"--load-format {fmt}: not a checkpoint format hybrid reads "
                              f"(hybrid, {', '.join(FORMATS)})")
    try:
        return importlib.import_module(FORMATS[fmt])
    except ModuleNotFoundError as e:  # a format whose reader is not there
        if e.name != FORMATS[fmt]:
            raise
        raise CheckpointError(f"--load-format {fmt}: hybrid does not read this format yet"
                              ) from None


def detect_peer(path: str) -> str | None:
    """The peer format ``path`` holds (a :data:`FORMATS` key), or None."""
    for fmt, name in FORMATS.items():
        try:
            mod = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name != name:
                raise
            continue
        if mod.detect(path):
            return fmt
    return None


def open_peer(path: str, fmt: str | None = None, step: int | None = None) -> PeerCheckpoint:
    """The peer checkpoint under ``path`` (its newest iteration, or iteration ``step``),
    opened in format ``fmt`` (None: detected). CheckpointError naming the file and what
    is wrong when it is not one, or one of an unsupported version."""
    fmt = fmt or detect_peer(path)
    if fmt is None:
        raise CheckpointError(f"{path}: not a checkpoint of a format hybrid reads "
                              f"(hybrid, {', '.join(FORMATS)})")
    try:
        if fmt == "deepspeed":  # Megatron-DeepSpeed's GPT (GPTModelPipe): pipeline files
            from hybrid.checkpoint.peers import deepspeed_gptpipe
            peer = deepspeed_gptpipe.open_if_gpt_pipe(path, step)
            if peer is not None:
                return peer
        return _module(fmt).open(path, step=step)
    except CheckpointError:
        # a format forced (--load-format) on another format's checkpoint: say so, not
        # which of the forced format's files is missing
        other = detect_peer(path)
        if other is None or other == fmt:
            raise
        raise CheckpointError(f"--load-format {fmt}: {path} holds a {other} checkpoint, not "
                              f"a {fmt} one: give --load-format {other} or auto") from None


__all__ = ["FORMATS", "PeerCheckpoint", "detect_peer", "open_peer"]
