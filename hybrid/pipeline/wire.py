"""What crosses a stage boundary when the model does not say: learnt at run time.

hybrid's GPT knows its activation's shape from the config (``run_actions(shape=...)``).
A model given as a list of layers (``hybrid.deepspeed.pipe``) does not: a stage's output
is a tensor or a tuple of tensors of any shapes and dtypes. :class:`Learnt` holds, per
boundary, the :data:`Spec` of what crossed it, filled by a metadata message the first time
a boundary is used and kept for later steps.

[Note: the metadata handshake]
Before its first activation to stage ``s + 1`` the sending rank sends two int64 messages
through the same :meth:`~hybrid.parallel.comm.CommGroup.exchange` door as the activations
(so their bytes are counted and the recorder sees them): the body's length, then the body
(:func:`encode`: the number of tensors, then per tensor its dtype's index in
:data:`DTYPES`, its number of dimensions and its sizes). The receiving rank, before its
first activation from stage ``s``, receives the two. Messages between two ranks match in
order, so the handshake meets its partner whatever the schedule. Each side records the
spec in its own :class:`Learnt`; both fill it at the same (first) use and skip the
handshake after, so a later step costs nothing. A later output whose spec differs is a
ValueError on the sender (a boundary's shapes are fixed, as in DeepSpeed without
``dynamic_shape``).

Gradients need no handshake: the gradient of an activation goes back to the rank that
sent it, which knows its spec. Gradients travel for the floating-point members only
(:func:`grad_members`): an integer member (a mask, token ids) has none.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

# one (shape, dtype) per tensor of what crosses a boundary
Spec = tuple[tuple[tuple[int, ...], torch.dtype], ...]
# a stage's output as it travels: one tensor, or a tuple of them
Activation = torch.Tensor | tuple[torch.Tensor, ...]

DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64,
          torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)


@dataclass
class Learnt:
    """Per boundary (keyed by the sending stage), the spec of what crosses it (module
    note). A spec of one tensor arrives as that tensor, not a one-tensor tuple."""

    specs: dict[int, Spec] = field(default_factory=dict)


def members(x: Activation) -> tuple[torch.Tensor, ...]:
    """The tensors of an activation, in order."""
    if isinstance(x, torch.Tensor):
        return (x,)
    if not (isinstance(x, tuple) and all(isinstance(t, torch.Tensor) for t in x)):
        raise TypeError(f"a stage's output must be a tensor or a tuple of tensors to cross "
                        f"a pipeline boundary, got {_kind(x)}")
    return x


def _kind(x: object) -> str:
    if isinstance(x, (tuple, list)):
        return f"{type(x).__name__} of ({', '.join(type(t).__name__ for t in x)})"
    return type(x).__name__


def spec_of(x: Activation) -> Spec:
    return tuple((tuple(t.shape), t.dtype) for t in members(x))


def encode(spec: Spec) -> torch.Tensor:
    """The int64 body of the handshake (module note)."""
    body = [len(spec)]
    for shape, dtype in spec:
        if dtype not in DTYPES:
            raise TypeError(f"a pipeline activation of dtype {dtype}: the boundary carries "
                            f"{', '.join(str(d) for d in DTYPES)}")
        body += [DTYPES.index(dtype), len(shape), *shape]
    return torch.tensor(body, dtype=torch.int64)


def decode(body: torch.Tensor) -> Spec:
    values = body.tolist()
    out, i = [], 1
    for _ in range(values[0]):
        dtype, ndim = DTYPES[values[i]], values[i + 1]
        out.append((tuple(values[i + 2:i + 2 + ndim]), dtype))
        i += 2 + ndim
    return tuple(out)


def grad_members(x: Activation) -> list[int]:
    """Which members of an activation carry a gradient back: the floating-point ones."""
    return [i for i, t in enumerate(members(x)) if t.is_floating_point()]


def detached(x: Activation, requires_grad: bool) -> Activation:
    """``x`` cut from its graph, its floating-point members requiring grad if asked."""
    out = tuple(t.detach().requires_grad_(requires_grad and t.is_floating_point())
                for t in members(x))
    return out[0] if isinstance(x, torch.Tensor) else out


def input_grads(x: Activation) -> tuple[torch.Tensor, ...]:
    """After a backward, the gradients of the floating-point members of a stage's input
    (zeros for a member the output does not depend on: the sender waits for one)."""
    ts = members(x)
    return tuple(_grad_or_zeros(ts[i]) for i in grad_members(x))


def _grad_or_zeros(t: torch.Tensor) -> torch.Tensor:
    return t.grad if t.grad is not None else torch.zeros_like(t)


def backward_pairs(out: Activation, grads: tuple[torch.Tensor, ...]
                   ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The (output, gradient) pairs of a stage's backward: each floating-point member
    of ``out`` that requires grad, with the gradient received for it."""
    ts = members(out)
    pairs = [(ts[i], g) for i, g in zip(grad_members(out), grads, strict=True)
             if ts[i].requires_grad]
    return [t for t, _ in pairs], [g for _, g in pairs]
