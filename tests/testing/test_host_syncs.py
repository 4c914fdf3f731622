"""The step path never waits for the device, except for dynamic fp16's skip decision.

On the CPU the counter is :class:`hybrid.testing.host_syncs.HostReads` (every Python-level
read of a tensor value, which would make the host wait on a GPU); on a GPU,
torch's own sync debug mode.
"""

import pytest
import torch

from hybrid.config import Flags, build_config
from hybrid.parallel.state import ParallelState
from hybrid.tensor_parallel import InitValues
from hybrid.testing.host_syncs import HostReads, cuda_syncs
from tests.helpers.harness import run_ranks
from tests.helpers.launch import ROOT
from tests.helpers.zero_reference import _gpt, zero_engine

VOCAB, SEQ, MICRO = 257, 16, 2


def _cfg(world, tp, **kw):
    base = dict(tensor_model_parallel_size=tp, num_layers=2, hidden_size=32,
                num_attention_heads=4, seq_length=SEQ, hidden_dropout=0.0,
                attention_dropout=0.0, micro_batch_size=MICRO,
                global_batch_size=MICRO * 2 * (world // tp), lr=1e-2, clip_grad=0.5,
                reduce_bucket_size=1000, allgather_bucket_size=1000,
                zero_param_persistence_threshold=0, seed=3)
    base.update(kw)
    return build_config(Flags(**base), world)


def _engine(cfg, ps, device="cpu"):
    model = _gpt(cfg, ps, device="meta")  # the shared reference GPT (same VOCAB and SEQ)
    return model, zero_engine(model, ps, cfg, values=InitValues(cfg.seed, model.init_of))


def _batches(step, ps, device="cpu"):
    g = torch.Generator().manual_seed(100 + 10 * step + ps.dp_rank)
    data = torch.randint(0, VOCAB, (2 * MICRO, SEQ + 1), generator=g).to(device)
    return [(b[:, :-1], b[:, 1:]) for b in data.split(MICRO)]


def _one_step(model, engine, step, ps, device="cpu"):
    from hybrid.train.step import train_step
    return train_step(model, engine, _batches(step, ps, device), 1e-2)


# (stage, flags, expected reads per step): which optimizer path each one takes
CONFIGS = [
    (0, {}, 0),  # fp32 shards are their own master: torch's fused AdamW
    (1, {"bf16": True}, 0),  # full gradient buffer: torch's fused AdamW per unit
    (2, {"bf16": True}, 0),  # the flat kernel, its copy-out publishing the shards
    (3, {"bf16": True}, 0),  # blocks larger than the bucket: piecewise async gathers
    (2, {"bf16": True, "offload_optimizer": True}, 0),  # host worker; main thread never reads
    (2, {"bf16": True, "offload_optimizer": True, "offload_delayed_update": True}, 0),
    (2, {"fp16": True}, 1),  # dynamic loss scaling reads the skip decision
]


def _reads_per_config(ps):
    out = []
    for stage, kw, _ in CONFIGS:
        cfg = _cfg(ps.world_size, ps.tp_size, zero_stage=stage, **kw)
        model, engine = _engine(cfg, ps)
        _one_step(model, engine, 0, ps)  # warm-up: kernel loading, lazy buffers
        with HostReads() as reads:  # the step after: every path already steady
            _, result, _ = _one_step(model, engine, 1, ps)
        where = reads.where[:3]
        with HostReads() as control:  # the counter sees a read when there is one
            float(result.grad_norm)
        # the kernel's copy-out is the publication: every shard is its master, rounded
        copied = all(torch.equal(u.shard, m.to(u.shard.dtype))
                     for u, m in zip(engine.units, engine.optimizer.master)) \
            if engine.separate_master and engine.offload is None else True
        out.append({"reads": reads.count, "where": where, "control": control.count,
                    "copied": copied, "path": engine.optimizer.adamw.path})
    return out


def test_steps_read_no_tensor_value_but_the_fp16_skip_decision():
    """TP2 x DP2, every optimizer path: a step (forward and backward of two
    micro-batches, ZeRO reductions and gathers, clip, update) after a warm-up step reads
    no tensor value into Python, except dynamic fp16's one skip decision.

    One step is counted, not two: after the warm-up every path runs as it will on every
    later step (the delayed update's first counted step already waits for the warm-up's
    update and starts its own; the loss scale grows only after 1000 clean steps), and
    each further step was a collective round of 4 ranks on 2 cores per configuration."""
    res = run_ranks(_reads_per_config, world_size=4, tp=2)
    for rank_res in res:
        for (stage, kw, per_step), r in zip(CONFIGS, rank_res):
            assert r["control"] == 1
            assert r["reads"] == per_step, (stage, kw, r["reads"], r["where"])
            assert r["copied"], (stage, kw)
    # the kernels' choice: the fp32 shards of stage 0 and the per-unit gradients of
    # stage 1 go to torch's fused AdamW, stage 2's flat shard to the compiled kernel
    assert [r["path"] for r in rank_res[:3]] == ["torch", "torch", "kernel"]


def _device_skip(ps):
    """An inf in one rank's gradient, bf16 (no loss scaling): skipped on the device."""
    out = []
    for stage in (1, 2):  # torch's fused AdamW, and the flat kernel
        cfg = _cfg(ps.world_size, 1, zero_stage=stage, bf16=True)
        model, engine = _engine(cfg, ps)
        _one_step(model, engine, 0, ps)
        engine.zero_grad()
        for i, (x, y) in enumerate(_batches(1, ps)):
            engine.backward(model(x, y) / 2, sync=i == 1)
        if ps.dp_rank == 1:
            engine.units[0].grad_shard[3] = float("inf")
        master = [m.clone() for m in engine.optimizer.master]
        shards = [u.shard.clone() for u in engine.units]
        with HostReads() as reads:
            result = engine.step(1e-2)
        out.append({"reads": reads.count, "skipped": result.skipped,
                    "host_skipped": result.host_skipped,
                    "master": all(torch.equal(a, b) for a, b in zip(master,
                                                                   engine.optimizer.master)),
                    "shards": all(torch.equal(a, u.shard) for a, u in zip(shards, engine.units)),
                    "steps": engine.optimizer.step_count})
    return out


def test_a_non_finite_gradient_skips_on_the_device_everywhere():
    for rank_res in run_ranks(_device_skip, world_size=2, tp=1):
        for r in rank_res:
            assert r["reads"] == 0
            assert isinstance(r["skipped"], torch.Tensor) and bool(r["skipped"])
            assert r["host_skipped"] is None  # decided on the device: nobody read it
            assert r["master"] and r["shards"] and r["steps"] == 1


@pytest.mark.parametrize("dtype,per_step", [("--bf16", 0), ("--fp16", 1)])
def test_training_loop_reads_values_only_at_log_lines(monkeypatch, dtype, per_step):
    """The real loop (one process, mock data): between log lines an iteration reads
    nothing from the device (bf16), or only the fp16 skip decision."""
    import hybrid.train.trainer as training
    from hybrid.config import build_config, parse_args

    cfg = build_config(parse_args(["--num-layers", "2", "--hidden-size", "32",
                                   "--num-attention-heads", "4", "--seq-length", "16",
                                   "--micro-batch-size", "2", "--global-batch-size", "4",
                                   "--train-iters", "8", "--log-interval", "4",
                                   "--eval-iters", "0", "--mock-data", "--zero-stage", "2", dtype,
                                   "--hidden-dropout", "0", "--attention-dropout", "0"]), 1)
    marks = []
    step = training.train_step

    def marked(*args, **kw):
        marks.append(reads.count)
        return step(*args, **kw)

    monkeypatch.setattr(training, "train_step", marked)
    with HostReads() as reads:
        history = training.pretrain(cfg, ParallelState.single())
    per_iter = [b - a for a, b in zip(marks, marks[1:])]  # iterations 1..7
    assert [m["iteration"] for m in history] == [4, 8]
    for i, n in enumerate(per_iter, start=1):
        if i % 4:
            assert n == per_step, (i, per_iter)
    assert per_iter[3] > per_step  # the log line reads (loss, norm, timer, memory)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_bf16_steps_do_not_synchronize():
    """torch's sync debug mode set to "error" around bf16 steps (stages 2 and 3, the
    kernel path when it builds; the host offload, whose gradients land on the device
    and go down per unit, with parameter offload and the delayed update): any
    synchronizing CUDA call raises. fp16 makes exactly its one skip-decision sync
    per step."""
    ps = ParallelState.single("cuda")
    offload = {"bf16": True, "offload_optimizer": "cpu"}
    for stage, kw in ((2, {"bf16": True}), (3, {"bf16": True}), (2, offload),
                      (3, {**offload, "offload_param": "cpu"}),
                      (3, {**offload, "offload_delayed_update": True})):
        cfg = _cfg(1, 1, zero_stage=stage, **kw)
        model, engine = _engine(cfg, ps)
        batches = [_batches(s, ps, "cuda") for s in range(4)]
        from hybrid.train.step import train_step
        for s in range(2):
            train_step(model, engine, batches[s], 1e-2)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for s in range(2, 4):
                train_step(model, engine, batches[s], 1e-2)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        torch.cuda.synchronize()
    cfg = _cfg(1, 1, zero_stage=2, fp16=True)
    model, engine = _engine(cfg, ps)
    batches = [_batches(s, ps, "cuda") for s in range(4)]
    for s in range(2):
        train_step(model, engine, batches[s], 1e-2)
    torch.cuda.synchronize()
    with cuda_syncs() as syncs:
        for s in range(2, 4):
            train_step(model, engine, batches[s], 1e-2)
    assert syncs.count == 2


def test_throughput_bench_runs_on_cpu_with_the_tiny_shape():
    """benchmarks/bench_throughput.py (the 1.3B measurement on a GPU), run as its docs
    say (``python -m benchmarks.bench_throughput`` from the checkout's root), runs its
    tiny preset here and reports no host reads per bf16 ZeRO-2 step."""
    import json
    import subprocess
    import sys
    run = subprocess.run([sys.executable, "-m", "benchmarks.bench_throughput", "--preset", "tiny",
                          "--configs", "zero2", "zero2_offload_delayed", "--steps", "2",
                          "--warmup", "1"], cwd=ROOT, capture_output=True, check=False, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = [json.loads(x) for x in run.stdout.splitlines() if x.startswith("{")]
    assert [r["config"] for r in lines] == ["zero2", "zero2_offload_delayed"]
    for r in lines:
        assert r["host_syncs_per_step"] == 0 and r["tokens_per_s_per_rank"] > 0
        assert r["peak_memory_bytes"] > 0 and r["mfu"] is None
