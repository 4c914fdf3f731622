"""``hybrid.initialize`` on a model hybrid did not build: a ``transformers`` GPT-2 (random
init, tiny config, no download) at DP 2 and ZeRO stages 0-3 (and the host offload)
follows one process's ``torch.optim.AdamW`` on the same global batches, micro-batch
loss by micro-batch loss; a checkpoint saved through the API resumes exactly, with
the caller's client_state."""

import pytest
import torch

from tests.helpers.harness import run_ranks

transformers = pytest.importorskip("transformers")

STEPS, ACCUM, SEQ, VOCAB = 3, 2, 16, 64


def _model(family: str):
    """A tiny random-init ``transformers`` model (dropout off) of ``family``."""
    torch.manual_seed(0)
    t = transformers
    if family == "gpt2":
        return t.GPT2LMHeadModel(t.GPT2Config(
            n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=SEQ, resid_pdrop=0.0,
            embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))
    if family == "llama":
        return t.LlamaForCausalLM(t.LlamaConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=SEQ,
            bos_token_id=0, eos_token_id=0, pad_token_id=0))
    return t.BertForSequenceClassification(t.BertConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        vocab_size=VOCAB, max_position_embeddings=SEQ, num_labels=3, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, pad_token_id=0))


def _loss(model, family: str, x: torch.Tensor) -> torch.Tensor:
    if family == "bert":  # a sequence label from its tokens
        return model(input_ids=x, labels=x[:, 0] % 3).loss
    return model(x, labels=x).loss


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


def _reference(family, steps, init=None):
    """One process, torch AdamW (decay on every parameter, as DeepSpeed's), clip 1.0: the
    micro-batch losses of every step, in (step, dp rank, micro) order. ``init``: the
    starting parameters by name (default: the model's own init)."""
    model = _model(family)
    if init is not None:
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(init[name].view_as(p))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    out = []
    for step in steps:
        batch = _batches(step)
        for i in range(batch.shape[0]):
            x = batch[i].unsqueeze(0)
            loss = _loss(model, family, x)
            (loss / batch.shape[0]).backward()
            out.append(float(loss.detach()))
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
    return out


def _train(engine, ps, steps, family):
    losses = []
    for step in steps:
        batch = _batches(step)
        for k in range(ACCUM):
            x = _mine(batch, ps.dp_rank, k)
            loss = _loss(engine, family, x)
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.detach()))
    return losses


def sched_of(engine):
    return engine.lr_scheduler


def _run(ps, variants, ckpt_root):
    import hybrid
    out = []
    for i, (family, stage, extra, resume) in enumerate(variants):
        config = _ds(stage, **extra)
        engine, _, _, sched = hybrid.initialize(model=_model(family), config=config,
                                                parallel_state=ps)
        losses = _train(engine, ps, range(STEPS), family)
        got = {"losses": losses, "steps": engine.global_steps, "lr": sched.get_last_lr()}
        if resume:
            save = f"{ckpt_root}/v{i}"
            engine.save_checkpoint(save, client_state={"epoch": 7})
            more = _train(engine, ps, range(STEPS, STEPS + 2), family)
            engine.close()
            fresh, _, _, _ = hybrid.initialize(model=_model(family), config=config,
                                               parallel_state=ps)
            path, client = fresh.load_checkpoint(save)
            got.update(client=client, path=path, fresh_steps=fresh.global_steps,
                       lr_steps=sched_of(fresh).last_batch_iteration + 1, continued=more,
                       resumed=_train(fresh, ps, range(STEPS, STEPS + 2), family))
            fresh.close()
        else:
            engine.close()
        out.append(got)
    return out


P3 = {"stage3_param_persistence_threshold": 0}
HOST = {"offload_optimizer": {"device": "cpu"}}
VARIANTS = [("gpt2", 0, {}, False), ("gpt2", 1, {}, False), ("gpt2", 2, HOST, False),
            ("gpt2", 3, P3, True), ("llama", 0, {}, False), ("llama", 2, {}, False),
            ("llama", 3, {**P3, **HOST}, True), ("bert", 1, HOST, False),
            ("bert", 3, P3, True)]


def test_transformers_models_train_as_one_process_at_every_stage(tmp_path):
    """GPT-2, Llama (GQA, RoPE) and BERT (a classification head) at DP 2."""
    refs = {f: _reference(f, range(STEPS)) for f in ("gpt2", "llama", "bert")}
    res = run_ranks(_run, world_size=2, args=(VARIANTS, str(tmp_path)))
    for rank, per_rank in enumerate(res):
        for (family, stage, extra, resume), got in zip(VARIANTS, per_rank):
            ref = refs[family]
            # this rank's micro-batches in the reference's (step, dp rank, micro) order
            mine = [ref[s * 2 * ACCUM + rank * ACCUM + k]
                    for s in range(STEPS) for k in range(ACCUM)]
            what = f"rank {rank}, {family} stage {stage} {extra}"
            assert got["steps"] == STEPS and len(got["losses"]) == len(mine) == STEPS * ACCUM
            for a, b in zip(got["losses"], mine):
                assert abs(a - b) <= 1e-5 * abs(b), (what, got["losses"], mine)
            if resume:
                assert got["resumed"] == got["continued"], what
                assert got["client"] == {"epoch": 7}, what
                assert got["fresh_steps"] == got["lr_steps"] == STEPS, what
                assert got["path"].endswith(f"iter_{STEPS:07d}"), what


