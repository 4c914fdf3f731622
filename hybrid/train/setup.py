"""Building what the loop trains: the model on the meta device, recompute, ZeRO, compile.

No rank ever holds the whole model: the GPT is built on the meta device and
:func:`hybrid.zero.apply_zero` draws only what this rank keeps from the
block-seeded init (:class:`hybrid.tensor_parallel.InitValues`).
"""

from __future__ import annotations

import resource
from typing import cast

import torch

from hybrid.config import TrainConfig
from hybrid.config.sections import RecomputeConfig
from hybrid.errors import TrainingError
from hybrid.kernels.attention import check_attention_backend
from hybrid.kernels.dtypes import DTYPES
from hybrid.parallel.state import ParallelState
from hybrid.recompute.checkpointing import apply_activation_checkpointing
from hybrid.tensor_parallel import InitValues, TPRNGTracker
from hybrid.tensor_parallel.cp_attention import ContextParallel
from hybrid.train.compile import compile_blocks
from hybrid.zero import apply_zero
from models.blocks import Block
from models.gpt import GPT

# [Note: host memory on CPU runs] glibc keeps freed activation blocks once its mmap
# threshold has grown: ~0.6 GB per rank for a 302M GPT (hybrid/train/host_memory.py).
# A fixed 1 MiB threshold returns them, at the price of a page fault per large
# allocation: a few percent of a step at that size, but 2.7x the step of the
# 4-layer x 256 default (sys time 17 s against 3 s over 50 steps). So only
# models of this many parameters per TP rank and up get it.
HOST_TRIM_MIN_PARAMS = 100_000_000


def build_model(cfg: TrainConfig, ps: ParallelState, vocab_size: int,
                rng: TPRNGTracker, device: torch.device | str | None = None) -> GPT:
    """The GPT of ``cfg.model`` with the tokenizer's ``vocab_size``, on ``device``
    (default ``ps.device``), initialized from ``--seed``; on "meta" only its shapes
    (ZeRO materializes it: see :func:`build_engine`). Under pipeline parallelism, this
    rank's stage: the layers ``cfg.pipeline.split`` gives it, the embeddings on the
    first, the head and loss on the last; with virtual stages, one range of layers per
    model chunk (the GPT's ``chunks``)."""
    par = cfg.parallel
    cp = (ContextParallel(ps.cp_group, par.cp_comm_type, par.cp_layout) if ps.cp_size > 1
          else None)
    split = cfg.pipeline.split
    layers, first, last = None, True, True
    if split is not None and split.pp > 1:
        r, v = ps.pp_rank, split.vpp
        layers = [split.layer_ids(r, c) for c in range(v)] if v > 1 else split.layer_ids(r)
        first, last = split.holds_embedding(r), split.holds_loss(r, v - 1)
    return GPT(cfg.model.with_vocab_size(vocab_size), ps.tp_group, rng=rng, seed=cfg.seed,
               device=device or ps.device, sequence_parallel=par.sequence_parallel,
               context_parallel=cp, layers=layers, pre_process=first, post_process=last,
               split_backward=cfg.pipeline.schedule == "zb_h1" and layers is not None,
               ep_group=ps.ep_group if ps.ep_size > 1 else None,
               etp_group=ps.etp_group if ps.etp_size > 1 else None,
               dp_group=ps.dp_group if ps.dp_size > 1 else None)


def recompute_targets(model: GPT, rc: RecomputeConfig) -> list[torch.nn.Module]:
    """The modules activation checkpointing wraps: whole blocks (full granularity;
    the first ``rc.num_layers`` with Megatron's block method) or every block's
    attention core (selective: only scores, softmax and dropout are rerun)."""
    return [m for chunk in recompute_chunks(model, rc) for m in chunk]


def recompute_chunks(model: GPT, rc: RecomputeConfig) -> list[list[torch.nn.Module]]:
    """:func:`recompute_targets`, one list per model chunk: as in Megatron, whose chunks
    are blocks of their own, the block method's ``rc.num_layers`` counts each chunk's
    first layers, and the uniform method's groups stay inside a chunk (one chunk
    without interleaving)."""
    chunks = [model.chunk_blocks(c) for c in range(len(model.chunks))]
    if rc.granularity == "selective":
        return [[cast(Block, block).attn.core for block in c] for c in chunks]
    return [c[: rc.num_layers or len(c)] for c in chunks]


def build_engine(cfg: TrainConfig, ps: ParallelState, vocab_size: int, rng: TPRNGTracker):
    """(model, activation checkpointing handle or None, ZeRO engine), in the order the
    wrappers must go on: recompute around the blocks, ZeRO around the model, then
    ``--compile`` of each block's forward."""
    m = cfg.model
    check_attention_backend(m.attention_backend, ps.device, DTYPES[cfg.precision.params_dtype],
                            m.head_size, m.attention_dropout)
    model = build_model(cfg, ps, vocab_size, rng, device="meta")
    model.train()
    rc = cfg.recompute
    ac = (apply_activation_checkpointing(model, ps, rng, rc, chunks=recompute_chunks(model, rc),
                                         split_backward=model.weight_grads is not None)
          if rc.granularity else None)
    # a tied embedding's copies on the first and last stage are summed over the embedding
    # group (one rank, nothing tied, at PP 1)
    tied = () if cfg.model.untie_embeddings_and_output_weights else ("wte.weight",)
    engine = apply_zero(model, ps, cfg.zero, adamw=cfg.adamw, precision=cfg.precision,
                        offload=cfg.offload, values=InitValues(cfg.seed, model.init_of),
                        # interleaved: one backward per chunk (hybrid/zero/parts.py)
                        parts=model.chunk_parameters() if len(model.chunks) > 1 else None,
                        recompute=ac.phase if ac is not None else None, tied=tied)
    model.init_buffers(ps.device)  # (ZeRO drew the parameters; the buffers start here)
    if cfg.model.compile:
        compile_blocks(model.blocks)
    return model, ac, engine


def build_engine_or_explain(cfg: TrainConfig, ps: ParallelState, vocab_size: int,
                            rng: TPRNGTracker):
    """:func:`build_engine`, with running out of memory said as one TrainingError naming
    the flags that size the model instead of an allocator traceback."""
    try:
        return build_engine(cfg, ps, vocab_size, rng)
    except RuntimeError as e:  # torch.OutOfMemoryError is one too; CPU says "allocate"
        if not isinstance(e, torch.OutOfMemoryError) and "allocate" not in str(e):
            raise
        m = cfg.model.with_vocab_size(vocab_size)
        raise TrainingError(
            f"the model ({m.num_parameters(ps.tp_size):,} parameters on each TP rank, padded "
            f"vocabulary {m.padded_vocab_size(ps.tp_size):,}) does not fit in memory: check "
            f"--hidden-size, --num-layers, --make-vocab-size-divisible-by, "
            f"--max-position-embeddings") from e


def memory_bytes(ps: ParallelState) -> tuple[int, int]:
    """(bytes held now, peak so far): allocated device memory on CUDA, RSS on the CPU."""
    if ps.device.type == "cuda":
        return (torch.cuda.memory_allocated(ps.device),
                torch.cuda.max_memory_allocated(ps.device))
    with open("/proc/self/statm", encoding="ascii") as f:
        now = int(f.read().split()[1]) * resource.getpagesize()
    return now, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
