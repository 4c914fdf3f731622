"""GPT under context parallelism against one process (same init, same data): loss,
logits and gradients at CP 2 and 4, TP 1 and 2 (with SP), every comm type, GPT-2,
Llama-shaped (RoPE, GQA, RMSNorm, SwiGLU) and Qwen3-shaped (--kv-channels,
--qk-layernorm), --eod-mask-loss, attention dropout; then
6 AdamW steps through ZeRO over DP x CP: the loss curve of one process and replicated
parameters bit-identical on every rank that holds them."""

from dataclasses import replace

import pytest
import torch

from hybrid.config.model import ModelConfig
from hybrid.parallel.state import ParallelState
from hybrid.tensor_parallel import InitValues, seed_all, unshard
from hybrid.tensor_parallel.context_parallel import cp_shard
from hybrid.tensor_parallel.cp_attention import ContextParallel
from models.gpt import GPT
from tests.helpers.harness import run_ranks
from tests.helpers.zero_reference import BUCKETS, _train_cfg, zero_engine

SEED, V, T, B = 7, 257, 16, 2

GPT2 = ModelConfig(vocab_size=V, num_layers=2, hidden_size=32, num_attention_heads=4,
                   max_position_embeddings=T, hidden_dropout=0.0, attention_dropout=0.0)
LLAMA = replace(GPT2, normalization="RMSNorm", swiglu=True, ffn_hidden_size=48,
                position_embedding_type="rope", num_query_groups=2,
                untie_embeddings_and_output_weights=True, add_bias_linear=False)
# Qwen3-shaped: heads 16 wide (4 x 16 = 64, not the hidden 32), q and k normalized
QWEN3 = replace(LLAMA, kv_channels=16, qk_layernorm=True)


def _data():
    g = torch.Generator().manual_seed(3)
    x = torch.randint(0, V, (B, T), generator=g)
    return x, torch.roll(x, -1, dims=1), (x % 3 != 0).float()  # mask: every third id "ends"


def _model(ps, cfg, comm, layout, sp=False, cp=True):
    rng = seed_all(SEED, ps.tp_rank, ps.dp_rank, ps.device, ps.cp_rank, ps.tp_size)
    ctx = ContextParallel(ps.cp_group, comm, layout) if cp else None
    return GPT(cfg, ps.tp_group, rng=rng, seed=SEED, sequence_parallel=sp, context_parallel=ctx)


def _forward_backward(ps, cfg, comm, layout, sp=False, cp=True):
    """This rank's logits, loss, masked loss and gradients (its tokens only)."""
    model = _model(ps, cfg, comm, layout, sp, cp)
    x, y, mask = (cp_shard(t, 1, ps.cp_size, ps.cp_rank, layout) for t in _data())
    torch.manual_seed(11)  # attention dropout's seed: drawn alike on every rank
    logits = model(x).detach()
    torch.manual_seed(12)
    loss = model(x, y, mask)
    loss.backward()
    plain = model(x, y).detach()
    return {"coords": (ps.tp_rank, ps.cp_rank), "logits": logits, "loss": loss.detach(),
            "plain": plain, "grads": {n: p.grad for n, p in model.named_parameters()},
            "specs": {n: getattr(p, "tp_spec", None) for n, p in model.named_parameters()}}


def _reference(cfg, comm):
    """One process; with dropout through the same blocks (a CP group of one): the
    dropout mask depends on positions only, so it is the mask every CP run draws."""
    cp = cfg.attention_dropout > 0
    return _forward_backward(ParallelState.single(), cfg, comm, "load_balanced", cp=cp)


def _full_grad(res, name, spec, tp):
    """The whole gradient: summed over CP (each rank's part), gathered over TP."""
    parts = [sum(r["grads"][name] for r in res if r["coords"][0] == t) for t in range(tp)]
    return unshard(parts, spec)


# (model, CP, TP, SP, comm, layout, attention dropout); world 4 for all: pool layouts reused
CASES = [("gpt2", 2, 1, False, "p2p", "load_balanced", 0.0),
         ("llama", 4, 1, False, "p2p", "striped", 0.0),
         ("llama", 2, 2, True, "p2p", "load_balanced", 0.0),
         ("llama", 2, 2, False, "a2a", "load_balanced", 0.0),
         ("gpt2", 2, 2, True, "all_gather", "load_balanced", 0.1),
         ("llama", 4, 1, False, "a2a", "load_balanced", 0.1),
         ("qwen3", 2, 2, True, "p2p", "load_balanced", 0.0)]


