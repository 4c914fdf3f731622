"""The executor runs any schedule's lists on real ranks: a 4-layer GPT cut into two
uneven stages (PP 2: embeddings + 1 layer | 3 layers + head and loss) trains as the
whole model in one process, with every schedule that has one stage per rank (GPipe,
1F1B, ZB-H1's split backward): each micro-batch's loss and every parameter's
gradient within 1e-5, and through a ZeRO engine per stage (stages 0 and 2: a
stage's gradients reduced once a step) the parameters after an AdamW step. The
sends are counted as p2p bytes: one activation and one gradient per micro-batch
and stage boundary. Interleaved 1F1B, each rank holding two one-layer chunks in one
module and one engine over both (ZeRO 0-3), trains as the same whole model."""

import pytest
import torch

from hybrid.config.model import ModelConfig
from hybrid.pipeline.executor import run_actions
from hybrid.pipeline.schedules import build_schedule
from tests.helpers.harness import run_ranks

M, B, T = 4, 2, 8  # micro-batches, micro-batch size, sequence
SPLIT = (range(0, 1), range(1, 4))
SCHEDULES = ("gpipe", "1f1b", "zb_h1")


def _cfg():
    return ModelConfig(num_layers=4, hidden_size=32, num_attention_heads=4,
                       max_position_embeddings=T, hidden_dropout=0.0, attention_dropout=0.0,
                       untie_embeddings_and_output_weights=True).with_vocab_size(64)


def _batches():
    g = torch.Generator().manual_seed(5)
    return [(torch.randint(0, 64, (B, T), generator=g), torch.randint(0, 64, (B, T), generator=g))
            for _ in range(M)]


def _model(stage=None, split_backward=False):
    from hybrid.parallel.state import ParallelState
    from models.gpt import GPT
    g = ParallelState.single().tp_group
    if stage is None:
        return GPT(_cfg(), g, seed=3)
    return GPT(_cfg(), g, seed=3, layers=SPLIT[stage], pre_process=stage == 0,
               post_process=stage == 1, split_backward=split_backward)


def _reference():
    model = _model()
    losses = []
    for tokens, labels in _batches():
        loss = model(tokens, labels)
        (loss / M).backward()
        losses.append(loss.item())
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0, eps=1e-3)
    opt.step()
    return losses, grads, {n: p.detach().clone() for n, p in model.named_parameters()}


