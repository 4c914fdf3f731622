"""What every reader of another framework's checkpoint provides: :class:`PeerCheckpoint`.

A peer checkpoint (DeepSpeed's ``global_stepN/``, Megatron-LM's ``iter_NNNNNNN/``, a
torch DCP directory) is read through one of these, in hybrid's names and hybrid's
full-tensor layout (the fused, per-query-group QKV; SwiGLU's ``fc`` as ``(2, F, C)``;
the padded vocabulary rows as the peer saved them), one parameter at a time, so that
:func:`hybrid.checkpoint.peers.importing.import_peer` can write it as a hybrid checkpoint
that ``--load`` reads at any layout. The name tables are those of :mod:`hybrid.hf`
(and, for Megatron's ``decoder.layers.N...`` names,
:mod:`hybrid.checkpoint.peers.megatron_names`):
one table per model family, shared with the Hugging Face import.

What a reader cannot map (a scheduler of another shape, per-rank RNG streams of another
layout, a data position of another data pipeline) is one line in ``notes``, which the
import logs; it is never silently reset.
"""

from __future__ import annotations

from typing import Protocol

import torch


class PeerCheckpoint(Protocol):
    """One iteration's checkpoint of another framework, opened for reading.

    Attributes:
        format: what it is, for messages ("DeepSpeed ZeRO 2", "Megatron-LM torch_dist").
        path: the iteration's directory (the one a message names).
        iteration: the training iteration it was saved at (the learning rate's position:
            hybrid's schedule is a function of it).
        consumed_samples: samples the run had consumed (0 where the peer does not record
            it: then a line in ``notes`` says so).
        step: the optimizer's step count (Adam's bias correction); 0 with no optimizer state.
        shapes: hybrid parameter name -> full shape, in hybrid's layout.
        columns: which of ``("master", "exp_avg", "exp_avg_sq")`` it holds, in that order:
            ``("master",)`` for weights only.
        flags: the hybrid config flags (``ModelConfig`` flag names, underscores) the
            checkpoint determines, as far as it records them (the load checks the run's
            against these); may be empty.
        vocab_size: the tokenizer's vocabulary size the model was built for, or None.
        notes: one line per thing that does not come over.
        frozen_shapes: the module's frozen parameters (no optimizer state; in no ZeRO
            unit), name -> full shape; {} for a model that trains every parameter.
        excludes_frozen: the save left the frozen parameters' values out (DeepSpeed's
            ``exclude_frozen_parameters``): the loading module keeps its own.
    """

    format: str
    path: str
    iteration: int
    consumed_samples: int
    step: int
    shapes: dict[str, list[int]]
    columns: tuple[str, ...]
    flags: dict
    vocab_size: int | None
    notes: list[str]
    frozen_shapes: dict[str, list[int]]
    excludes_frozen: bool

    def configure(self, config: dict) -> None:
        """Take what the format leaves unrecorded from the run's flat flags ``config`` (a
        DCP checkpoint's head count, which its RoPE rows' order depends on), before any
        :meth:`read`; CheckpointError naming the file when they do not fit its shapes.
        Most formats record all they need: nothing to do."""
        ...

    def read(self, name: str) -> dict[str, torch.Tensor]:
        """``{column: full fp32 tensor of shapes[name]}`` for each of ``columns``."""
        ...

    def untrained(self) -> dict[str, torch.Tensor]:
        """The frozen parameters of ``frozen_shapes`` and the module's persistent buffers,
        whole, by name (what :mod:`hybrid.checkpoint.module_state` puts back); {} when
        the checkpoint's model has neither."""
        ...

    def close(self) -> None:
        """Release open files (mapped tensors)."""
        ...