@pytest.mark.parametrize("name,cp,tp,sp,comm,layout,dropout", CASES)
def test_gpt_cp_matches_one_process(name, cp, tp, sp, comm, layout, dropout):
    cfg = replace({"llama": LLAMA, "qwen3": QWEN3}.get(name, GPT2), attention_dropout=dropout)
    if comm == "a2a" and name == "llama":  # a2a splits each TP rank's query groups over CP
        cfg = replace(cfg, num_query_groups=4)
    ref = _reference(cfg, comm)
    res = run_ranks(_forward_backward, world_size=4, tp=tp, cp=cp,
                    args=(cfg, comm, layout, sp))
    for r in res:
        t, c = r["coords"]
        for key in ("loss", "plain"):  # the whole sequence's mean on every rank
            torch.testing.assert_close(r[key], ref[key], rtol=1e-5, atol=1e-6)
        width = r["logits"].shape[-1]  # this TP rank's vocabulary columns (padded by TP)
        lo, hi = t * width, min((t + 1) * width, V)
        want = cp_shard(ref["logits"][..., lo:hi], 1, cp, c, layout)
        torch.testing.assert_close(r["logits"][..., : hi - lo], want, rtol=1e-5, atol=1e-5)
    dp0 = res[: tp * cp]  # one DP replica (at CP 2 x TP 1 the other does the same)
    for n in ref["specs"]:
        got, want = _full_grad(dp0, n, dp0[0]["specs"][n], tp), ref["grads"][n]
        if n in ("wte.weight", "output_layer.weight"):  # padded rows: count differs by TP
            got, want = got[:V], want[:V]
        torch.testing.assert_close(got.reshape(want.shape), want, rtol=1e-5, atol=2e-6, msg=n)


# -- training through ZeRO over DP x CP -----------------------------------------------
# 4 steps over two batches: each batch seen twice, the one-process loss down by 0.33
# (past the 0.3 the test asks) and two updates on Adam moments with a history
STEPS, GLOBAL, MICRO = 4, 8, 2


def _batch(step):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, V, (GLOBAL, T + 1), generator=g)


def _train(ps, stage, comm):
    cfg = _train_cfg(ps.world_size, ps.tp_size, zero_stage=stage, seq_length=T,
                     global_batch_size=GLOBAL, micro_batch_size=MICRO,
                     context_parallel_size=ps.cp_size, cp_comm_type=comm, **BUCKETS)
    model = _model(ps, GPT2, comm, "load_balanced", cp=ps.cp_size > 1)
    model = GPT(GPT2, ps.tp_group, rng=model.rng, seed=SEED, device="meta",
                context_parallel=model.cp)
    engine = zero_engine(model, ps, cfg, values=InitValues(SEED, model.init_of))
    per = GLOBAL // ps.dp_size
    losses = []
    for step in range(STEPS):
        rows = _batch(step % 2)[ps.dp_rank * per: (ps.dp_rank + 1) * per]  # two, learnt
        rows = [cp_shard(b, 1, ps.cp_size, ps.cp_rank) for b in (rows[:, :-1], rows[:, 1:])]
        engine.zero_grad()
        total = torch.zeros(())
        n = per // MICRO
        for i in range(n):
            x, y = (b[i * MICRO: (i + 1) * MICRO] for b in rows)
            loss = model(x, y) / n
            engine.backward(loss, sync=i == n - 1)
            total += loss.detach()
        ps.dp_group.all_reduce(total)
        losses.append(float(total) / ps.dp_size)
        engine.step(cfg.lr_schedule.lr)
    with engine.gathered():
        params = {k: p.detach().clone() for k, p in model.named_parameters()}
    return losses, params


@pytest.mark.parametrize("stage,comm", [(1, "p2p"), (3, "a2a")])
def test_cp_training_follows_one_process_and_keeps_replicas_identical(stage, comm):
    """World 4 = DP 2 x CP 2: ZeRO shards over all four ranks, sums gradients over CP
    and averages over DP; 4 AdamW steps give one process's losses, and every rank ends
    with bit-identical parameters. Buckets of 4000 (zero_reference.BUCKETS)."""
    ref_losses, ref_params = _train(ParallelState.single(), stage, comm)
    res = run_ranks(_train, world_size=4, cp=2, args=(stage, comm))
    for losses, params in res:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses),
                                   rtol=2e-5, atol=0)
        for k, p in params.items():
            assert torch.equal(p, res[0][1][k]), f"{k} differs between CP/DP replicas"
            torch.testing.assert_close(p, ref_params[k], rtol=1e-4, atol=1e-5, msg=k)
    assert ref_losses[-1] < ref_losses[0] - 0.3  # it trains