def _stage_run(ps, name, zero_stage):
    from hybrid.config.sections import AdamWConfig, ZeroConfig
    from hybrid.parallel.state import ParallelState
    from hybrid.zero import apply_zero
    pp = ps.world_group  # two ranks: the pipeline
    stage = pp.rank
    model = _model(stage, split_backward=name == "zb_h1")  # (its linears defer to I's W)
    engine = None
    if zero_stage is not None:  # a ZeRO engine over this stage alone (DP 1)
        engine = apply_zero(model, ParallelState.single(), ZeroConfig(stage=zero_stage),
                            adamw=AdamWConfig(weight_decay=0.0, eps=1e-3, clip_grad=0.0))
    batches = _batches()

    def forward(s, j, x):
        tokens, labels = batches[j]
        if s == 0:
            return model(tokens)
        return model(hidden=x, labels=labels) / M

    schedule = build_schedule(name, 2, M)
    before = pp.stats.bytes["p2p"]
    losses = run_actions(schedule.ranks[stage], forward,
                         {stage: [p for p in model.parameters() if p.requires_grad]}, pp,
                         shape=(B, T, 32), dtype=torch.float32, device=torch.device("cpu"),
                         stages=2, zero=engine,
                         weight_grads=None if model.weight_grads is None
                         else {stage: model.weight_grads})
    sent = pp.stats.bytes["p2p"] - before
    out = {"losses": {j: float(v) * M for j, v in losses.items()}, "sent": sent}
    if engine is None:
        out["grads"] = {n: p.grad.clone() for n, p in model.named_parameters()}
    else:
        engine.step(1e-2)
        with engine.gathered():
            out["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return out


@pytest.mark.parametrize("zero_stage", [None, 0, 2, 3])
def test_every_schedule_trains_the_stages_as_the_whole_model(zero_stage):
    ref_losses, ref_grads, ref_params = _reference()
    for name in SCHEDULES:
        first, last = run_ranks(_stage_run, world_size=2, args=(name, zero_stage))
        assert first["losses"] == {} and sorted(last["losses"]) == list(range(M)), name
        for j in range(M):
            assert abs(last["losses"][j] - ref_losses[j]) <= 1e-5 * ref_losses[j], name
        act = B * T * 32 * 4
        assert first["sent"] == M * act and last["sent"] == M * act, name  # acts | grads
        for got in (first, last):
            if zero_stage is None:
                for n, g in got["grads"].items():
                    torch.testing.assert_close(g, ref_grads[n], rtol=1e-5, atol=1e-6,
                                               msg=f"{name}: {n}")
            else:
                for n, p in got["params"].items():
                    torch.testing.assert_close(p, ref_params[n], rtol=1e-5, atol=1e-6,
                                               msg=f"{name}: {n}")


def _chunked_model(r):
    """Rank r's two chunks of the 4-layer GPT at PP 2 x 2 chunks: layer r, then layer
    2 + r (pieces r and 2 + r); the embeddings on rank 0's first, the head on rank 1's
    last."""
    from hybrid.parallel.state import ParallelState
    from models.gpt import GPT
    return GPT(_cfg(), ParallelState.single().tp_group, seed=3,
               layers=[range(r, r + 1), range(2 + r, 3 + r)], pre_process=r == 0,
               post_process=r == 1)


def _interleaved_run(ps, zero_stage):
    from hybrid.config.sections import AdamWConfig, ZeroConfig
    from hybrid.parallel.state import ParallelState
    from hybrid.zero import apply_zero
    pp = ps.world_group
    r = pp.rank
    model = _chunked_model(r)
    engine = None
    if zero_stage is not None:  # one engine over the rank's two chunks, in two parts
        # (small buckets and threshold: units the plan would make across the chunks)
        engine = apply_zero(model, ParallelState.single(),
                            ZeroConfig(stage=zero_stage, reduce_bucket_size=3000,
                                       param_persistence_threshold=200),
                            adamw=AdamWConfig(weight_decay=0.0, eps=1e-3, clip_grad=0.0),
                            parts=model.chunk_parameters())
    batches = _batches()

    def forward(s, j, x):
        tokens, labels = batches[j]
        if s == 0:
            return model(tokens)
        if s == 3:
            return model(hidden=x, labels=labels, chunk=1) / M
        return model(hidden=x, chunk=s // 2)

    schedule = build_schedule("1f1b", 2, M, 2)
    assert schedule.name == "interleaved_1f1b"
    chunks = model.chunk_parameters()
    before = pp.stats.bytes["p2p"]
    losses = run_actions(schedule.ranks[r], forward, {r: chunks[0], 2 + r: chunks[1]}, pp,
                         shape=(B, T, 32), dtype=torch.float32, device=torch.device("cpu"),
                         stages=4, zero=engine)
    out = {"losses": {j: float(v) * M for j, v in losses.items()},
           "sent": pp.stats.bytes["p2p"] - before}
    if engine is None:
        out["grads"] = {n: p.grad.clone() for n, p in model.named_parameters()}
    else:
        out["parts"] = sorted(set(engine.unit_parts))
        engine.step(1e-2)
        with engine.gathered():
            out["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return out


@pytest.mark.parametrize("zero_stage", [None, 0, 1, 2, 3])
def test_interleaved_chunks_train_as_the_whole_model(zero_stage):
    """Interleaved 1F1B at PP 2 x 2 chunks, each rank's chunks in one module and, with
    ZeRO, one engine that knows them as two parts: every backward reaches one chunk's
    units and each chunk reduces at its own last backward. Every micro-batch loss, every
    gradient (plain autograd) and every parameter after the AdamW step (ZeRO 0-3) within
    1e-5 of the whole model in one process; each rank sends 3 tensors per micro-batch
    (rank 0: two activations and a gradient, rank 1 the other way round)."""
    ref_losses, ref_grads, ref_params = _reference()
    first, last = run_ranks(_interleaved_run, world_size=2, args=(zero_stage,))
    assert first["losses"] == {} and sorted(last["losses"]) == list(range(M))
    for j in range(M):
        assert abs(last["losses"][j] - ref_losses[j]) <= 1e-5 * ref_losses[j]
    act = B * T * 32 * 4
    assert first["sent"] == last["sent"] == 3 * M * act
    for got in (first, last):
        if zero_stage is None:
            for n, g in got["grads"].items():
                torch.testing.assert_close(g, ref_grads[n], rtol=1e-5, atol=1e-6, msg=n)
        else:
            assert got["parts"] == [0, 1]
            for n, p in got["params"].items():
                torch.testing.assert_close(p, ref_params[n], rtol=1e-5, atol=1e-6, msg=n)


def _counted_run(ps, name):
    """A step of ``name`` with every block's output gradient and every linear's weight
    gradient counted, each noted with whether the stage's store was deferring (I). The
    stage is built for the split either way (its linears hybrid's Functions at TP 1)."""
    from hybrid.tensor_parallel import column_linear, weight_grad
    pp = ps.world_group
    stage = pp.rank
    model = _model(stage, split_backward=True)
    store = model.weight_grads
    events = []

    def deferring():
        return store.active

    def on_output(module, args, out):
        out.register_hook(lambda g: events.append(("traverse", deferring())))
    for block in model.blocks:
        block.register_forward_hook(on_output)
    real = {m: m.linear_grad_weight for m in (column_linear, weight_grad)}

    def counted(real_fn):
        def fn(*a, **k):
            events.append(("dW", deferring()))
            return real_fn(*a, **k)
        return fn
    batches = _batches()

    def forward(s, j, x):
        tokens, labels = batches[j]
        return model(tokens) if s == 0 else model(hidden=x, labels=labels) / M
    try:  # (pooled ranks live on: put the kernels back)
        for m, f in real.items():
            m.linear_grad_weight = counted(f)
        run_actions(build_schedule(name, 2, M).ranks[stage], forward,
                    {stage: list(model.parameters())}, pp, shape=(B, T, 32),
                    dtype=torch.float32, device=torch.device("cpu"), stages=2,
                    weight_grads={stage: store})
    finally:
        for m, f in real.items():
            m.linear_grad_weight = f
    linears = 4 * len(model.blocks) + (stage == 1)  # qkv, proj, fc, proj; the head
    return events, len(model.blocks), linears


def test_zb_h1_traverses_each_backward_once_and_computes_each_weight_gradient_once():
    """Under ZB-H1 the input half is the only traversal of a micro-batch's graph (each
    block's output gradient once, all inside I) and the weight half only runs the
    deferred GEMMs: every linear's (and the head's) ``dW`` once per micro-batch, all
    inside W -- as many as 1F1B's whole backwards compute on the same stages."""
    for name in ("zb_h1", "1f1b"):
        for events, blocks, linears in run_ranks(_counted_run, world_size=2, args=(name,)):
            traversed = [i for e, i in events if e == "traverse"]
            weights = [i for e, i in events if e == "dW"]
            assert len(traversed) == M * blocks and len(weights) == M * linears, name
            assert all(traversed) if name == "zb_h1" else not any(traversed), name
            assert not any(weights), name  # (never while I defers)
