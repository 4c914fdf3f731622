"""A user's ``torch.optim`` optimizer stepping this rank's shard (DeepSpeed's ``optimizer=``).

    client = torch.optim.SGD([{"params": decay, "weight_decay": 0.1},
                              {"params": no_decay, "weight_decay": 0.0}], lr=0.1, momentum=0.9)
    engine = apply_zero(model, ps, cfg.zero, ..., client=client)
    sched = torch.optim.lr_scheduler.LambdaLR(client, warmup)   # drives client.param_groups

The client keeps its ``param_groups`` (their lr, momentum, weight decay, ...,
whatever a scheduler writes there) but not their parameters: each group's
``params`` become views of this rank's fp32 master, one per owned piece of a
parameter the group held (:meth:`ZeroEngine.owned_pieces`). The client's own
``step()`` then updates the shard, and its state (momentum, moments) exists
for this rank's elements only: ZeRO's 1/N. Parameters outside every group are
an error; frozen parameters (``requires_grad`` False) are in none of the units the
optimizer steps (at stage 3 in frozen units only the gatherer sees: units.py, [Note:
frozen units]), so they take no state and no reduction.

[Note: element-wise optimizers]
A piece is part of a parameter, so the client sees each parameter cut where the
shards meet. Element-wise updates (SGD, Adam, AdamW, Adagrad, RMSprop, ...) do
not notice; an optimizer whose update reads a whole parameter (a per-tensor
norm: LAMB, LARS, Adafactor's factored moments) would see pieces, as DeepSpeed's
flat partitions do. Which of the client's state is per element is learnt once,
at construction, by stepping a throwaway instance of its class on a two-element
tensor: state of that shape is per element (a checkpoint column: ``exp_avg``,
``momentum_buffer``, ...), a 0-dim tensor is per parameter (its ``step``).

[Note: a client step reads the skip decision]
hybrid's own AdamW skips a non-finite step on the device; a client optimizer
cannot be told to, so its step reads the skip flag on the host first: one sync
per optimizer step, as DeepSpeed's overflow check has.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Collection, Generator, Iterable, Sequence

import torch

from hybrid.errors import ConfigError
from hybrid.zero.optimizer import PartRanges, ShardBase
from hybrid.zero.units import OwnedPiece


def element_state_keys(client: torch.optim.Optimizer) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(per-element state keys, per-parameter scalar state keys) of ``client``'s class,
    from one step of a throwaway instance (module note); a ConfigError when the class
    cannot be built again from its defaults."""
    cls = type(client)
    accepted = inspect.signature(cls.__init__).parameters
    kwargs = {k: v for k, v in client.defaults.items() if k in accepted}
    probe = torch.zeros(2)
    try:
        trial = cls([probe], **kwargs)
        probe.grad = torch.zeros(2)
        trial.step()
    except Exception as e:  # the class's own error, whatever it is: name it
        raise ConfigError(f"optimizer={cls.__name__}: hybrid learns which of its state is "
                          f"per element by building one from its defaults and stepping it "
                          f"once, which failed ({type(e).__name__}: {e})") from None
    state = trial.state.get(probe, {})
    element = tuple(k for k, v in state.items()
                    if isinstance(v, torch.Tensor) and v.shape == probe.shape)
    scalar = tuple(k for k in state if k not in element)
    if "master" in element:
        raise ConfigError(f"optimizer={cls.__name__} keeps a state named 'master', the name "
                          f"hybrid's checkpoints give the fp32 weights")
    return element, scalar


def check_groups(client: torch.optim.Optimizer, params: Sequence[tuple[str, torch.nn.Parameter]],
                 where: str) -> None:
    """Every trainable parameter of ``params`` (the model's, by name) is in exactly one
    of ``client``'s groups, and the groups hold nothing else; the client has no state
    yet. Run on every rank before any collective (the same model everywhere), so a
    mistake stops every rank alike."""
    if client.state:
        raise ConfigError(f"{where}(optimizer=...): the optimizer has stepped already (it "
                          f"has state); build it fresh and give it to initialize")
    named = {id(p): n for n, p in params}
    seen: dict[int, int] = {}
    for i, g in enumerate(client.param_groups):
        for p in g["params"]:
            if id(p) in seen:
                raise ConfigError(f"{where}(optimizer=...): parameter "
                                  f"{named.get(id(p), tuple(p.shape))} is in param_groups "
                                  f"{seen[id(p)]} and {i}: give it to one group")
            if id(p) not in named:
                raise ConfigError(f"{where}(optimizer=...): param_groups[{i}] holds a tensor "
                                  f"of shape {tuple(p.shape)} that is not a parameter of the "
                                  f"model")
            seen[id(p)] = i
    for n, p in params:
        if p.requires_grad and id(p) not in seen:
            raise ConfigError(f"{where}(optimizer=...): parameter {n} requires grad but is in "
                              f"none of the optimizer's param_groups: give it to a group, or "
                              f"freeze it (requires_grad_(False)) before initialize")


