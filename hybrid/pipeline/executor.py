"""The executor: one rank's list of a pipeline schedule, run action by action.

    lists = build_schedule("1f1b", p, m)               # every rank's actions (schedules.py)
    losses = run_actions(lists.ranks[pp_rank], forward, params, pp_group,
                         shape=(B, T, C), dtype=torch.float32, device=device, zero=engine)
    result = engine.step(lr)                           # after END: the step's gradients

Any list the simulator accepts runs here (a new schedule is a new generator and
nothing else), under the rules of [Note: the semantics the executor honours]
in :mod:`hybrid.pipeline.actions`: sends are posted and not waited for until
``END``, receives block, messages between two ranks match by their order.

What the executor does not know -- the model, the data, the loss -- comes in
as ``forward(stage, microbatch, x)``: the stage's forward of that micro-batch
from ``x``, its input (None on stage 0, which reads the micro-batch itself),
returning the stage's output, or on the last stage the loss to backpropagate
(already divided by the micro-batch count and multiplied by the loss scale).
``params[stage]`` are the parameters a stage's weight gradient goes to.

[Note: ZeRO under a schedule]
A stage's parameters reduce over DP once a step: each backward (``B``, or the
weight half ``W``) is one ZeRO backward, begun and ended around it
(:meth:`~hybrid.zero.ZeroEngine.begin_backward`), and only the stage's last one
syncs, so stages 0-1 accumulate locally until then and reduce once, while
stages 2-3 reduce-scatter each micro-batch's gradient into the shard as they
do without a pipeline. A rank holding several stages (interleaving) holds one
model chunk per stage, and its engine knows the model in parts, one per chunk
(:mod:`hybrid.zero.parts`): each backward names its stage's chunk
(``stage // p``), reaches only that chunk's units, and syncs them at that
stage's last backward -- so each chunk reduces once a step too, and a chunk
whose backwards end early (the last one, under interleaved 1F1B) reduces while
the others' go on.

[Note: ZeRO-3's parameters over a step]
At ZeRO stage 3 the run is one :meth:`~hybrid.zero.ZeroEngine.params_held` block:
a unit gathered at its first use in the step stays whole through every later
micro-batch's forward and backward, and a stage's chunk is freed right after its
last action that reads the weights -- its last ``B``, or under ZB-H1 its last
``I`` (``W`` computes ``dW = dy^T x`` and reads no weight). So each unit is
gathered once a step where freeing after each micro-batch gathers it 2m times (in
each forward and again in each backward); the cost is that the chunk's gathered
parameters stay in memory from its first forward to its last backward.
``reshard_after_micro_batch=True`` (``--pipeline-reshard-after-micro-batch``) frees
them after each forward and backward as without a pipeline, for memory
(docs/pipeline-parallelism.md, "ZeRO-3's gathers under a schedule").

[Note: the two halves of a backward]
``I`` is the one traversal of the stage's graph: ``torch.autograd.grad`` of the
output into the stage's input and its parameters, freeing the graph, inside
``weight_grads[stage].deferring()`` -- the store the stage's model was built with
(``GPT(split_backward=True)``'s ``model.weight_grads``,
:mod:`hybrid.tensor_parallel.weight_grad`). The column- and row-parallel linears
and the head then compute their input gradients only and leave each weight
gradient (``dW = dy^T x``, with the column layers' ``db``) to a closure; every
other parameter's gradient (norms, embeddings, the row layers' biases: a few
elementwise sums) comes out of the traversal and is kept, not accumulated. ``W``
runs the closures and adds everything into ``.grad`` by one
``torch.autograd.backward`` rooted at the parameters themselves, as one ZeRO
backward, so ZeRO's post-accumulate-grad hooks count, fold and reduce as after a
whole backward ([Note: accumulating through autograd] there). Nothing is traversed
twice and no graph is retained; ``I`` + ``W`` compute what ``B`` does. Without a
store for the stage ``I`` computes every gradient and ``W`` only accumulates them.
At ZeRO stage 3 ``W`` gathers nothing: ``dW`` never reads ``W``, and a released
parameter keeps its shape for the accumulation.

[Note: releasing what was sent]
A send's tensor must stay alive and unchanged until the send completes; kept until
``END``, the first stage under 1F1B would hold every micro-batch's output for the
whole step. Gloo cannot be asked whether a send is done (its ``is_completed`` turns
true only inside ``wait``), and waiting on the oldest send could block on a peer that
is itself waiting: so the executor waits only where the wait is sure to return at
once. Given every rank's list (``peers``, the schedule's ``ranks``), when this rank's
``n``-th receive from ``q`` completes, ``q`` has run everything its list puts before
that send, among it some number of receives from this rank: the sends they matched
are done (messages on a pair match in order), so the executor waits on them -- at
once on gloo; on NCCL a stream wait on work already finished -- and lets their
tensors go. Under 1F1B a rank then holds no more sends per peer than there are
micro-batches in flight (at most p; two at PP 2), whatever m. Without ``peers``
every send is held until ``END``.

[Note: activations of any shape]
``run_actions(..., shape=None, learnt=Learnt())`` runs a model whose stages pass a tensor
or a tuple of tensors of shapes known only at run time (``hybrid.deepspeed.pipe``'s):
each boundary's spec is learnt by a one-time metadata message and kept in ``learnt``
for later steps (:mod:`hybrid.pipeline.wire`, [Note: the metadata handshake]); a
stage's ``forward`` may then take and return such tuples (a one-tensor tuple arrives as
the tensor), and gradients travel for their floating-point members. Only whole
backwards (``B``): a list with ``I``/``W`` is refused there. With ``shape`` (hybrid's
GPT) none of this runs.

[Note: watching the actions]
``run_actions(..., around=f)`` runs each action inside the context ``f(action)``: how the
step (:mod:`hybrid.pipeline.step`) times its phases for ``--timing-breakdown`` and
measures the activations saved for backward, without the executor knowing either.

[Note: the optional timeline]
``run_actions(..., timeline=[])`` appends ``(action, start, end)`` for every action, in
``time.perf_counter`` seconds (the device synced at both ends on CUDA, so the span
holds its work): how long each compute ran and each receive waited
(``benchmarks/bench_pipeline.py`` reads idle time and per-micro-batch times from it).
None, the default, times nothing.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Protocol

import torch

from hybrid.parallel.comm import CommGroup
from hybrid.pipeline import wire
from hybrid.pipeline.actions import RECVS, SENDS, Action, Kind, in_words, stage_chunk, stage_rank
from hybrid.tensor_parallel.weight_grad import Deferred, Pairs, WeightGradStore, run_deferred

Key = tuple[int, int]  # (stage, micro-batch)
Forward = Callable[[int, int, "wire.Activation | None"], "wire.Activation"]
Around = Callable[[Action], AbstractContextManager[object]]


class ZeroHooks(Protocol):
    """What the executor asks of a rank's ZeRO engine (:class:`~hybrid.zero.ZeroEngine`
    holds it): each backward bracketed, and stage 3's parameters held over the step
    ([Note: ZeRO under a schedule], [Note: ZeRO-3's parameters over a step])."""

    def begin_backward(self, sync: bool, part: int | None = None) -> None: ...

    def end_backward(self) -> None: ...

    def params_held(self, on: bool = True) -> AbstractContextManager[None]: ...

    def release_params(self, part: int | None = None) -> None: ...


def run_actions(actions: Sequence[Action], forward: Forward,
                params: dict[int, list[torch.nn.Parameter]], pp: CommGroup, *,
                shape: tuple[int, ...] | None, dtype: torch.dtype, device: torch.device,
                stages: int, zero: ZeroHooks | None = None,
                weight_grads: dict[int, WeightGradStore] | None = None,
                timeline: list[tuple[Action, float, float]] | None = None,
                peers: Sequence[Sequence[Action]] | None = None,
                reshard_after_micro_batch: bool = False,
                learnt: wire.Learnt | None = None,
                around: Around | None = None
                ) -> dict[int, torch.Tensor]:
    """Run this rank's ``actions`` (module doc); returns the loss of each micro-batch the
    last stage computed here, by micro-batch (empty on other ranks). ``pp``: the
    pipeline group, its group ranks the pipeline ranks; ``shape``/``dtype``: of the
    activations between stages, and of their gradients; ``stages``: ``p * v``;
    ``zero``: the rank's :class:`~hybrid.zero.ZeroEngine`, or None (plain autograd);
    ``weight_grads``: by stage, the store its linears defer their weight gradients to in
    ``I`` ([Note: the two halves of a backward]); None, or a stage left out: none;
    ``timeline``: a list to append each action's ``(action, start, end)`` to ([Note: the
    optional timeline]), or None; ``peers``: every rank's list, to let each sent tensor go
    once a receive proves it arrived ([Note: releasing what was sent]), or None (held
    until ``END``); ``reshard_after_micro_batch``: stage 3 frees its gathered
    parameters after every forward and backward instead of keeping them for the step
    ([Note: ZeRO-3's parameters over a step]); ``learnt``: instead of ``shape`` (None), the
    boundaries' specs learnt so far, filled here ([Note: activations of any shape]);
    ``around``: the context each action runs in ([Note: watching the actions]), or None."""
    if (shape is None) == (learnt is None):
        raise ValueError("run_actions: pass the activation shape, or learnt= to learn it "
                         "at run time (one of them)")
    if around is not None and timeline is not None:
        raise ValueError("run_actions: pass around= or timeline=, not both")
    if learnt is not None and any(a.kind in (Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT)
                                  for a in actions):
        raise ValueError("run_actions(learnt=...): activations learnt at run time go with "
                         "whole backwards (B); this list splits them (I/W)")
    run = _Run(forward, params, pp, shape, dtype, device, stages, zero, weight_grads)
    run.learnt = learnt
    if peers is not None:
        run.received = sends_received(peers, pp.rank)
    # each stage's last backward syncs ([Note: ZeRO under a schedule])
    last = set({a.stage: i for i, a in enumerate(actions)
                if a.kind in (Kind.BACKWARD, Kind.BACKWARD_WEIGHT)}.values())
    # each stage's last action that reads its weights: its chunk is freed after it
    # ([Note: ZeRO-3's parameters over a step])
    reads = {i: s for s, i in {a.stage: i for i, a in enumerate(actions)
                               if a.kind in (Kind.BACKWARD, Kind.BACKWARD_INPUT)}.items()}
    hold = zero is not None and not reshard_after_micro_batch
    cuda = device.type == "cuda"
    with zero.params_held() if zero is not None and hold else contextlib.nullcontext():
        for i, a in enumerate(actions):
            if around is not None:
                with around(a):
                    run.do(a, sync=i in last)
            elif timeline is None:
                run.do(a, sync=i in last)
            else:
                if cuda:
                    torch.cuda.synchronize(device)
                start = time.perf_counter()
                run.do(a, sync=i in last)
                if cuda:
                    torch.cuda.synchronize(device)
                timeline.append((a, start, time.perf_counter()))
            if zero is not None and hold and i in reads:
                zero.release_params(stage_chunk(reads[i], pp.size))
    return run.losses


class _Run:
    """One step's state on this rank: what each (stage, micro-batch) holds between its
    actions, the sends in flight, the losses."""

    def __init__(self, forward: Forward, params: dict[int, list[torch.nn.Parameter]],
                 pp: CommGroup, shape: tuple[int, ...] | None, dtype: torch.dtype,
                 device: torch.device, stages: int, zero: ZeroHooks | None,
                 weight_grads: dict[int, WeightGradStore] | None):
        self.forward, self.params, self.pp, self.zero = forward, params, pp, zero
        self.weight_grads = weight_grads or {}
        self.shape, self.dtype, self.device, self.stages = shape, dtype, device, stages
        # (tensors; under learnt, an activation may be a tuple, its gradient a tuple)
        self.inputs: dict[Key, wire.Activation] = {}  # a stage's input (requires grad)
        self.outputs: dict[Key, wire.Activation] = {}  # its output (the loss on the last)
        self.out_grads: dict[Key, wire.Activation] = {}  # the gradient of its output
        self.in_grads: dict[Key, wire.Activation] = {}  # the gradient of its input
        # what W needs after I: the parameters' gradients, the deferred closures
        self.split: dict[Key, tuple[Pairs, list[Deferred]]] = {}
        # per peer, the sends not yet known done, oldest first: (number on the pair, work,
        # tensor); and how many of them a receive proves done ([Note: releasing ...])
        self.sends: dict[int, deque[tuple[int, object, wire.Activation]]] = {}
        self.sent: dict[int, int] = {}  # sends posted to each peer
        self.received: dict[Action, int] = {}
        self.losses: dict[int, torch.Tensor] = {}
        self.learnt: wire.Learnt | None = None  # [Note: activations of any shape]

    def do(self, a: Action, sync: bool) -> None:
        key = (a.stage, a.microbatch)
        k = a.kind
        if k is Kind.FORWARD:
            self._forward(key)
        elif k is Kind.BACKWARD:
            out, grad = self._take_output(key)
            self._backward(key, out, grad, sync)
        elif k is Kind.BACKWARD_INPUT:
            self._backward_input(key)
        elif k is Kind.BACKWARD_WEIGHT:
            self._backward_weight(key, sync)
        elif k is Kind.SEND_ACT:
            if self.learnt is not None:
                self._handshake_send(a)
            self._send(wire.detached(self.outputs[key], False), a)
        elif k is Kind.SEND_GRAD:
            self._send(self.in_grads.pop(key), a)
        elif k is Kind.RECV_ACT:
            if self.learnt is None:
                self.inputs[key] = self._recv(a).requires_grad_()
            else:
                self.inputs[key] = self._recv_learnt(a, a.stage - 1, grads=False)
        elif k is Kind.RECV_GRAD:
            self.out_grads[key] = (self._recv(a) if self.learnt is None
                                   else self._recv_learnt(a, a.stage, grads=True))
        elif k is Kind.END:
            for held in self.sends.values():
                for _, work, _t in held:
                    work.wait()  # type: ignore[attr-defined]
            self.sends.clear()
            self.sent.clear()

    def _local(self, stage: int) -> bool:
        return stage_rank(stage, self.pp.size) == self.pp.rank

    def _forward(self, key: Key) -> None:
        s, j = key
        x: wire.Activation | None
        if s == 0:
            x = None
        elif key in self.inputs:
            x = self.inputs[key]
        else:  # stage s-1 ran here (p == 1): its output, cut from its graph
            x = wire.detached(self.outputs[(s - 1, j)], True)
            self.inputs[key] = x
        out = self.forward(s, j, x)
        self.outputs[key] = out
        if s == self.stages - 1:
            assert isinstance(out, torch.Tensor)  # (the loss)
            self.losses[j] = out.detach()

    def _take_output(self, key: Key) -> tuple[wire.Activation, wire.Activation | None]:
        """(stage output, its gradient): None for the loss; received, or left by the
        stage after it on this rank."""
        s, j = key
        out = self.outputs.pop(key)
        if s == self.stages - 1:
            return out, None
        grad = self.out_grads.pop(key, None)
        if grad is None:  # (p == 1: stage s+1's input gradient, made here)
            grad = self.in_grads.pop((s + 1, j))
        return out, grad

    def _backward(self, key: Key, out: wire.Activation, grad: wire.Activation | None,
                  sync: bool) -> None:
        """The whole backward of ``out`` into the stage's parameters and its input, as
        one ZeRO backward of the stage's model chunk ([Note: ZeRO under a schedule])."""
        if self.zero is not None:
            self.zero.begin_backward(sync, part=stage_chunk(key[0], self.pp.size))
        x = self.inputs.pop(key, None)
        if self.learnt is not None and grad is not None:  # (a tuple's float members)
            torch.autograd.backward(*wire.backward_pairs(out, wire.members(grad)))
        else:
            torch.autograd.backward(out, grad)
        if self.zero is not None:
            self.zero.end_backward()
        if x is not None and self.learnt is not None:
            self.in_grads[key] = wire.input_grads(x)
        elif x is not None:
            # (the input requires grad and reaches the output)
            assert isinstance(x, torch.Tensor) and x.grad is not None
            self.in_grads[key] = x.grad

    def _backward_input(self, key: Key) -> None:
        """``I``: the one traversal, the input's gradient made, the parameters' kept for
        ``W`` and the linears' weight gradients deferred ([Note: the two halves of a
        backward])."""
        out, grad = self._take_output(key)
        x = self.inputs.pop(key, None)  # (None on stage 0: its input is the data)
        assert x is None or isinstance(x, torch.Tensor)  # (I/W: never under learnt)
        params = self.params[key[0]]
        wanted: list[torch.Tensor] = ([x] if x is not None else []) + list(params)
        store = self.weight_grads.get(key[0])
        block: contextlib.AbstractContextManager[list[Deferred]] = (
            store.deferring() if store is not None else contextlib.nullcontext([]))
        with block as later:
            got = torch.autograd.grad(out, wanted, grad, allow_unused=True)
        if x is not None:
            assert got[0] is not None  # (the input requires grad and reaches the output)
            self.in_grads[key] = got[0]
        kept: Pairs = [(p, g) for p, g in zip(params, got[len(wanted) - len(params):])
                       if g is not None]
        self.split[key] = (kept, list(later))

    def _backward_weight(self, key: Key, sync: bool) -> None:
        """``W``: the deferred weight gradients computed, and every parameter gradient of
        the micro-batch added into ``.grad`` through autograd, as one ZeRO backward."""
        kept, later = self.split.pop(key)
        total: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for p, g in kept + run_deferred(later):  # one root per parameter: its hooks once
            have = total.get(id(p))
            total[id(p)] = (p, g if have is None else have[1] + g)
        if self.zero is not None:
            self.zero.begin_backward(sync, part=stage_chunk(key[0], self.pp.size))
        if total:
            torch.autograd.backward([p for p, _ in total.values()],
                                    [g for _, g in total.values()])
        if self.zero is not None:
            self.zero.end_backward()

    def _send(self, t: wire.Activation, a: Action) -> None:
        """Post ``t`` (a tensor; under ``learnt``, a tuple of them) to ``a.peer``."""
        assert a.peer is not None  # (a send names its peer)
        work = self.pp.exchange([(m, a.peer) for m in wire.members(t)], [], what=str(a),
                                async_op=True, about=in_words(a, self.pp.ranks[a.peer]))
        n = self.sent.get(a.peer, 0)
        self.sent[a.peer] = n + 1
        self.sends.setdefault(a.peer, deque()).append((n, work, t))

    def _recv(self, a: Action) -> torch.Tensor:
        assert a.peer is not None and self.shape is not None  # (a receive names its peer)
        buf = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        self.pp.exchange([], [(buf, a.peer)], what=str(a),
                         about=in_words(a, self.pp.ranks[a.peer]))
        self._release(a.peer, self.received.get(a, 0))
        return buf

    def _handshake_send(self, a: Action) -> None:
        """Before the first activation over stage ``a.stage``'s boundary, its spec
        (hybrid/pipeline/wire.py, [Note: the metadata handshake]); after, a check that
        the output still fits it."""
        assert a.peer is not None and self.learnt is not None
        out = self.outputs[(a.stage, a.microbatch)]
        spec = wire.spec_of(out)
        known = self.learnt.specs.get(a.stage)
        if known is None:
            body = wire.encode(spec).to(self.device)
            length = torch.tensor([body.numel()], dtype=torch.int64, device=self.device)
            for t in (length, body):  # (small, and waited for: the tensors are local)
                self.pp.exchange([(t, a.peer)], [], what=f"meta {a}",
                                 about=in_words(a, self.pp.ranks[a.peer]))
            self.learnt.specs[a.stage] = spec
        elif known != spec:
            raise ValueError(f"stage {a.stage}'s output changed from {known} to {spec} "
                             f"(micro-batch {a.microbatch}): the shapes between stages are "
                             f"learnt once and fixed; keep every micro-batch the same size")

    def _recv_learnt(self, a: Action, boundary: int, grads: bool) -> wire.Activation:
        """Receive an activation over ``boundary`` (stage ``boundary``'s output; its spec
        learnt first, the first time), or the gradients of the floating-point members
        of one this rank sent over it. An activation's floating-point members require
        grad; one tensor arrives bare."""
        assert a.peer is not None and self.learnt is not None
        about = in_words(a, self.pp.ranks[a.peer])
        spec = self.learnt.specs.get(boundary)
        if spec is None:
            assert not grads  # (this rank sent that activation: it learnt the spec then)
            length = torch.empty(1, dtype=torch.int64, device=self.device)
            self.pp.exchange([], [(length, a.peer)], what=f"meta {a}", about=about)
            body = torch.empty(int(length.item()), dtype=torch.int64, device=self.device)
            self.pp.exchange([], [(body, a.peer)], what=f"meta {a}", about=about)
            spec = self.learnt.specs[boundary] = wire.decode(body.cpu())
        if grads:
            spec = tuple(m for m in spec if m[1].is_floating_point)
        bufs = [torch.empty(shape, dtype=dtype, device=self.device) for shape, dtype in spec]
        self.pp.exchange([], [(b, a.peer) for b in bufs], what=str(a), about=about)
        self._release(a.peer, self.received.get(a, 0))
        if grads:
            return tuple(bufs)
        got = tuple(b.requires_grad_(b.is_floating_point()) for b in bufs)
        return got[0] if len(got) == 1 else got

    def _release(self, peer: int, done: int) -> None:
        """Wait on (done already: [Note: releasing what was sent]) and drop the sends to
        ``peer`` numbered below ``done``."""
        held = self.sends.get(peer)
        while held and held[0][0] < done:
            held.popleft()[1].wait()  # type: ignore[attr-defined]

    def held(self) -> int:
        """How many sent tensors this rank still holds."""
        return sum(len(h) for h in self.sends.values())


def sends_received(ranks: Sequence[Sequence[Action]], r: int) -> dict[Action, int]:
    """For each receive in rank ``r``'s list, how many of ``r``'s sends to that receive's
    peer are done once it completes: the receives the peer's list runs from ``r`` before
    the matching send ([Note: releasing what was sent]). Torch-free, O(actions)."""
    out: dict[Action, int] = {}
    for q, theirs in enumerate(ranks):
        if q == r:
            continue
        # in q's list, how many receives from r precede each of its sends to r, in order
        before, counts = 0, []
        for a in theirs:
            if a.kind in RECVS and a.peer == r:
                before += 1
            elif a.kind in SENDS and a.peer == r:
                counts.append(before)
        mine = [a for a in ranks[r] if a.kind in RECVS and a.peer == q]
        out.update(zip(mine, counts))
    return out
