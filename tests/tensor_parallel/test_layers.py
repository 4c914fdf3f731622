"""Column/Row-parallel linear and vocab-parallel embedding equal their torch equivalents."""

import pytest
import torch
import torch.nn.functional as F

from hybrid.parallel.state import ParallelState
from hybrid.tensor_parallel import (
    ColumnParallelLinear,
    Init,
    RowParallelLinear,
    VocabParallelEmbedding,
    init_parameters,
    shard_of,
)
from tests.helpers.harness import run_ranks

IN, OUT, V, D = 8, 12, 16, 6


def _rand(seed, *shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _load(layer, fulls):
    with torch.no_grad():
        for p, full in zip([layer.weight] + ([layer.bias] if getattr(layer, "bias", None)
                                             is not None else []), fulls):
            p.copy_(shard_of(full, p))


def _layers_worker(ps):
    g, out = ps.tp_group, {}
    w, b, x = _rand(1, OUT, IN), _rand(2, OUT), _rand(3, 4, IN)
    for gather in (False, True):  # column: y = x W^T + b, W split by rows
        layer = ColumnParallelLinear(IN, OUT, g, gather_output=gather)
        _load(layer, [w, b])
        xi = x.clone().requires_grad_()
        y = layer(xi)
        dy = _rand(4, 4, OUT)
        y.backward(dy if gather else dy.chunk(g.size, -1)[g.rank])
        out[f"col{gather}"] = (y.detach(), xi.grad, layer.weight.grad, layer.bias.grad)
    w2, b2, x2 = _rand(5, OUT, IN), _rand(6, OUT), _rand(7, 4, IN)
    for parallel in (True, False):  # row: W split by columns, bias after the reduce
        layer = RowParallelLinear(IN, OUT, g, input_is_parallel=parallel)
        _load(layer, [w2, b2])
        xi = (x2.chunk(g.size, -1)[g.rank] if parallel else x2).clone().requires_grad_()
        y = layer(xi)
        y.backward(_rand(8, 4, OUT))
        out[f"row{parallel}"] = (y.detach(), xi.grad, layer.weight.grad, layer.bias.grad)
    emb = VocabParallelEmbedding(V, D, g)
    table = _rand(9, V, D)
    _load(emb, [table])
    ids = torch.tensor([[0, 3, V - 1, 7], [V // 2, V // 2 - 1, 1, V - 2]])
    y = emb(ids)
    y.backward(_rand(10, 2, 4, D))
    out["emb"] = (y.detach(), emb.weight.grad)
    return out


def _reference():
    ref = {}
    for name, (w0, b0, x0, dy) in {"col": (_rand(1, OUT, IN), _rand(2, OUT), _rand(3, 4, IN),
                                           _rand(4, 4, OUT)),
                                   "row": (_rand(5, OUT, IN), _rand(6, OUT), _rand(7, 4, IN),
                                           _rand(8, 4, OUT))}.items():
        w_, b_, x_ = (t.clone().requires_grad_() for t in (w0, b0, x0))
        y = F.linear(x_, w_, b_)
        y.backward(dy)
        ref[name] = (y.detach(), x_.grad, w_.grad, b_.grad)
    table = _rand(9, V, D).requires_grad_()
    ids = torch.tensor([[0, 3, V - 1, 7], [V // 2, V // 2 - 1, 1, V - 2]])
    y = F.embedding(ids, table)
    y.backward(_rand(10, 2, 4, D))
    ref["emb"] = (y.detach(), table.grad)
    return ref


def close(a, b):
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tp", [2, 4])
def test_parallel_layers_equal_torch_layers(tp):
    res, ref = run_ranks(_layers_worker, world_size=tp, tp=tp), _reference()
    for gather in (False, True):
        y_ref, dx_ref, dw_ref, db_ref = ref["col"]
        ys = [r[f"col{gather}"][0] for r in res]
        close(ys[0] if gather else torch.cat(ys, -1), y_ref)
        for r in res:  # the input grad is all-reduced over TP (the f operator)
            close(r[f"col{gather}"][1], dx_ref)
        close(torch.cat([r[f"col{gather}"][2] for r in res], 0), dw_ref)
        close(torch.cat([r[f"col{gather}"][3] for r in res], 0), db_ref)
    for parallel in (True, False):
        y_ref, dx_ref, dw_ref, db_ref = ref["row"]
        for r in res:
            close(r[f"row{parallel}"][0], y_ref)
            close(r[f"row{parallel}"][3], db_ref)  # replicated bias: full grad everywhere
        dx = [r[f"row{parallel}"][1] for r in res]
        close(torch.cat(dx, -1) if parallel else dx[0], dx_ref)
        close(torch.cat([r[f"row{parallel}"][2] for r in res], 1), dw_ref)
    for r in res:
        close(r["emb"][0], ref["emb"][0])
    close(torch.cat([r["emb"][1] for r in res], 0), ref["emb"][1])


def _init_worker(ps):
    col = ColumnParallelLinear(IN, OUT, ps.tp_group)
    row = RowParallelLinear(OUT, IN, ps.tp_group)
    model = torch.nn.ModuleDict({"col": col, "row": row})
    init_parameters(model, 42, lambda name: Init("normal", 1.0))
    return {n: p.detach() for n, p in model.named_parameters()}


def test_init_is_layout_independent():
    tp2 = run_ranks(_init_worker, world_size=2, tp=2)
    tp1 = _init_worker(ParallelState.single())
    assert torch.equal(torch.cat([r["col.weight"] for r in tp2], 0), tp1["col.weight"])
    assert torch.equal(torch.cat([r["col.bias"] for r in tp2], 0), tp1["col.bias"])
    assert torch.equal(torch.cat([r["row.weight"] for r in tp2], 1), tp1["row.weight"])
    assert torch.equal(tp2[0]["row.bias"], tp1["row.bias"])
    assert torch.equal(tp2[1]["row.bias"], tp1["row.bias"])


def test_split_size_must_divide():
    class TP3:
        size, rank = 3, 0
    with pytest.raises(ValueError, match="not divisible"):
        ColumnParallelLinear(IN, 10, TP3())
