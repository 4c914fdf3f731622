"""hybrid/pipeline/wire.py: the boundary metadata round-trips, and the gradient members
are the floating-point ones (the executor's use of it runs in tests/hybrid_deepspeed/test_pipe.py,
a (features, int64 mask) tuple between stages)."""

from __future__ import annotations

import pytest
import torch

from hybrid.pipeline import wire


def test_a_spec_round_trips_through_its_int64_body():
    x = (torch.zeros(2, 3, 4), torch.ones(5, dtype=torch.int64), torch.zeros((), dtype=torch.bool),
         torch.zeros(1, 7, dtype=torch.bfloat16))
    spec = wire.spec_of(x)
    body = wire.encode(spec)
    assert body.dtype == torch.int64 and body.tolist()[:4] == [4, 0, 3, 2]
    assert wire.decode(body) == spec
    assert wire.decode(wire.encode(wire.spec_of(torch.zeros(6)))) == (((6,), torch.float32),)


def test_gradients_go_with_the_floating_point_members():
    x = torch.randn(3, requires_grad=True)
    mask = torch.tensor([1, 0, 1])
    out = wire.detached((x * 2, mask), True)
    assert isinstance(out, tuple) and out[0].requires_grad and not out[1].requires_grad
    assert wire.grad_members(out) == [0]
    (out[0] * 3).sum().backward()
    assert torch.equal(wire.input_grads(out)[0], torch.full((3,), 3.0))
    outs, grads = wire.backward_pairs((x * 2, mask), (torch.ones(3),))
    assert len(outs) == 1 and len(grads) == 1


def test_a_stage_output_of_another_kind_is_refused():
    with pytest.raises(TypeError, match="a tensor or a tuple of tensors"):
        wire.members([torch.zeros(1)])
    with pytest.raises(TypeError, match="complex"):
        wire.encode(wire.spec_of(torch.zeros(2, dtype=torch.complex64)))
