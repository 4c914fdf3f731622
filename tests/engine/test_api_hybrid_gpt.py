"""Hybrid's own GPT through ``hybrid.initialize``: TP x ZeRO by the same call, and a
checkpoint that crosses between the training script and the API both ways:
pretrain_gpt.py saves, the API (hybrid's own GPT, DP 2) loads it and saves again
without stepping, and pretrain_gpt.py resumes from the API's save onto the
uninterrupted curve, bit for bit."""

import json
import os
import shutil

from hybrid.config import build_config, parse_args
from tests.helpers.harness import run_ranks
from tests.helpers.launch import TINY, pretrain, read_json_log

FLAGS = TINY + ["--zero-stage", "1", "--eval-iters", "0"]
DS = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
      "zero_optimization": {"stage": 1}}


def _through_the_api(ps, src, dst):
    import hybrid
    from hybrid.tensor_parallel import seed_all
    from hybrid.train.setup import build_model
    with open(os.path.join(src, "iter_0000002", "metadata.json")) as f:
        vocab = json.load(f)["vocab_size"]
    cfg = build_config(parse_args(FLAGS), ps.world_size)
    model = build_model(cfg, ps, vocab, seed_all(cfg.seed, ps.tp_rank, ps.dp_rank, ps.device),
                        device="meta")
    engine, *_ = hybrid.initialize(model=model, config=DS, parallel_state=ps, seed=cfg.seed)
    path, client = engine.load_checkpoint(src)
    steps = engine.global_steps
    saved = engine.save_checkpoint(dst, client_state={"from": "api"})
    engine.close()
    return path, client, steps, saved


def test_pretrain_to_api_to_pretrain_is_the_uninterrupted_curve(tmp_path):
    full, res = str(tmp_path / "full.jsonl"), str(tmp_path / "res.jsonl")
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    r = pretrain(2, FLAGS + ["--train-iters", "4", "--log-json", full, "--save", a,
                             "--save-interval", "2"])
    assert r.returncode == 0, r.stderr[-3000:]
    shutil.rmtree(os.path.join(a, "iter_0000004"))  # resume from iteration 2
    os.remove(os.path.join(a, "latest"))
    out = run_ranks(_through_the_api, world_size=2, args=(a, b))
    for path, client, steps, saved in out:
        assert path == os.path.join(a, "iter_0000002") and client == {} and steps == 2
        assert saved == os.path.join(b, "iter_0000002")
    r = pretrain(2, FLAGS + ["--train-iters", "4", "--load", b, "--log-json", res])
    assert r.returncode == 0, r.stderr[-3000:]
    want, got = read_json_log(full)[2:], read_json_log(res)
    assert [m["iteration"] for m in got] == [3, 4]
    assert [m["loss"] for m in got] == [m["loss"] for m in want]
    assert [m["grad_norm"] for m in got] == [m["grad_norm"] for m in want]


def _gpt_through_the_api(ps, stage):
    """Hybrid's GPT built on meta for this rank's TP slice, trained 3 steps via the API."""
    import torch

    import hybrid
    from hybrid.tensor_parallel import seed_all
    from hybrid.train.setup import build_model
    cfg = build_config(parse_args(FLAGS + ["--tensor-model-parallel-size", str(ps.tp_size)]),
                       ps.world_size)
    rng = seed_all(cfg.seed, ps.tp_rank, ps.dp_rank, ps.device)
    model = build_model(cfg, ps, 97, rng, device="meta")
    ds = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage}}
    engine, *_ = hybrid.initialize(model=model, config=ds, parallel_state=ps, seed=cfg.seed)
    g = torch.Generator().manual_seed(5)
    losses = []
    for _ in range(3):  # the same (2, 33) batch on every rank (DP 1 in both layouts)
        x = torch.randint(0, 97, (2, 33), generator=g)
        loss = engine(x[:, :-1], x[:, 1:])
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    engine.close()
    return losses


def test_hybrid_gpt_gets_tp_x_zero_through_the_api():
    """tensor_parallel_size 2 (here: the state passed in): the same losses as TP 1."""
    one = run_ranks(_gpt_through_the_api, world_size=1, args=(3,))[0]
    for got in run_ranks(_gpt_through_the_api, world_size=2, tp=2, args=(3,)):
        for a, b in zip(got, one, strict=True):
            assert abs(a - b) <= 1e-5 * abs(b), (got, one)
    assert one[2] < one[0]
