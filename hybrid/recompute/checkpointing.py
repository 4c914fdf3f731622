"""ZeRO-R: activation checkpointing, partitioned across the TP group, optionally on the host.

    ac = apply_activation_checkpointing(model, ps, rng, cfg.recompute)  # after building the model
    loss = model(tokens, labels); loss.backward()              # as before
    ac.peak_bytes(); ac.reset_peak(); ac.allocations           # what the metrics read

Each of the first ``cfg.num_layers`` blocks of ``model.blocks`` (all
by default) keeps only its *input* ``(B, T, C)`` during the forward pass and
runs itself again, with a graph, during backward. With
``cfg.layers_per_checkpoint = N`` (Megatron's ``--recompute-method uniform
--recompute-num-layers N``) the blocks are cut into groups of N consecutive
ones (the last may be shorter): only each group's input is kept, and the whole
group reruns in backward -- 1/N of the stored inputs, for N layers' activations
alive at once during a group's backward.

Under Megatron tensor parallelism every TP rank holds the same copy of a
block's input (the residual stream is replicated), so storing it whole on each
rank is TP-fold redundant. With ``--partition-activations`` each TP rank keeps
only chunk ``tp_rank`` of the flattened input, padded to ``ceil(numel / TP)``
elements, and the chunks are all-gathered over ``ps.tp_group`` into one gather
buffer right before the recompute. ``--cpu-checkpointing`` keeps the stored
chunks in host memory (pinned when the device is CUDA) and copies them back to
the device before the gather; on a CPU-only machine the copy goes to a separate
host buffer, so the same path runs. ``--contiguous-checkpointing`` writes the
chunks into one preallocated buffer with one slot per checkpoint group.

[Note: recompute re-enters the block's __call__]
The wrapper is installed as the block's ``forward`` *instance attribute*: not a
submodule, so parameter names, ``state_dict`` keys and the name-seeded init are
unchanged. In backward the recompute calls ``block(x)`` -- ``Module.__call__``
-- so forward hooks on the block and its submodules fire again; ZeRO-3's
pre-forward hook gathers the block's parameters there (the backward gather of
its 3 Psi budget) and its post-forward hook keeps them, because the recompute
runs inside ``phase.recomputing()`` (:class:`hybrid.recompute.phase.RecomputePhase`, the
explicit signal shared with ZeRO). A per-block flag routes that re-entered
``forward`` straight to the block's own code (``CheckpointedForward.inner``:
under ``--compile`` the compiled forward, which the forward pass ran too; see
[Note: compile inside the checkpoint] in :mod:`hybrid.train.compile`).

[Note: groups without a container]
A group is not a module: the model still calls each block itself, so names,
hooks and ZeRO-3's per-block units stay as they are. The group's first block
stores the input ``x0`` and the RNG state; its other blocks run without a graph
(ZeRO-3 frees each one's parameters after its forward as usual); the last runs
inside one autograd Function whose input is ``x0``, so the gradient of the
group's output goes straight to ``x0``. Its backward reruns every block of the
group through ``Module.__call__`` inside one ``phase.recomputing()``: each
block's pre-forward hook gathers its parameters and none is freed before the
group's backward is done. A block must be called on the output of the block
before it in its group (checked by identity; anything else raises).

[Note: RNG in recompute]
Dropout in the recomputed block must draw the masks of the forward pass. The
forward records the CPU generator, the CUDA generator of the device (on CUDA)
and the TP tracker's states (:meth:`TPRNGTracker.get_states`) it started from;
the recompute sets them, runs, and puts back the states of "now", so the rest
of backward and the next step draw exactly what they would without
checkpointing. The autocast state of the forward is replayed the same way.
A group records the states its first block started from, so the masks of all
its blocks come back.

[Note: recompute in a split backward]
A whole backward reruns the group and backpropagates into it with
``torch.autograd.backward``, so the parameters' gradients go straight to ``.grad``
(and their post-accumulate-grad hooks fire). That is a reentrant backward, which
``torch.autograd.grad`` -- ZB-H1's ``I`` half -- cannot host: it wants every
gradient back, not accumulated. With ``split_backward`` (the model was built for
a split backward) the group's parameters are also inputs of :class:`_Recompute`,
and its backward reruns the group and calls ``torch.autograd.grad`` of the rerun's
output into ``x0`` and those parameters, returning them to the outer traversal
(which keeps them for ``W``, or accumulates them in a plain ``loss.backward()``).
The inner traversal runs inside the ``WeightGradStore.deferring()`` block the
outer one opened, so the rerun's linears defer their weight gradients as usual;
each deferred closure holds the rerun's input to its linear, alive until ``W``.
Without ``split_backward`` nothing changes: no parameter is an input.

The stored inputs and their buffers: :mod:`hybrid.recompute.store`.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import cast

import torch
from torch import nn

from hybrid.config.sections import RecomputeConfig
from hybrid.parallel.state import ParallelState
from hybrid.recompute.phase import RecomputePhase
from hybrid.recompute.store import ALLOCATION_KINDS, CheckpointStore, _Stash
from hybrid.tensor_parallel import TPRNGTracker

__all__ = ["ALLOCATION_KINDS", "ActivationCheckpointing", "CheckpointStore", "CheckpointedForward",
           "apply_activation_checkpointing", "checkpoint_groups"]


class _ForwardState:
    """What a block's forward drew from besides its input and parameters:
    the CPU, device and TP-tracker RNG states, and the autocast setting."""

    def __init__(self, device: torch.device, tracker: TPRNGTracker | None):
        self.device, self.tracker = device, tracker
        self.cpu = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
        self.tracked = tracker.get_states() if tracker is not None else None
        self.autocast = (torch.is_autocast_enabled(device.type),
                         torch.get_autocast_dtype(device.type))

    def restore_rng(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state(self.cuda, self.device)
        if self.tracker is not None and self.tracked is not None:  # (both or neither)
            self.tracker.set_states(self.tracked)

    def autocast_context(self):
        enabled, dtype = self.autocast
        return torch.autocast(self.device.type, dtype=dtype, enabled=enabled)


class _Pending:
    """One forward of a group between its first and its last block: what the
    recompute needs (the forward's RNG/autocast state, the stored input) and the
    group input ``x0`` itself, the tensor the group's gradient flows back to."""

    def __init__(self, x0: torch.Tensor, state: _ForwardState, stash: _Stash):
        self.x0, self.state, self.stash = x0, state, stash
        self.last_out: torch.Tensor | None = None  # output of the block that ran last


class _Group:
    """Consecutive blocks checkpointed together: one stored input, one recompute.

    In forward the model still calls each block itself. The first block records
    the RNG state and stores the group input ``x0`` (slot ``slot`` of the store);
    every block but the last runs without a graph; the last runs inside
    :class:`_Recompute`, whose autograd input is ``x0`` -- so the gradient of the
    group's output flows to ``x0`` and nothing between is held. In backward that
    Function restores ``x0`` and reruns every block of the group with a graph.
    A block of the group must be called on the previous one's output.
    """

    def __init__(self, blocks: list[nn.Module], store: CheckpointStore, slot: int,
                 rng: TPRNGTracker | None, phase: RecomputePhase, split_backward: bool = False):
        self.store, self.slot, self.rng, self.phase = store, slot, rng, phase
        self.split_backward = split_backward
        self.members = [CheckpointedForward(b, self, i) for i, b in enumerate(blocks)]
        self._pending: _Pending | None = None
        # Makes the output require grad when the input does not, so backward
        # still reaches this group's parameters.
        self._anchor = torch.empty(0, requires_grad=True)

    def forward(self, i: int, x: torch.Tensor) -> torch.Tensor:
        """Block ``i`` of the group on ``x`` during a forward with grad enabled."""
        member = self.members[i]
        if i == 0:  # a new forward: anything pending from an aborted one is dropped
            self._pending = _Pending(x, _ForwardState(x.device, self.rng),
                                     self.store.stash(self.slot, x))
        elif self._pending is None or x is not self._pending.last_out:
            raise RuntimeError(
                f"block {i} of a checkpoint group was called on something other than the "
                f"output of block {i - 1}: grouped recompute (--recompute-num-layers > 1 "
                f"with --recompute-method uniform) needs blocks run in order, each on the "
                f"previous one's output")
        p = self._pending
        if i + 1 < len(self.members):
            with torch.no_grad():
                p.last_out = member.inner(member.block, x)
            return p.last_out
        self._pending = None
        anchor = () if p.x0.requires_grad else (self._anchor,)
        if self.split_backward:  # [Note: recompute in a split backward]
            return _Recompute.apply(self, p, x, p.x0, *anchor, *self.parameters())
        return _Recompute.apply(self, p, x, p.x0, *anchor)

    def parameters(self) -> list[torch.Tensor]:
        """The group's parameters that take a gradient, each once, in block order."""
        seen: dict[int, torch.Tensor] = {}
        for m in self.members:
            for q in m.block.parameters():
                if q.requires_grad:
                    seen.setdefault(id(q), q)
        return list(seen.values())

    def recompute(self, x: torch.Tensor) -> torch.Tensor:
        """Every block through ``Module.__call__``, so every module hook fires again."""
        for m in self.members:
            m.recomputing = True
        try:
            with self.phase.recomputing():
                for m in self.members:
                    x = m.block(x)
                return x
        finally:
            for m in self.members:
                m.recomputing = False


class CheckpointedForward:
    """Stands in for ``block.forward``: one tensor in ``(B, T, C)``, one tensor out.

    Under ``no_grad`` (evaluation) or while recomputing it runs ``inner(block, x)``
    (the block's class ``forward`` unless replaced, see
    :func:`hybrid.train.compile.compile_blocks`); otherwise it goes through its
    :class:`_Group`, which runs ``inner`` too, in the forward pass and in the
    recompute alike.
    """

    def __init__(self, block: nn.Module, group: _Group, index: int):
        if "forward" in vars(block):
            raise ValueError(f"{type(block).__name__} already has an instance-level forward "
                             f"(activation checkpointing applied twice, or compiled before "
                             f"it? compile after checkpointing)")
        self._block = weakref.ref(block)  # no block -> wrapper -> block cycle
        self.inner = type(block).forward
        self.group, self.index = group, index
        self.recomputing = False

    @property
    def block(self) -> nn.Module:
        block = self._block()
        assert block is not None  # (a live block holds this wrapper: it calls it)
        return block

    # Never traced under --compile (see exclude_from_compile below).
    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.recomputing or not torch.is_grad_enabled():
            return self.inner(self.block, x)
        return self.group.forward(self.index, x)


def exclude_from_compile() -> None:
    """Make :class:`CheckpointedForward` a graph break for torch.compile (idempotent).

    When a compiled forward around a checkpointed module (selective recompute under
    --compile) reaches it, dynamo then breaks the graph there and runs it eagerly: its
    RNG-state capture, the stash into the store and the autograd Function whose
    backward reruns the block are side effects a graph must not capture or replay.
    Called by --compile only: torch.compiler.disable imports torch._dynamo.
    """
    call = CheckpointedForward.__call__
    if not getattr(call, "_hybrid_excluded", False):
        call = torch.compiler.disable(call)
        call._hybrid_excluded = True
        # patched once, lazily, not declared so: torch.compiler.disable imports dynamo
        CheckpointedForward.__call__ = call  # type: ignore[method-assign]


class _Recompute(torch.autograd.Function):
    """forward: run a group's last block without a graph; its stored input and RNG
    state come in ``pending``, and its autograd input is the group input ``x0``.
    backward: restore ``x0`` (all-gather over the TP group when partitioned) and the
    forward's RNG, rerun the whole group with a graph, backpropagate ``dy`` through it.

    Parameter gradients reach ``param.grad`` through that inner backward, so
    post-accumulate-grad hooks (ZeRO's reductions) fire as usual.
    """

    @staticmethod
    def forward(ctx, group: _Group, pending: _Pending, x: torch.Tensor, x0: torch.Tensor,
                *extra):
        # extra: the anchor (when x0 takes no gradient), then, in a split backward, the
        # group's parameters
        n_params = len(extra) - (0 if x0.requires_grad else 1) if group.split_backward else 0
        ctx.params = extra[len(extra) - n_params:]
        ctx.group, ctx.n_anchor = group, len(extra) - n_params
        ctx.x_requires_grad = x0.requires_grad
        ctx.state, ctx.stash = pending.state, pending.stash
        last = group.members[-1]
        return last.inner(last.block, x)  # grad mode is off inside Function.forward

    @staticmethod
    def backward(ctx, dy):
        if ctx.group.split_backward:
            return _Recompute.backward_split(ctx, dy)
        if not torch.autograd._is_checkpoint_valid():
            raise RuntimeError("activation checkpointing supports loss.backward(), not "
                               "torch.autograd.grad(...) or backward(inputs=...)")
        x, y = _Recompute.rerun(ctx)
        if y.requires_grad:
            torch.autograd.backward(y, dy)
        dx = x.grad if ctx.x_requires_grad else None
        return (None, None, None, dx) + (None,) * ctx.n_anchor

    @staticmethod
    def rerun(ctx) -> tuple[torch.Tensor, torch.Tensor]:
        """(the group's input restored from its checkpoint, its output recomputed under
        the forward's RNG and autocast state); the stash is let go."""
        group, stash = ctx.group, ctx.stash
        ctx.stash = None
        x = group.store.restore(stash).detach().requires_grad_(ctx.x_requires_grad)
        now = _ForwardState(x.device, group.rng)
        ctx.state.restore_rng()
        try:
            with torch.enable_grad(), ctx.state.autocast_context():
                y = group.recompute(x)
        finally:
            now.restore_rng()
        return x, y

    @staticmethod
    def backward_split(ctx, dy):
        """The recompute as one ``torch.autograd.grad`` into ``x0`` and the group's
        parameters, returned to the outer traversal ([Note: recompute in a split
        backward])."""
        params, ctx.params = ctx.params, None
        x, y = _Recompute.rerun(ctx)
        wanted = ([x] if ctx.x_requires_grad else []) + list(params)
        got: tuple = (None,) * len(wanted)
        if y.requires_grad and wanted:
            got = torch.autograd.grad(y, wanted, dy, allow_unused=True)
        dx = got[0] if ctx.x_requires_grad else None
        dparams = got[len(wanted) - len(params):]
        return (None, None, None, dx) + (None,) * ctx.n_anchor + tuple(dparams)


class ActivationCheckpointing:
    """Handle returned by :func:`apply_activation_checkpointing`: bytes and counters.

    Bytes are this rank's (with partitioning, its 1/TP chunks).
    """

    def __init__(self, store: CheckpointStore, groups: list[_Group], phase: RecomputePhase):
        self.store, self._groups = store, groups
        self.phase = phase  # set during every recompute; give it to apply_zero

    @property
    def blocks(self) -> list[nn.Module]:
        """The checkpointed blocks, in order."""
        return [b for g in self.groups for b in g]

    @property
    def groups(self) -> list[list[nn.Module]]:
        """The checkpoint groups, in order: each stores one input and reruns together."""
        return [[m.block for m in g.members] for g in self._groups]

    def stored_bytes(self) -> int:
        """Checkpoint bytes held now (between a forward and its backward)."""
        return self.store.stored_bytes()

    def peak_bytes(self) -> int:
        """Most checkpoint bytes held at once since the last :meth:`reset_peak`."""
        return self.store.peak_bytes()

    def reset_peak(self) -> None:
        self.store.reset_peak()

    def buffer_bytes(self) -> int:
        """Long-lived buffers: gather, staging, contiguous slots (allocated once)."""
        return self.store.buffer_bytes()

    @property
    def allocations(self) -> dict:
        """Buffer allocations so far, by kind (see :class:`CheckpointStore`)."""
        return dict(self.store.allocations)

    def remove(self) -> None:
        """Give the blocks their own forward back (checkpoints held so far stay valid)."""
        for g in self._groups:
            for w in g.members:
                if w.block is not None and vars(w.block).get("forward") is w:
                    del w.block.forward


def checkpoint_groups(blocks: list[nn.Module], layers_per_checkpoint: int
                      ) -> list[list[nn.Module]]:
    """``blocks`` cut into runs of ``layers_per_checkpoint`` consecutive blocks (the
    last run may be shorter): Megatron's uniform method with --recompute-num-layers."""
    if layers_per_checkpoint < 1:
        raise ValueError(f"layers_per_checkpoint must be >= 1, got {layers_per_checkpoint}")
    n = layers_per_checkpoint
    return [blocks[i: i + n] for i in range(0, len(blocks), n)]


def apply_activation_checkpointing(model: nn.Module, ps: ParallelState,
                                   rng: TPRNGTracker | None, cfg: RecomputeConfig,
                                   blocks: list[nn.Module] | None = None,
                                   phase: RecomputePhase | None = None,
                                   chunks: list[list[nn.Module]] | None = None,
                                   split_backward: bool = False
                                   ) -> ActivationCheckpointing:
    """Checkpoint ``blocks`` (default: ``model.blocks[:cfg.num_layers]``, all when
    that is None) in place, following ``cfg.layers_per_checkpoint``,
    ``cfg.partition_activations``, ``cfg.cpu_checkpointing`` and
    ``cfg.contiguous_checkpointing``.

    Consecutive ``blocks`` form groups of ``cfg.layers_per_checkpoint`` (see
    :func:`checkpoint_groups`); each group stores only its first block's input
    (one store slot per group) and reruns all its blocks in backward. The blocks
    of a group must run in order, each on the previous one's output.
    Each block must map one tensor ``(B, T, C)``, replicated over ``ps.tp_group``,
    to one tensor. ``rng`` is the tracker whose states the recompute replays.
    ``phase`` is set around every recompute (a new one if not given; it is
    ``handle.phase``): pass the same object to ``apply_zero(..., recompute=)``.
    ``chunks``, instead of ``blocks``: the blocks in runs that the model runs apart
    (an interleaved pipeline rank's model chunks): groups are made within each run,
    none crossing from one to the next.
    ``split_backward``: the model's backwards are split into input and weight halves
    (ZB-H1's ``I`` runs ``torch.autograd.grad``): the recompute then returns its
    parameters' gradients to the outer traversal instead of accumulating them
    ([Note: recompute in a split backward]).
    Names of parameters and ``state_dict`` keys do not change; apply before or
    after ZeRO.
    """
    if chunks is not None:
        runs = [g for c in chunks for g in checkpoint_groups(list(c), cfg.layers_per_checkpoint)]
    else:
        if blocks is None:
            every = list(cast("Iterable[nn.Module]", model.blocks))  # (its transformer blocks)
            blocks = every[: cfg.num_layers or len(every)]
        runs = checkpoint_groups(list(blocks), cfg.layers_per_checkpoint)
    phase = phase or RecomputePhase()
    store = CheckpointStore(ps, cfg.partition_activations, cfg.cpu_checkpointing,
                            cfg.contiguous_checkpointing, len(runs))
    groups = [_Group(run, store, slot, rng, phase, split_backward)
              for slot, run in enumerate(runs)]
    for g in groups:
        for w in g.members:
            w.block.forward = w  # instance attribute, not a submodule: names stay
    return ActivationCheckpointing(store, groups, phase)
