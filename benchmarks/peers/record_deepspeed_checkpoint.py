"""Record DeepSpeed 0.19.8 checkpoints (and the losses DeepSpeed trains after them) for
hybrid's import tests: tests/fixtures/peers/deepspeed/.

Runs the real DeepSpeed on the CPU (DS_ACCELERATOR=cpu, gloo, 2 ranks, fp32,
torch's AdamW through ``"torch_adam": true``): a tiny model is trained for 3 steps
at ZeRO stage 2 and at stage 3, saved with ``engine.save_checkpoint``, then trained
10 more steps, whose losses (the mean over both ranks' micro-batches, that is the
global batch's) are written to ``losses.json`` beside the checkpoints.

The model and the batches are defined here (:class:`Net`, :func:`batch`) and imported
by the tests, so that hybrid builds the same model and feeds the same global batch of
step ``i``, whatever its layout: rank ``r`` of ``n`` takes rows ``[r*B/n, (r+1)*B/n)``.

Regenerate (a minute on 2 cores; needs /work/venv-peers, which has DeepSpeed)::

    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 /work/venv-peers/bin/python \
        benchmarks/peers/record_deepspeed_checkpoint.py tests/fixtures/peers/deepspeed
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import sys

import torch
from torch import nn

GLOBAL_BATCH = 8
WORLD = 2
SAVED_AT = 3      # steps before the save
CONTINUED = 10    # steps recorded after it
STAGES = (2, 3)
LR = 1e-2


class Net(nn.Module):
    """Odd sizes, so that the flat ZeRO partitions of 2 ranks carry padding."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(7, 9)
        self.fc2 = nn.Linear(9, 5)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def config(stage: int) -> dict:
    """The ds_config both sides use (hybrid's engine reads DeepSpeed's config keys)."""
    return {"train_batch_size": GLOBAL_BATCH, "gradient_accumulation_steps": 1,
            "gradient_clipping": 0.0, "steps_per_print": 10 ** 6,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": [0.9, 0.999],
                                                      "eps": 1e-8, "weight_decay": 0.01,
                                                      "torch_adam": True}},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0,
                                                         "warmup_max_lr": LR,
                                                         "warmup_num_steps": 6}},
            "zero_optimization": {"stage": stage}}


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of optimizer step ``step`` (0-based): inputs (B, 7), targets (B,)."""
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(GLOBAL_BATCH, 7, generator=g), torch.randint(0, 5, (GLOBAL_BATCH,),
                                                                     generator=g)


def loss_of(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out, y)


def _worker(rank: int, port: int, out_dir: str, stage: int) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import deepspeed
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    net = Net()
    engine, *_ = deepspeed.initialize(model=net, model_parameters=net.parameters(),
                                      config=config(stage))
    per = GLOBAL_BATCH // WORLD
    losses = []
    for step in range(SAVED_AT + CONTINUED):
        if step == SAVED_AT:
            engine.save_checkpoint(out_dir)
        x, y = batch(step)
        loss = loss_of(engine(x[rank * per:(rank + 1) * per]), y[rank * per:(rank + 1) * per])
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        torch.distributed.all_reduce(mean)
        losses.append(float(mean) / WORLD)
    if rank == 0:
        with open(os.path.join(out_dir, "losses.json"), "w") as f:
            json.dump({"deepspeed": deepspeed.__version__, "world_size": WORLD,
                       "zero_stage": stage, "saved_at": SAVED_AT, "before": losses[:SAVED_AT],
                       "after": losses[SAVED_AT:]}, f, indent=1)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def main(argv: list[str]) -> int:
    root = argv[0] if argv else "tests/fixtures/peers/deepspeed"
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    for stage in STAGES:
        out = os.path.join(root, f"net_zero{stage}")
        shutil.rmtree(out, ignore_errors=True)
        os.makedirs(out)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        torch.multiprocessing.spawn(_worker, args=(port, out, stage), nprocs=WORLD)
        for helper in ("zero_to_fp32.py", "zero_to_torch.py"):  # DeepSpeed's own scripts,
            if os.path.exists(os.path.join(out, helper)):       # copied by every save
                os.remove(os.path.join(out, helper))
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
