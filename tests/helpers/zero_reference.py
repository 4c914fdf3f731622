"""The shared ZeRO training reference: a tiny GPT, its config, the global batches, a
few DP steps through the engine and the same steps in plain torch (tests/zero/,
tests/models/test_llama.py, tests/tensor_parallel/test_sequence_parallel.py)."""

import torch

from hybrid.config import Flags, build_config
from hybrid.config.model import ModelConfig
from hybrid.recompute.checkpointing import apply_activation_checkpointing
from hybrid.tensor_parallel import InitValues, seed_all
from hybrid.zero import apply_zero
from models.gpt import GPT

SEED, VOCAB, SEQ, STEPS, GLOBAL_BATCH, MICRO = 5, 257, 16, 3, 8, 2

# Buckets of 4000 elements, for the curve tests whose subject is not bucketing (SP,
# Llama, CP, shared parameters, the stages against the reference). Each collective round
# costs wake-ups of every rank (4 ranks on 2 cores in CI), and at _train_cfg's 1000 a
# step is hundreds of them; at 4000 it is about half as many, and the layouts stay the
# same in kind: the embedding (12288 elements at TP 1, 8192 at TP 2, 4096 at TP 4) is
# still larger than a bucket (a unit of its own at stages 0-2), other units still pack
# several parameters, and stage 3's gathered units are still over a bucket. (The bounds
# on messages and staging buffers are checked at 1000 in
# tests/zero/test_zero.py::test_no_message_exceeds_the_bucket_whatever_the_model_size.)
BUCKETS = {"reduce_bucket_size": 4000, "allgather_bucket_size": 4000}


def _train_cfg(world, tp, **kw):
    base = dict(tensor_model_parallel_size=tp, num_layers=2, hidden_size=32,
                num_attention_heads=4, seq_length=SEQ, hidden_dropout=0.0,
                attention_dropout=0.0, micro_batch_size=MICRO, global_batch_size=GLOBAL_BATCH,
                lr=1e-2, weight_decay=0.1, clip_grad=0.5, reduce_bucket_size=1000,
                allgather_bucket_size=1000, zero_param_persistence_threshold=0, seed=SEED,
                # Adam divides each gradient element by sqrt(v) + eps, so an element whose
                # gradient is a cancellation of rounding-sized terms (the attention key
                # bias's true gradient is exactly zero) turns a last-bit difference of the
                # summation order (TP/DP split against one process) into an update
                # difference of about lr * dg / eps. At eps 1e-4 that reached 1.2e-6 on one
                # QKV weight (TP2xDP2, an AVX2 CPU), past the 1e-6 the parameters are
                # compared to; eps 1e-3 keeps the comparison about the distributed
                # arithmetic, not the CPU's rounding.
                adam_eps=1e-3)
    base.update(kw)
    return build_config(Flags(**base), world)


def zero_engine(model, ps, cfg, **kw):
    """``apply_zero`` with every section of ``cfg`` it takes, as training passes them
    (hybrid/train/setup.py); ``kw``: values, unit_modules, recompute."""
    return apply_zero(model, ps, cfg.zero, adamw=cfg.adamw, precision=cfg.precision,
                      offload=cfg.offload, **kw)


def _gpt(cfg, ps, device="cpu"):
    rng = seed_all(cfg.seed, ps.tp_rank, ps.dp_rank, ps.device)
    m = ModelConfig(vocab_size=VOCAB, num_layers=cfg.model.num_layers,
                    hidden_size=cfg.model.hidden_size,
                    num_attention_heads=cfg.model.num_attention_heads,
                    max_position_embeddings=SEQ, hidden_dropout=0.0, attention_dropout=0.0)
    return GPT(m, ps.tp_group, rng=rng, seed=cfg.seed, device=device,
               sequence_parallel=cfg.parallel.sequence_parallel)


def _global_batch(step):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=g)


def _my_micro_batches(step, ps, micro):
    per = GLOBAL_BATCH // ps.dp_size
    mine = _global_batch(step)[ps.dp_rank * per: (ps.dp_rank + 1) * per]
    return [(b[:, :-1], b[:, 1:]) for b in mine.split(micro)]


def _named_params(model, engine):
    with engine.gathered():
        return {n: p.detach().float().clone() for n, p in model.named_parameters()}


def _dp_step(model, engine, ps, cfg, step):
    """One optimizer step on global batch ``step`` of the shared data: (the loss,
    averaged over DP, the engine's StepResult)."""
    engine.zero_grad()
    batches = _my_micro_batches(step, ps, cfg.loop.micro_batch_size)
    total = torch.zeros(())
    for i, (x, y) in enumerate(batches):
        loss = model(x, y) / len(batches)
        engine.backward(loss, sync=i == len(batches) - 1)
        total += loss.detach().float()
    ps.dp_group.all_reduce(total)
    return float(total) / ps.dp_size, engine.step(cfg.lr_schedule.lr)


def _train_steps(model, engine, ps, cfg, steps=STEPS):
    """``steps`` optimizer steps on the shared data: (mean losses over DP, grad norms)."""
    losses, norms = [], []
    for step in range(steps):
        loss, result = _dp_step(model, engine, ps, cfg, step)
        losses.append(loss)
        norms.append(float(result.grad_norm))
    return losses, norms


def _train_stages(ps, variants, steps=STEPS):
    """For each variant (stage, overrides): ``steps`` steps; losses, norms, final params.
    ``recompute_granularity`` in the overrides wraps the blocks as training does."""
    out = []
    for stage, kw in variants:
        cfg = _train_cfg(ps.world_size, ps.tp_size, zero_stage=stage, **kw)
        model = _gpt(cfg, ps, device="meta")  # as training builds it: ZeRO materializes
        phase = None
        if cfg.recompute.granularity:
            phase = apply_activation_checkpointing(model, ps, model.rng, cfg.recompute).phase
        engine = zero_engine(model, ps, cfg, values=InitValues(cfg.seed, model.init_of),
                             recompute=phase)
        losses, norms = _train_steps(model, engine, ps, cfg, steps)
        specs = {n: getattr(p, "tp_spec", None) for n, p in model.named_parameters()}
        out.append({"losses": losses, "norms": norms,
                    "params": _named_params(model, engine), "specs": specs})
    return out


def _train_reference(model, cfg, steps=STEPS):
    """Plain torch on a one-process model: torch.optim.AdamW (no decay on biases and
    norms), clip_grad_norm_, the whole global batch in MICRO-sized micro-batches."""
    params = list(model.parameters())
    opt = torch.optim.AdamW([{"params": [p for p in params if p.ndim >= 2],
                              "weight_decay": cfg.adamw.weight_decay},
                             {"params": [p for p in params if p.ndim < 2],
                              "weight_decay": 0.0}], lr=cfg.lr_schedule.lr, eps=cfg.adamw.eps)
    losses, norms = [], []
    for step in range(steps):
        opt.zero_grad()
        batches = [(b[:, :-1], b[:, 1:]) for b in _global_batch(step).split(MICRO)]
        total = 0.0
        for x, y in batches:
            loss = model(x, y) / len(batches)
            loss.backward()
            total += loss.item()
        losses.append(total)
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.adamw.clip_grad)))
        opt.step()
    return {"losses": losses, "norms": norms,
            "params": {n: p.detach().clone() for n, p in model.named_parameters()}}
