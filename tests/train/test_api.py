"""``hybrid.initialize`` on a model hybrid did not build: a ``transformers`` GPT-2 (random
init, tiny config, no download) at DP 2 and ZeRO stages 0-3 (and the host offload)
follows one process's ``torch.optim.AdamW`` on the same global batches, micro-batch
loss by micro-batch loss; a checkpoint saved through the API resumes exactly, with
the caller's client_state."""

import pytest
import torch

from harness import run_ranks

transformers = pytest.importorskip("transformers")

STEPS, ACCUM, SEQ, VOCAB = 3, 2, 16, 64


def _gpt2():
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB,
                                  n_positions=SEQ, resid_pdrop=0.0, embd_pdrop=0.0,
                                  attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg)


def _ds(stage, **extra):
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": ACCUM,
            "gradient_clipping": 1.0, "zero_optimization": {"stage": stage, **extra},
            "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.1}}}


def _batches(step: int) -> torch.Tensor:
    """The global batch of ``step``: (2 DP ranks x ACCUM micro-batches, SEQ) tokens."""
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, VOCAB, (2 * ACCUM, SEQ), generator=g)


def _mine(batch: torch.Tensor, dp_rank: int, k: int) -> torch.Tensor:
    return batch[dp_rank * ACCUM + k].unsqueeze(0)


def _reference(steps):
    """One process, torch AdamW (decay on matrices only, as hybrid's), clip 1.0: the
    micro-batch losses of every step, in (step, dp rank, micro) order."""
    model = _gpt2()
    decay = [p for p in model.parameters() if p.ndim >= 2]
    rest = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": rest, "weight_decay": 0.0}], lr=3e-3)
    out = []
    for step in steps:
        batch = _batches(step)
        for i in range(batch.shape[0]):
            x = batch[i].unsqueeze(0)
            loss = model(x, labels=x).loss
            (loss / batch.shape[0]).backward()
            out.append(float(loss.detach()))
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
    return out


def _train(engine, ps, steps):
    losses = []
    for step in steps:
        batch = _batches(step)
        for k in range(ACCUM):
            x = _mine(batch, ps.dp_rank, k)
            loss = engine(x, labels=x).loss
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.detach()))
    return losses


def sched_of(engine):
    return engine.lr_scheduler


def _run(ps, variants, ckpt_root):
    import hybrid
    out = []
    for i, (stage, extra, resume) in enumerate(variants):
        engine, _, _, sched = hybrid.initialize(model=_gpt2(), config=_ds(stage, **extra),
                                                parallel_state=ps)
        losses = _train(engine, ps, range(STEPS))
        got = {"losses": losses, "steps": engine.global_steps, "lr": sched.get_last_lr()}
        if resume:
            save = f"{ckpt_root}/v{i}"
            engine.save_checkpoint(save, client_state={"epoch": 7})
            more = _train(engine, ps, range(STEPS, STEPS + 2))
            engine.close()
            fresh, _, _, _ = hybrid.initialize(model=_gpt2(), config=_ds(stage, **extra),
                                               parallel_state=ps)
            path, client = fresh.load_checkpoint(save)
            got.update(client=client, path=path, fresh_steps=fresh.global_steps,
                       lr_steps=sched_of(fresh).steps, continued=more,
                       resumed=_train(fresh, ps, range(STEPS, STEPS + 2)))
            fresh.close()
        else:
            engine.close()
        out.append(got)
    return out


VARIANTS = [(0, {}, False), (1, {}, False), (2, {"offload_optimizer": {"device": "cpu"}}, False),
            (3, {"stage3_param_persistence_threshold": 0}, True)]


def test_a_transformers_gpt2_trains_as_one_process_at_every_stage(tmp_path):
    ref = _reference(range(STEPS))
    res = run_ranks(_run, world_size=2, args=(VARIANTS, str(tmp_path)))
    for rank, per_rank in enumerate(res):
        # this rank's micro-batches in the reference's (step, dp rank, micro) order
        mine = [ref[s * 2 * ACCUM + rank * ACCUM + k] for s in range(STEPS) for k in range(ACCUM)]
        for (stage, extra, resume), got in zip(VARIANTS, per_rank):
            what = f"rank {rank}, stage {stage} {extra}"
            assert got["steps"] == STEPS, what
            for a, b in zip(got["losses"], mine):
                assert abs(a - b) <= 1e-5 * abs(b), (what, got["losses"], mine)
            if resume:
                assert got["resumed"] == got["continued"], what
                assert got["client"] == {"epoch": 7}, what
                assert got["fresh_steps"] == got["lr_steps"] == STEPS, what
                assert got["path"].endswith(f"iter_{STEPS:07d}"), what
