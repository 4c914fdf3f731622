"""Stage 3: gather a module's parameters just before it runs, free them right after.

Each partitioned unit belongs to one module (a transformer block, or the root
module for what no block owns and for a parameter with a unit of its own: see
:mod:`hybrid.zero.units`). Hooks on that module:

* forward pre-hook: finish this unit's all-gather (usually already prefetched),
  then start the next unit's in forward order -- asynchronously even when the
  unit is larger than a bucket (:mod:`hybrid.zero.gather_pipeline`);
* forward post-hook: free the full parameters and hook the module's output so
  its gradient, arriving in backward, gathers them again (and prefetches the
  unit that backward reaches next);
* after backward, once the unit's gradients are packed for their
  reduce-scatter, the reducer frees them again (:meth:`FlatUnit.release`).

[Note: held for a pipeline step]
Under a pipeline schedule each micro-batch's forward and backward are separate
runs of the stage, and freeing after each would gather every unit 2m times a
step (m micro-batches). While :attr:`ParamGatherer.hold` is set (the executor
sets it for a step, :meth:`~hybrid.zero.ZeroEngine.params_held`) none of the
three frees above happens: a unit gathered at its first use in the step stays
whole until the caller frees its part (:meth:`ParamGatherer.release`, after the
part's last backward that reads the weights), so it is gathered once a step.

[Note: prefetch within a part]
A model in parts (an interleaved pipeline rank's chunks, :mod:`hybrid.zero.parts`)
runs one part per forward and backward, in an order the recorded forward order
does not know: the unit after a chunk's last block is the next chunk's first,
which the next forward may not run. So with parts a prefetch goes only to a unit
of the same part, and a root unit (run by every part's forward) prefetches
nothing; each part's first block is gathered when it runs.
The root module's output carries every part's root units' backward hooks, so a
backward of part c would gather the root units of the other parts too, which it
does not reach: a backward told its part (``backward_part``, set by
:meth:`~hybrid.zero.ZeroEngine.begin_backward`) gathers only c's.

[Note: recompute]
With activation checkpointing, a block's forward runs a second time inside
backward. That pre-forward gather *is* the backward gather of the 3 Psi
budget, so the post-forward hook must not free the parameters then: the
block's backward follows at once. Activation checkpointing says so through
the :class:`~hybrid.recompute.phase.RecomputePhase` it shares with this gatherer.

[Note: releasing a frozen unit]
A frozen unit (hybrid/zero/units.py, [Note: frozen units]) is gathered by the same
hooks as a trainable one, but has no gradient, so the reducer never says its module's
backward is over. Its module's input gradients do: a multi-grad hook on the tensors
the forward was handed (by position or keyword) that require a gradient -- registered
at the forward, or at the recompute forward of a checkpointed block -- fires when the
node that made them is about to run, and autograd runs a ready node made later in
forward first, so every node of the module that reads the frozen weights has run by
then (a LoRA block's ``W x`` beside its ``B A x``: both feed the input's gradient).
Releasing it with the module's trainable unit instead would be too early: the reducer
packs that unit as soon as the adapter's gradients are in, and the ``W x`` node may
still be to run. A module whose inputs need no gradient (the root module, a first
block under a frozen embedding) keeps its frozen units until the end of backward
(:meth:`ParamGatherer.release_all`), and nothing is released while units are held for
a pipeline step.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping

import torch
from torch import nn

from hybrid.recompute.phase import RecomputePhase
from hybrid.zero.flat_unit import FlatUnit, ParamState
from hybrid.zero.gather_pipeline import GatherPipelines


class ParamGatherer:
    def __init__(self, owners: list[tuple[nn.Module, FlatUnit]], pipe: GatherPipelines,
                 recompute: RecomputePhase, parts: dict[int, int | None] | None = None,
                 home: dict[int, int] | None = None, frozen: Collection[FlatUnit] = ()):
        """``parts``: the part of each unit by ``id`` (None for a root unit), when the
        model is in parts ([Note: prefetch within a part]); None: one part. ``home``:
        then the part of every unit, the root's too. ``frozen``: the units of ``owners``
        that hold frozen parameters ([Note: releasing a frozen unit])."""
        self.pipe = pipe
        self.recompute = recompute
        self._parts, self._home = parts, home
        self.backward_part: int | None = None  # the part the running backward reaches
        self.units = [u for _, u in owners]
        self._owner = {id(u): m for m, u in owners}
        self._forward_order: list[FlatUnit] = []
        self._recording = True
        self.hold = False  # [Note: held for a pipeline step]
        self._handles = []
        self._frozen = {id(u) for u in frozen}  # [Note: releasing a frozen unit]
        self._input_hooks: list = []
        for module, unit in owners:
            self._handles.append(module.register_forward_pre_hook(self._pre_forward(unit)))
            self._handles.append(module.register_forward_hook(self._post_forward(unit)))
            if id(unit) in self._frozen:
                self._handles.append(module.register_forward_pre_hook(
                    self._watch_inputs(unit), with_kwargs=True))

    # -- ordering --------------------------------------------------------------
    def _next(self, unit: FlatUnit, backward: bool) -> FlatUnit | None:
        order = self._forward_order
        if unit not in order:
            return None
        i = order.index(unit)
        if not backward:
            return order[i + 1] if i + 1 < len(order) else None
        # Backward meets the root module's units first (the loss: all of them gathered
        # there, none released before their gradients), then blocks last to first.
        if i == 0:
            return order[-1] if len(order) > 1 else None
        prev = order[i - 1]
        return prev if self._owner[id(prev)] is not self._owner[id(order[0])] else None

    def _along(self, unit: FlatUnit, nxt: FlatUnit | None) -> bool:
        """``nxt`` runs after ``unit`` in this forward or backward, as far as parts tell
        ([Note: prefetch within a part])."""
        if nxt is None or self._parts is None:
            return nxt is not None
        k = self._parts[id(unit)]
        return k is not None and self._parts[id(nxt)] == k

    def _prefetch(self, unit: FlatUnit, backward: bool) -> None:
        nxt = self._next(unit, backward)
        if self._along(unit, nxt):
            assert nxt is not None  # (_along says so)
            nxt.start_gather(self.pipe)
            # an offloaded shard's home is asked one unit further: its read from disk
            # overlaps this unit's compute and the next one's gather (offload/nvme/homes.py)
            after = self._next(nxt, backward)
            if (self._along(nxt, after) and after is not None and after.home is not None
                    and not after.gathered):
                after.home.prefetch()

    # -- hooks -----------------------------------------------------------------
    def _pre_forward(self, unit: FlatUnit) -> Callable[[nn.Module, tuple[object, ...]], None]:
        def hook(module: nn.Module, args: tuple[object, ...]) -> None:
            recomputing = self.recompute.active
            if self._recording and not recomputing and unit not in self._forward_order:
                self._forward_order.append(unit)
            unit.finish_gather(self.pipe)
            self._prefetch(unit, backward=recomputing)
        return hook

    def _watch_inputs(self, unit: FlatUnit
                      ) -> Callable[[nn.Module, tuple[object, ...], dict[str, object]], None]:
        """A forward pre-hook (with kwargs: a ``transformers`` layer is handed its hidden
        states by keyword) that releases frozen ``unit`` once the gradients of the
        forward's tensor inputs are complete ([Note: releasing a frozen unit])."""
        def hook(module: nn.Module, args: tuple[object, ...], kwargs: dict[str, object]
                 ) -> None:
            if not torch.is_grad_enabled():
                return
            inputs = [a for a in (*args, *kwargs.values())
                      if isinstance(a, torch.Tensor) and a.requires_grad]
            if inputs:
                self._when_complete(unit, inputs)
        return hook

    def _when_complete(self, unit: FlatUnit, inputs: list[torch.Tensor]) -> None:
        handle = None

        def done(grads: object) -> None:
            if handle is not None:
                handle.remove()
            if not self.hold:
                unit.release()
        handle = torch.autograd.graph.register_multi_grad_hook(inputs, done, mode="all")
        self._input_hooks.append(handle)

    def _post_forward(self, unit: FlatUnit
                      ) -> Callable[[nn.Module, tuple[object, ...], object], object]:
        def hook(module: nn.Module, args: tuple[object, ...], output: object) -> object:
            if self.recompute.active:  # backward of this module comes next
                return output
            if torch.is_grad_enabled():
                self._hook_output(unit, output)
            if not self.hold:
                unit.release()
            return output
        return hook

    def _hook_output(self, unit: FlatUnit, output: object) -> None:
        """Hook the first output tensor that needs a gradient (a tensor, a tuple or
        list of them, or a mapping such as a ``transformers`` ModelOutput)."""
        if isinstance(output, Mapping):
            output = list(output.values())
        tensors = [output] if isinstance(output, torch.Tensor) else [
            t for t in (output if isinstance(output, (tuple, list)) else [])
            if isinstance(t, torch.Tensor)]
        for t in tensors:
            if t.requires_grad:
                t.register_hook(self._pre_backward(unit))
                break

    def _pre_backward(self, unit: FlatUnit) -> Callable[[torch.Tensor], torch.Tensor]:
        def hook(grad: torch.Tensor) -> torch.Tensor:
            self._recording = False
            if (self._home is not None and self.backward_part is not None
                    and self._home[id(unit)] != self.backward_part):
                return grad  # another part's root unit ([Note: prefetch within a part])
            unit.finish_gather(self.pipe)
            self._prefetch(unit, backward=True)
            return grad
        return hook

    def after_grads(self, unit: FlatUnit) -> None:
        """The reducer has packed ``unit``'s gradients: free its parameters until the
        next forward (FSDP's reshard after backward), unless they are held ([Note:
        held for a pipeline step])."""
        if not self.hold:
            unit.release()

    def release_all(self) -> None:
        """Free everything gathered (end of step, or after an eval forward)."""
        self.release(self.units)
        for h in self._input_hooks:  # (a hook on a leaf input that no backward reached)
            h.remove()
        self._input_hooks = []

    def release(self, units: Iterable[FlatUnit]) -> None:
        """Free ``units`` (a gather under way is finished first)."""
        for u in units:
            if u.state is ParamState.GATHERING:
                u.finish_gather(self.pipe)
            u.release()

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
