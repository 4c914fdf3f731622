#!/usr/bin/env python
"""The ZeRO replication experiment on a Hugging Face model: the same GPT-2 trained at DP 2
with ZeRO stage 0 (plain data parallelism) and with ZeRO-3, through ``hybrid.initialize``.

    python examples/zero_on_hf.py                 # both runs, one line each
    python examples/zero_on_hf.py --steps 300 --layers 6 --hidden 256

Each run is its own ``torchrun --nproc-per-node 2`` job (so each one's peak memory
is its own); this script launches them and prints, per run, the train loss (mean
of the last 10 steps), the validation loss, the peak memory of each rank (RSS on a
CPU, allocated bytes on a GPU) and the median time per step. Data: the built-in
corpus (hybrid/data/builtin.py) as bytes, 95% train, 5% validation; random init,
no download. The two runs see the same batches and start from the same weights,
so their losses agree; ZeRO-3 holds a DP-th of the model states per rank.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time


def _args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq-length", type=int, default=128)
    ap.add_argument("--micro-batch-size", type=int, default=4)
    ap.add_argument("--zero-stage", type=int, default=None, help="(a worker's run)")
    return ap.parse_args(argv)


def _tokens(seq: int):
    """(train, validation) (n, seq + 1) byte samples of the built-in corpus."""
    import torch

    from hybrid.data.builtin import builtin_documents
    data = torch.tensor(list("\n\n".join(builtin_documents()).encode("utf-8")),
                        dtype=torch.long)
    samples = data[: len(data) // (seq + 1) * (seq + 1)].view(-1, seq + 1)
    cut = int(len(samples) * 0.95)
    return samples[:cut], samples[cut:]


def _worker(a) -> None:
    """One rank of one run (under torchrun)."""
    import torch
    import torch.distributed as dist
    import transformers

    import hybrid
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=a.layers, n_embd=a.hidden, n_head=a.heads, vocab_size=256,
        n_positions=a.seq_length, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        bos_token_id=0, eos_token_id=0))
    config = {"train_micro_batch_size_per_gpu": a.micro_batch_size,
              "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
              "zero_optimization": {"stage": a.zero_stage,
                                    "stage3_param_persistence_threshold": 0},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}}}
    engine, *_ = hybrid.initialize(model=model, config=config)
    ps = engine.ps
    train, valid = _tokens(a.seq_length)
    g = torch.Generator().manual_seed(1)
    losses, times = [], []
    for _ in range(a.steps):  # every rank draws the same global batch, takes its part
        idx = torch.randint(0, len(train), (a.micro_batch_size * ps.dp_size,), generator=g)
        x = train[idx.view(ps.dp_size, -1)[ps.dp_rank]].to(ps.device)
        t = time.perf_counter()
        loss = engine(x[:, :-1], labels=x[:, :-1]).loss
        engine.backward(loss)
        engine.step()
        times.append(time.perf_counter() - t)
        losses.append(float(loss.detach()))
    engine.eval()
    with torch.no_grad():
        mine = valid[ps.dp_rank::ps.dp_size][:64].to(ps.device)
        val = torch.stack([engine(mine[i:i + 8, :-1], labels=mine[i:i + 8, :-1]).loss
                           for i in range(0, len(mine), 8)]).mean().reshape(1)
    ps.dp_group.all_reduce(val)
    peak = (torch.cuda.max_memory_allocated() if ps.device.type == "cuda"
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    peaks = [None] * ps.world_size
    dist.all_gather_object(peaks, peak)
    if ps.rank == 0:
        print("RESULT " + json.dumps({
            "zero_stage": a.zero_stage, "train_loss": statistics.mean(losses[-10:]),
            "valid_loss": float(val) / ps.dp_size, "peak_memory_bytes_per_rank": peaks,
            "median_step_s": statistics.median(times[1:]),
            "model_state_bytes_rank0": engine.zero.model_state_bytes()["total"]}), flush=True)
    engine.close()


def main(argv=None) -> int:
    a = _args(argv)
    if a.zero_stage is not None:
        _worker(a)
        return 0
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    for stage in (0, 3):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", "2", os.path.abspath(__file__), "--zero-stage", str(stage),
               *(argv if argv is not None else sys.argv[1:])]
        r = subprocess.run(cmd, capture_output=True, check=False, text=True, env=env)
        line = next((ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if r.returncode or line is None:
            print(f"zero_on_hf.py: the ZeRO-{stage} run failed:\n{r.stderr[-3000:]}",
                  file=sys.stderr)
            return 1
        m = json.loads(line[len("RESULT "):])
        peaks = ", ".join(f"{p / 2**20:.0f}" for p in m["peak_memory_bytes_per_rank"])
        print(f"ZeRO-{stage}: train loss {m['train_loss']:.4f}, valid loss "
              f"{m['valid_loss']:.4f}, peak memory per rank (MiB) [{peaks}], model states "
              f"rank 0 {m['model_state_bytes_rank0'] / 2**20:.1f} MiB, "
              f"{m['median_step_s'] * 1000:.1f} ms per step", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
