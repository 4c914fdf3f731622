"""A model in parts (an interleaved pipeline rank's chunks, hybrid/zero/parts.py): no unit
holds two parts' parameters, units within one part stay as the plan made them, and a
backward that reaches another part's units than it names is one error naming them (and,
without ignore_unused_parameters, one that leaves its own part's without a gradient)."""

import pytest
import torch
from torch import nn

from hybrid.config.sections import ZeroConfig
from hybrid.errors import TrainingError
from hybrid.parallel.state import ParallelState
from hybrid.zero import apply_zero
from hybrid.zero.parts import split_by_part


class _TwoChunks(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])

    def forward(self, x, chunk=0):
        return self.blocks[chunk](x)


def _parts(model):
    return [list(b.parameters()) for b in model.blocks]


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_no_unit_holds_two_parts(stage):
    model = _TwoChunks()
    # one bucket would hold everything; stage 3's threshold leaves the biases persistent
    engine = apply_zero(model, ParallelState.single(),
                        ZeroConfig(stage=stage, reduce_bucket_size=10_000,
                                   param_persistence_threshold=8), parts=_parts(model))
    part_of = {id(p): k for k, ps in enumerate(_parts(model)) for p in ps}
    for u, k in zip(engine.units, engine.unit_parts):
        assert {part_of[id(p)] for p in u.params} == {k}, u.name
    assert sorted(set(engine.unit_parts)) == [0, 1]
    if stage == 0:  # the one bucket, cut in two (last first: the plan packs backwards)
        assert [u.name for u in engine.units] == ["bucket0.p1", "bucket0.p0"]


def test_units_within_one_part_stay_the_same_objects():
    from hybrid.zero.flat_unit import FlatUnit
    model = _TwoChunks()
    g = ParallelState.single().dp_cp_group
    a, b = model.blocks[0].parameters(), model.blocks[1].parameters()
    whole = FlatUnit(list(a), g, name="a")
    mixed = FlatUnit([model.blocks[0].weight, model.blocks[1].weight], g, name="m")
    units, owners, parts = split_by_part([whole, mixed], [(model, mixed)], _parts(model))
    assert units[0] is whole and [u.name for u in units[1:]] == ["m.p0", "m.p1"]
    assert parts == [0, 0, 1] and [u for _, u in owners] == units[1:]
    assert all(m is model for m, _ in owners)
    with pytest.raises(ValueError, match="holds a parameter in none of the model's 1 parts"):
        split_by_part([FlatUnit(list(b), g, name="b")], [], [_parts(model)[0]])


def test_a_backward_reaching_another_part_is_named():
    model = _TwoChunks()
    engine = apply_zero(model, ParallelState.single(), ZeroConfig(stage=2),
                        parts=_parts(model))
    x = torch.randn(2, 4)
    engine.begin_backward(sync=False, part=0)
    model(x, chunk=0).sum().backward()
    engine.end_backward()  # part 0's units, all of them: fine
    engine.begin_backward(sync=True, part=0)
    (model(x, chunk=0) + model(x, chunk=1)).sum().backward()
    with pytest.raises(RuntimeError, match=r"units \['bucket0.p1'\] got gradients in a "
                                           r"backward of another part of the model"):
        engine.end_backward()
    # part 0's units got no gradient: zeros by default (hybrid/zero/grad_sync.py, [Note:
    # unused parameters]); part 1's got some, and are named
    engine.begin_backward(sync=True, part=0)
    model(x, chunk=1).sum().backward()
    with pytest.raises(RuntimeError, match=r"units \['bucket0.p1'\] got gradients in a "):
        engine.end_backward()
    # without ignore_unused_parameters, a parameter of the part without a gradient is named
    model = _TwoChunks()
    engine = apply_zero(model, ParallelState.single(),
                        ZeroConfig(stage=2, ignore_unused_parameters=False), parts=_parts(model))
    engine.begin_backward(sync=True, part=0)
    (x @ model.blocks[0].weight.T).sum().backward()  # (not the bias)
    with pytest.raises(TrainingError, match=r"parameters \['blocks.0.bias'\] \(1 in all\) "
                                            r"were not used in producing the loss"):
        engine.end_backward()
