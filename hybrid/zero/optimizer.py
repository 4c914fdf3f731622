"""AdamW over this rank's flat shard of the model, with fp32 master weights.

The shard is the concatenation of this rank's part of every unit (all of
every unit at stage 0). Master weights, both Adam moments and the fp32
gradient the step reads are flat ``(n,)`` tensors over it, so the update is a
handful of vectorized ops whatever the number of parameters. Per-parameter
facts the update needs -- whether weight decay applies, whether the parameter
is TP-split (for the norm) -- are kept as ranges of the flat shard.

[Note: counting TP-replicated parameters once]
Across DP the shards are disjoint, so their squared norms add. Inside one DP
replica the TP ranks hold two kinds of parameters: TP shards (disjoint pieces
of a weight, ``param.tp_spec``) and replicated parameters (LayerNorm, position
embeddings, row-parallel biases) whose gradients are identical on every TP
rank. The global squared norm sums the shards' squares over TP and adds the
replicated squares *once*; summing everything over TP would count each
replicated parameter TP times. Across pipeline stages the parameters are
disjoint too, except a tied word embedding's two copies (the first and the last
stage's), whose summed gradients are equal: the copy's part is left out of the
last stage's terms (``excluded``), so the embedding counts once.

The arithmetic is torch.optim.AdamW's (decoupled decay, bias-corrected
moments, eps added after the square root), so a ZeRO run and a plain
single-process run agree to rounding.

[Note: a step without host reads]
The clip coefficient and the skip decision come from the global gradient
norm, a device tensor; reading it into Python would stop the host until the
device has finished backward. So every step method takes ``grad_scale`` (and
``skip``) as tensors, and the step count lives on the shard's device too: a
skipped step does not count, which only the device knows. Every step
method hands ``[grad_scale, step, skip]`` to the kernels as one fp64 tensor.

Which implementation runs the update -- a compiled kernel, torch's fused
AdamW, eager ops -- is :class:`hybrid.kernels.adam.ShardAdamW`'s choice,
made once when the optimizer is built; this module only owns the state.
"""

from __future__ import annotations

from collections.abc import Collection, Generator, Iterable
from typing import Protocol

import torch

from hybrid.config.sections import AdamWConfig
from hybrid.kernels.adam import ShardAdamW, complement_ranges
from hybrid.parallel.comm import CommGroup

# What a rank keeps per element of its shard, in this order wherever they are stored
# together (a checkpoint's rows, a swap file's tile planes).
STATE_KEYS = ("master", "exp_avg", "exp_avg_sq")

# per part (unit), ``[(lo, hi)]`` ranges of its elements: weight decay's, TP-split ones
PartRanges = list[list[tuple[int, int]]]


# [Note: a norm that holds its digits at any size]
# One fp32 reduction over a whole range loses digits as the range grows: torch's CPU
# kernel accumulates each lane sequentially, so the squared sum of 400k elements is
# 1.6e-5 relative off, of 50M elements 3.3e-3 -- enough to move the clip coefficient of
# a host-offloaded shard, and to make a pipeline stage's norm (a sum of shorter ranges)
# disagree with one process's. Rows of NORM_BLOCK elements bound the fp32 part: each
# row's norm is taken in fp32 (one kernel over a view, no copy), their squares are
# summed in fp64. Measured: 9e-8 relative at 50M elements, no slower than one fp32 norm.
NORM_BLOCK = 4096


def squared_norm(x: torch.Tensor) -> torch.Tensor:
    """The squared L2 norm of ``x`` (any shape and float dtype; a flat contiguous range is
    read in place) as a 0-dim fp64 tensor on its device: fp32 norms of NORM_BLOCK-element
    rows, squared and summed in fp64 (see the note above). Deterministic: the same bits
    for the same ``x``."""
    x = x.reshape(-1)
    full = x.numel() - x.numel() % NORM_BLOCK
    out = torch.zeros((), dtype=torch.float64, device=x.device)
    if full:
        rows = torch.linalg.vector_norm(x[:full].view(-1, NORM_BLOCK), dim=1,
                                        dtype=torch.float32)
        out += rows.double().square().sum()
    if full < x.numel():
        out += torch.linalg.vector_norm(x[full:], dtype=torch.float32).double() ** 2
    return out