def _zero_init_run(ps):
    """Stage 3 from a model built under zero_init, then GatheredParameters; and the
    values the engine draws for a model built on the meta device."""
    import hybrid
    from hybrid.engine.zero_build import held_whole_bytes, is_cut
    with hybrid.zero_init():
        model = _model("gpt2")
    cut = all(is_cut(p) for p in model.parameters())
    whole = held_whole_bytes(model.parameters())
    engine, _, _, _ = hybrid.initialize(model=model, config=_ds(3, **P3), parallel_state=ps)
    held = engine.zero.model_state_bytes()["params"]
    losses = _train(engine, ps, range(STEPS), "gpt2")
    wte = model.transformer.wte.weight
    with hybrid.GatheredParameters(wte, modifier_rank=0):
        shape = tuple(wte.shape)
        with torch.no_grad():
            wte[0].fill_(1.0 + ps.dp_rank)  # rank 0's value must win
    with hybrid.GatheredParameters([wte]):  # regathered from the shards the master wrote
        row = wte[0].clone()
    engine.close()
    with torch.device("meta"):
        meta = _model("gpt2")
    engine, _, _, _ = hybrid.initialize(model=meta, config=_ds(3, **P3), parallel_state=ps)
    drawn = {}
    for n, p in meta.named_parameters():
        with hybrid.GatheredParameters(p):
            drawn[n] = p.detach().clone()
    engine.close()
    return {"cut": cut, "whole": whole, "held": held, "losses": losses, "shape": shape,
            "row": row, "drawn": drawn}


def test_zero_init_keeps_the_init_and_gathered_parameters_writes_back():
    """Built under zero_init, each rank keeps its part of every parameter only; at DP 2
    stage 3 each rank then holds only its shard of the parameters (half the model here),
    and trains as one process started from the model's own init (its constructors' and
    post_init's draws, from the same seed). GatheredParameters shows full tensors, and
    with modifier_rank 0 rank 0's change becomes every rank's and the master's. A model
    built on the meta device instead gets each parameter drawn by its own module's
    initializer, seeded by name, at most one module's own parameters materialized at
    once."""
    from hybrid.engine.zero_context import ModuleInitValues
    with torch.device("meta"):
        meta = _model("gpt2")
    draw = ModuleInitValues(meta, seed=1234)
    init = {n: draw(n, p, 0, p.numel()) for n, p in meta.named_parameters()}
    total = sum(p.numel() for p in meta.parameters())
    assert draw.largest == max(sum(p.numel() for p in m.parameters(recurse=False))
                               for m in meta.modules())
    ref = _reference("gpt2", range(STEPS))
    res = run_ranks(_zero_init_run, world_size=2)
    for rank, got in enumerate(res):
        assert got["cut"] and got["whole"] == 0
        assert got["held"] <= 4 * (total // 2 + 64), (got["held"], total)  # fp32 shard + pad
        mine = [ref[s * 2 * ACCUM + rank * ACCUM + k] for s in range(STEPS) for k in range(ACCUM)]
        for a, b in zip(got["losses"], mine, strict=True):
            assert abs(a - b) <= 1e-5 * abs(b), (rank, got["losses"], mine)
        assert got["shape"] == (VOCAB, 32)
        assert torch.equal(got["row"], torch.ones(32))
        for n, v in init.items():
            assert torch.equal(got["drawn"][n].reshape(-1), v), (rank, n)


@pytest.mark.parametrize("kwargs,message", [
    # {"enabled": "false"} used to turn fp16 on, then failed in the model's first matmul
    (dict(config={"fp16": {"enabled": "false"}}),
     'ds_config fp16.enabled (<dict>) must be true or false, got "false": write false without '
     'quotes'),
    (dict(config={"zero_optimization": {"stage": 2.7}}),  # used to run ZeRO-2
     "ds_config zero_optimization.stage (<dict>) must be a whole number, got 2.7"),
    (dict(config={"zero_optimization": {"stage": 5}}),
     "ds_config zero_optimization.stage must be 0, 1, 2 or 3, got 5"),
    (dict(seed="1234"), 'hybrid.initialize(seed=...) must be a whole number, got "1234": write '
                        '1234 without quotes'),
    (dict(seed=-1), "hybrid.initialize(seed=...) must be in [0, 2**32 - 1], got -1"),
    (dict(tensor_parallel_size=1.5),
     "hybrid.initialize(tensor_parallel_size=...) must be a whole number, got 1.5"),
    (dict(config=3), "the ds_config must be a path to a JSON file or a dict, got int 3"),
])
def test_a_config_value_or_argument_of_the_wrong_type_is_one_error_naming_it(kwargs, message):
    """In this process, before any engine is built: the message names the key or argument
    as the caller wrote it."""
    import hybrid
    from hybrid.errors import ConfigError
    from hybrid.parallel.state import ParallelState
    with pytest.raises(ConfigError) as e:
        hybrid.initialize(torch.nn.Linear(4, 4), parallel_state=ParallelState.single(), **kwargs)
    assert str(e.value) == message