class ClientShardOptimizer(ShardBase):
    """``client`` (a ``torch.optim.Optimizer``) over this rank's shard (module notes).

    Args:
        client: built over the model's parameters (:func:`check_groups` holds); its
            groups' ``params`` are replaced here by views of ``master``.
        pieces: the engine's owned pieces, in shard order.
        master: fp32 master per unit part (views of ``flat_master`` when there is one,
            or the fp32 parameter shards themselves).
        split_ranges: per part, ``[(lo, hi)]`` of TP-split parameters (the norm's).
        flat_master: the flat buffer ``master`` are views of, if any.
        excluded: parts left out of the norm (:class:`~hybrid.zero.optimizer.ShardBase`).
    """

    def __init__(self, client: torch.optim.Optimizer, pieces: Sequence[OwnedPiece],
                 master: list[torch.Tensor], split_ranges: PartRanges, *,
                 flat_master: torch.Tensor | None = None, excluded: Collection[int] = ()):
        dev = master[0].device if master else torch.device("cpu")
        super().__init__([m.numel() for m in master], split_ranges, dev, excluded)
        self.client, self.master, self.flat_master = client, master, flat_master
        self.element_keys, self.scalar_keys = element_state_keys(client)
        self.columns: tuple[str, ...] = ("master",) + self.element_keys
        self.unsaved = tuple(k for k in self.scalar_keys if k != "step")
        group_of = {id(p): i for i, g in enumerate(client.param_groups) for p in g["params"]}
        params: list[list[torch.Tensor]] = [[] for _ in client.param_groups]
        # one view per piece: (view, unit, part), and where each piece's view is
        self._slots: list[tuple[torch.Tensor, int, slice]] = []
        self._at: dict[tuple[int, int], int] = {}
        self._by_unit: list[list[int]] = [[] for _ in master]
        for pc in pieces:
            view = master[pc.unit][pc.part]
            params[group_of[id(pc.param)]].append(view)
            self._at[(pc.unit, pc.part.start)] = len(self._slots)
            self._by_unit[pc.unit].append(len(self._slots))
            self._slots.append((view, pc.unit, pc.part))
        for g, ps in zip(client.param_groups, params):
            g["params"] = ps
        # fp32 copies of gradients kept in another dtype (one flat buffer, reused)
        self._grad32: torch.Tensor | None = None

    def state_bytes(self) -> int:
        return sum(v.untyped_storage().nbytes() if v.data_ptr() else 0
                   for st in self.client.state.values() for v in st.values()
                   if isinstance(v, torch.Tensor) and v.dim() > 0)

    # -- the step ---------------------------------------------------------------------
    @torch.no_grad()
    def step(self, grads: list[torch.Tensor], lr: float, grad_scale: float | torch.Tensor = 1.0,
             skip: torch.Tensor | None = None, out: list[torch.Tensor] | None = None,
             found_inf: torch.Tensor | None = None) -> None:
        """The client's ``step()`` on every piece, from ``grads * grad_scale`` (the
        gradient is scaled in place where it is fp32); nothing changes where ``skip``
        is set (a host read: module note). ``lr`` is unused: the client's groups hold
        their rates. ``out``: None, or per part a tensor that receives the new master
        in its dtype. ``found_inf`` is not used (the client reports nothing)."""
        scalars = self.begin_step(grad_scale, skip)
        if bool(scalars[2]):
            return
        self._run(range(len(self._slots)), lambda i: grads[self._slots[i][1]][self._slots[i][2]],
                  scalars[0])
        if out is not None:
            for o, m in zip(out, self.master):
                o.copy_(m)

    def _run(self, slots: Iterable[int], grad_of: Callable[[int], torch.Tensor],
             scale: torch.Tensor) -> None:
        """Give each slot its scaled fp32 gradient, step the client, take them back."""
        taken = []
        for i in slots:
            view = self._slots[i][0]
            g = grad_of(i)
            if g.dtype != torch.float32 or g.device != view.device:
                g = self._scratch(i).copy_(g)
            g.mul_(scale.to(g.dtype))
            view.grad = g
            taken.append(view)
        self.client.step()
        for view in taken:
            view.grad = None

    def _scratch(self, i: int) -> torch.Tensor:
        """Slot ``i``'s place in the fp32 gradient copy (allocated at first use)."""
        if self._grad32 is None:
            self._grad32 = torch.empty(self.offsets[-1], dtype=torch.float32,
                                       device=self._step.device)
        _, unit, part = self._slots[i]
        base = self.offsets[unit]
        return self._grad32[base + part.start: base + part.stop]

    # -- the host tiers' interface (hybrid/zero/offload/host_step.py) --------------------
    def chunks(self) -> list[tuple[int, int]]:
        """One chunk per part (unit), as :class:`~hybrid.zero.optimizer.ShardedAdamW`."""
        return list(zip(self.offsets[:-1], self.offsets[1:]))

    def chunk_steps(self, grad: torch.Tensor | None, lr: float, scalars: torch.Tensor,
                    found: torch.Tensor, order: Iterable[int] | None = None
                    ) -> Generator[_ClientChunk, None, None]:
        """Every part ``k`` in ``order``: the client's step over that part's pieces, from
        the flat host ``grad`` (each element's update is its own, so the parts may go
        in any order and give the same bits)."""
        if grad is None:
            raise ValueError("a client optimizer steps from a flat gradient in memory")
        skip = bool(scalars[2])  # a host tensor here: no device sync
        for k in (range(len(self.offsets) - 1) if order is None else order):
            yield _ClientChunk(self, k, grad, scalars[0], skip)

    def master_into(self, out: torch.Tensor) -> None:
        assert self.flat_master is not None  # (the host tiers build one)
        out.copy_(self.flat_master)

    def master_range(self, lo: int, hi: int) -> torch.Tensor:
        assert self.flat_master is not None  # (the host tiers build one)
        return self.flat_master[lo:hi]

    # -- checkpoints: one piece at a time -------------------------------------------------
    def _count_set(self, value: int) -> None:
        """Every piece's ``step`` state too, where the client keeps one."""
        if "step" in self.scalar_keys:
            for st in self.client.state.values():
                if "step" in st:
                    st["step"] = self._scalar(float(value))

    def read_piece(self, key: str, part: int, where: slice) -> torch.Tensor:
        """``master`` or one of :attr:`element_keys` for the piece at ``where`` of part
        ``part`` (zeros for a state the client has not made yet)."""
        view = self._slots[self._at[(part, where.start)]][0]
        if key == "master":
            return view
        value = self.client.state.get(view, {}).get(key)
        return torch.zeros_like(view) if value is None else value

    def write_piece(self, key: str, part: int, where: slice,
                    values: torch.Tensor | None) -> None:
        """The piece's ``key`` <- ``values``; None for a state: the piece starts afresh
        (the client makes its state at its next step, as for a new parameter)."""
        view = self._slots[self._at[(part, where.start)]][0]
        if key == "master":
            view.copy_(values if values is not None else torch.zeros_like(view))
            return
        if values is None:
            self.client.state.pop(view, None)
            return
        state = self.client.state[view]
        state[key] = values.to(device=view.device, dtype=view.dtype).clone()
        if "step" in self.scalar_keys and "step" not in state:
            state["step"] = self._scalar(float(self.step_count))

    def _scalar(self, value: float) -> torch.Tensor:
        """A per-parameter scalar state as torch's optimizers keep it: fp32, on the
        host unless the client is capturable or fused (then on the shard's device)."""
        on_device = bool(self.client.defaults.get("capturable")
                         or self.client.defaults.get("fused"))
        return torch.tensor(value, dtype=torch.float32,
                            device=self._step.device if on_device else "cpu")


class _ClientChunk:
    """Part ``k`` of a client step on the host tier (:class:`ClientShardOptimizer`)."""

    __slots__ = ("opt", "k", "grad", "scale", "skip")

    def __init__(self, opt: ClientShardOptimizer, k: int, grad: torch.Tensor,
                 scale: torch.Tensor, skip: bool):
        self.opt, self.k, self.grad, self.scale, self.skip = opt, k, grad, scale, skip

    def apply(self, out: torch.Tensor | None) -> None:
        opt, k = self.opt, self.k
        lo, hi = opt.offsets[k], opt.offsets[k + 1]
        if not self.skip:
            def grad_of(i: int) -> torch.Tensor:
                part = opt._slots[i][2]
                return self.grad[lo + part.start: lo + part.stop]
            opt._run(opt._by_unit[k], grad_of, self.scale)
        if out is not None:
            out.copy_(opt.master_range(lo, hi))