class ShardBase:
    """What every shard optimizer keeps, whatever holds its states (device or host
    memory here, tiles on disk in :class:`~hybrid.zero.offload.nvme.adamw.SwappedAdamW`):
    the parts' sizes and where each starts in the flat shard, the TP-split and
    replicated ranges of the norm, and the step count.

    Args:
        sizes: elements of each part (unit), in shard order.
        split_ranges: per part, ``[(lo, hi)]`` belonging to TP-split parameters.
        device: where the step count lives (the shard's device).
        excluded: parts left out of the norm: copies of a gradient another rank
            counts (see [Note: counting TP-replicated parameters once]).
    """

    # what a rank keeps per element of its shard, "master" first: a checkpoint's columns
    columns: tuple[str, ...] = STATE_KEYS
    # state a checkpoint cannot hold (a client optimizer's per-parameter scalars other
    # than its step count): a save refuses rather than lose it
    unsaved: tuple[str, ...] = ()

    def __init__(self, sizes: list[int], split_ranges: PartRanges, device: torch.device,
                 excluded: Collection[int] = ()):
        self.split_ranges = split_ranges
        self.excluded = frozenset(excluded)
        self.offsets = [0]  # where each part starts in the flat shard
        for n in sizes:
            self.offsets.append(self.offsets[-1] + n)
        # steps applied so far, where the shard lives: see [Note: a step without host reads]
        self._step = torch.zeros((), dtype=torch.float64, device=device)
        self._replicated = [complement_ranges(r, n) for n, r in zip(sizes, split_ranges)]

    @property
    def step_count(self) -> int:
        """Steps applied so far (a host read: for checkpoints and tests)."""
        return int(self._step.item())

    @step_count.setter
    def step_count(self, value: int) -> None:
        self._step.fill_(float(value))
        self._count_set(value)

    def _count_set(self, value: int) -> None:
        """What else holds the count (a client optimizer's per-piece ``step``): none here."""

    def begin_step(self, grad_scale: float | torch.Tensor,
                   skip: torch.Tensor | None = None) -> torch.Tensor:
        """Count a step (unless ``skip``) and return fp64 ``[grad_scale, step, skip]``
        on the shard's device, the ``scalars`` of :func:`hybrid.kernels.adam.adam_step`.

        ``grad_scale``: a float or a one-element tensor (on the shard's device);
        ``skip``: None or a one-element bool/float tensor there.
        """
        dev = self._step.device
        if isinstance(grad_scale, torch.Tensor):
            scale = grad_scale.reshape(()).to(device=dev, dtype=torch.float64)
        else:  # a fill, not a copy from host memory: no sync on a GPU
            scale = torch.full((), float(grad_scale), dtype=torch.float64, device=dev)
        if skip is None:
            self._step.add_(1.0)
            skip_f = torch.zeros((), dtype=torch.float64, device=dev)
        else:
            skip_f = skip.reshape(()).to(device=dev, dtype=torch.float64)
            self._step.add_(1.0 - skip_f)
        return torch.stack([scale, self._step, skip_f])

    @torch.no_grad()
    def prefetch(self) -> int:
        """Start moving what the next host step reads first (nothing here: the states
        are in memory; the nvme tier reads its first tiles)."""
        return 0

    def squared_norms(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """fp64 ``[sum of squares over TP-split ranges, over the replicated ranges]``.

        Each range's squared sum is :func:`squared_norm`'s (fp32 rows, no copy of the
        gradient, summed in fp64); the ranges' sums are added in fp64. The replicated
        sum is taken over the replicated ranges themselves -- never as total minus split --
        so it depends only on gradients every TP rank holds bit-identically:
        all TP ranks then reach the same norm to the last bit, hence the same
        clip coefficient, and their copies of replicated parameters never drift.
        """
        terms = [self.part_terms(i, g) for i, g in enumerate(grads)]
        return self.sum_terms(terms, grads[0].device)

    def part_terms(self, i: int, g: torch.Tensor) -> tuple[list, list]:
        """Part ``i``'s squared norms from its gradient ``g``, range by range: (TP-split
        ranges', replicated ranges'), 0-dim fp64 tensors on ``g``'s device. Taken as
        soon as a part's gradient is final when the gradient only passes through the
        device (hybrid/zero/offload/landing.py). An excluded part has none."""
        if i in self.excluded:
            return [], []
        split, replicated = ([squared_norm(g[lo:hi]) for lo, hi in ranges]
                             for ranges in (self.split_ranges[i], self._replicated[i]))
        return split, replicated

    @staticmethod
    def sum_terms(terms: list, device: torch.device) -> torch.Tensor:
        """:meth:`squared_norms` from every part's :meth:`part_terms`, in part order:
        added one by one in fp64, the same order whenever the terms were taken."""
        out = torch.zeros(2, dtype=torch.float64, device=device)
        for part in terms:
            for k, ranges in enumerate(part):
                for t in ranges:
                    out[k] += t
        return out


class ShardedAdamW(ShardBase):
    """Adam moments and master weights for this rank's parts of the model.

    Args:
        master: fp32 master weights, one tensor per unit part (views of one
            flat buffer, or the fp32 parameter shards themselves when the model
            is fp32 and not offloaded). Updated in place.
        decay_ranges: per part, ``[(lo, hi)]`` that get weight decay.
        split_ranges: per part, ``[(lo, hi)]`` belonging to TP-split parameters.
        cfg: betas, eps and weight decay (clipping is the caller's: it passes
            the clip coefficient in ``grad_scale``).
        flat_master: the flat buffer ``master`` are views of, in order, if any;
            it enables :meth:`step_parts`.
        flat_grad: the flat gradient every :meth:`step` will read, parts in
            ``master`` order, if there is one (stages 2-3): with ``flat_master``
            it lets a compiled kernel update the whole shard in one pass.
        excluded: parts left out of the norm (:class:`ShardBase`).
    """

    def __init__(self, master: list[torch.Tensor], decay_ranges: PartRanges,
                 split_ranges: PartRanges, cfg: AdamWConfig, *,
                 flat_master: torch.Tensor | None = None,
                 flat_grad: torch.Tensor | None = None, excluded: Collection[int] = ()):
        self.master = master
        self.flat_master = flat_master
        n = sum(m.numel() for m in master)
        dev = master[0].device if master else torch.device("cpu")
        super().__init__([m.numel() for m in master], split_ranges, dev, excluded)
        # Both moments are single flat buffers; parts are views.
        self._flat_avg = torch.zeros(n, dtype=torch.float32, device=dev)
        self._flat_avg_sq = torch.zeros(n, dtype=torch.float32, device=dev)
        self.exp_avg = _split_like(self._flat_avg, master)
        self.exp_avg_sq = _split_like(self._flat_avg_sq, master)
        flat = (None if flat_master is None
                else (flat_master, self._flat_avg, self._flat_avg_sq))
        # the update itself, and the choice of what runs it: hybrid.kernels
        self.adamw = ShardAdamW(master, self.exp_avg, self.exp_avg_sq, decay_ranges,
                                (cfg.beta1, cfg.beta2, cfg.eps, cfg.weight_decay), flat,
                                flat_grad)

    def state_bytes(self) -> int:
        return 2 * self._flat_avg.numel() * self._flat_avg.element_size()

    @torch.no_grad()
    def step(self, grads: list[torch.Tensor], lr: float, grad_scale: float | torch.Tensor = 1.0,
             skip: torch.Tensor | None = None, out: list[torch.Tensor] | None = None,
             found_inf: torch.Tensor | None = None) -> None:
        """AdamW on every part from ``grads * grad_scale`` (unscale and clip folded in);
        nothing changes where ``skip`` (a device flag) is set.

        ``grads``: per part, in any float dtype. ``out``: None, or per part a
        tensor (each unit's parameter shard) that receives the part's master in
        its dtype -- the publication of the new parameters. ``found_inf``: a
        one-element flag set where the update met a non-finite gradient element
        (see :meth:`hybrid.kernels.adam.ShardAdamW.step`).
        """
        self.adamw.step(grads, lr, self.begin_step(grad_scale, skip), out, found_inf)

    def step_parts(self, grad: torch.Tensor, lr: float, scalars: torch.Tensor, first: int,
                   last: int, out: torch.Tensor | None, found: torch.Tensor) -> None:
        """AdamW on parts ``[first, last)`` of the flat master only, with ``scalars`` from
        :meth:`begin_step` (one per step, whatever the number of pieces it is applied
        in). ``grad``: the flat gradient; ``out``: None or a flat tensor over them."""
        self.adamw.step_parts(grad, lr, scalars, first, last, out, found)

    # -- the host tiers' interface (hybrid/zero/offload/host_step.py): the step in chunks
    def chunks(self) -> list[tuple[int, int]]:
        """The flat shard ranges one host step updates at a time: one per part (unit)."""
        return list(zip(self.offsets[:-1], self.offsets[1:]))

    def chunk_steps(self, grad: torch.Tensor | None, lr: float, scalars: torch.Tensor,
                    found: torch.Tensor, order: Iterable[int] | None = None
                    ) -> Generator[_PartsStep, None, None]:
        """Every chunk ``k`` of :meth:`chunks` in ``order`` (default: ascending; each
        element's update is independent of the others', so any order gives the same
        bits), ready to step from the flat ``grad``
        (:class:`~hybrid.zero.offload.contracts.ChunkStep`)."""
        if grad is None:
            raise ValueError("ShardedAdamW steps from a flat gradient in memory")
        for k in (range(len(self.offsets) - 1) if order is None else order):
            yield _PartsStep(self, k, grad, lr, scalars, found)

    def master_into(self, out: torch.Tensor) -> None:
        """The flat master, rounded to ``out``'s dtype, into the flat ``out``."""
        assert self.flat_master is not None  # the host tiers build it with one
        out.copy_(self.flat_master)

    def master_range(self, lo: int, hi: int) -> torch.Tensor:
        """fp32 master over flat shard elements ``[lo, hi)``."""
        assert self.flat_master is not None  # the host tiers build it with one
        return self.flat_master[lo:hi]

    # -- one piece of one part, for checkpoints ---------------------------------------
    def read_piece(self, key: str, part: int, where: slice) -> torch.Tensor:
        """Elements ``where`` of part ``part`` of ``key`` (master, exp_avg, exp_avg_sq)."""
        return getattr(self, key)[part][where]

    def write_piece(self, key: str, part: int, where: slice,
                    values: torch.Tensor | None) -> None:
        """Elements ``where`` of part ``part`` of ``key`` <- ``values`` (or zeros: None)."""
        dst = getattr(self, key)[part][where]
        if values is None:
            dst.zero_()
        else:
            dst.copy_(values)


def _split_like(flat: torch.Tensor, parts: list[torch.Tensor]) -> list[torch.Tensor]:
    out, off = [], 0
    for p in parts:
        out.append(flat[off: off + p.numel()])
        off += p.numel()
    return out


class SquaredNorms(Protocol):
    """What the global norm asks of a shard optimizer (every one has it: ShardBase's)."""

    def squared_norms(self, grads: list[torch.Tensor]) -> torch.Tensor: ...


@torch.no_grad()
def global_grad_norm(opt: SquaredNorms, grads: list[torch.Tensor] | None, tp: CommGroup,
                     dp: CommGroup | None, loss: torch.Tensor | None = None,
                     loss_dp: CommGroup | None = None, squared: torch.Tensor | None = None,
                     pp: CommGroup | None = None, count_replicated: bool = True,
                     experts: tuple[torch.Tensor, tuple[CommGroup, ...]] | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """(L2 norm of the whole model's gradient, whether any rank's ``loss`` is not
    finite) from this rank's parts of the gradient, as 0-dim tensors on the
    gradients' device (fp64, bool; never read here).

    Parts are disjoint across ``dp`` (pass None when every DP rank holds the
    full gradient, stage 0). Across TP, split parameters are summed and
    replicated ones counted once (see the note at the top). The loss's
    "not finite" flag rides in the same vector, summed over TP and ``dp`` -- or,
    at stage 0, over ``loss_dp`` (the DP x CP group) in a one-element all-reduce
    of its own -- so it costs no collective of its own when the shards are split.
    ``squared``: this rank's ``opt.squared_norms`` when already taken (``grads`` None).
    ``pp``: the pipeline group, whose stages hold disjoint parameters: the whole
    vector is summed over it last, so the norm and the loss flag cover every stage.
    ``count_replicated`` False: this rank's replicated parameters are left out of the
    norm (DeepSpeed's pipeline norm on a stage after the first, AdamWConfig.clip_norm_of),
    though a non-finite gradient among them still flags the step.
    ``experts``: (the squared norm of gradients ``opt`` left out, the groups their parts
    are disjoint over): summed over those groups in turn and counted with the split
    terms (an unsharded step's experts, over EP and ETP).
    """
    if squared is None:
        assert grads is not None  # (one of the two is given)
        squared = opt.squared_norms(grads)
    sq = squared  # [split, replicated]
    bad = (torch.zeros((), dtype=torch.float64, device=sq.device) if loss is None
           else (~torch.isfinite(loss.detach())).to(torch.float64).reshape(()))
    if not count_replicated:
        bad = bad + (~torch.isfinite(sq[1])).to(bad.dtype)
        sq = torch.stack((sq[0], torch.zeros_like(sq[1])))
    both = torch.stack((sq[0], bad, sq[1]))  # [split, loss flag, replicated]
    if dp is not None:
        dp.all_reduce(both)
    tp.all_reduce(both[:2])
    if experts is not None:
        sq_e, groups = experts
        sq_e = sq_e.to(both.dtype).reshape(1).clone()
        for group in groups:
            group.all_reduce(sq_e)
        both[0] += sq_e[0]
    if dp is None and loss is not None and loss_dp is not None:
        loss_dp.all_reduce(both[1:2])
    if pp is not None:
        pp.all_reduce(both)
    return (both[0] + both[2]).sqrt(), both[1] > 0


class _PartsStep:
    """Chunk ``k`` of a :class:`ShardedAdamW` step: part ``k`` of the flat shard."""

    __slots__ = ("opt", "k", "grad", "lr", "scalars", "found")

    def __init__(self, opt: ShardedAdamW, k: int, grad: torch.Tensor, lr: float,
                 scalars: torch.Tensor, found: torch.Tensor):
        self.opt, self.k, self.grad, self.lr = opt, k, grad, lr
        self.scalars, self.found = scalars, found

    def apply(self, out: torch.Tensor | None) -> None:
        self.opt.step_parts(self.grad, self.lr, self.scalars, self.k, self.k + 1, out,
                            self.found)
