"""DeepSpeed 0.19.8's fp16 runs on the CPU, for ``record_deepspeed_checkpoint.py fp16``.

[Note: the CPU patch]
DeepSpeed's CPU accelerator says fp16 is unsupported unless oneDNN has fp16 kernels
(``is_fp16_supported()`` is ``torch.ops.mkldnn._is_mkldnn_fp16_supported()``, False on the
CPUs these fixtures were recorded on), and ``deepspeed.initialize`` then stops with
``ValueError: Type fp16 is not supported on your device.``. :func:`allow_fp16_on_cpu`
makes that one query answer True in the recording process. It stands in for a GPU (or a
CPU with oneDNN fp16), where the query is True and nothing else differs: DeepSpeed's
engine, its fp16 optimizers (FP16_UnfusedOptimizer without ZeRO, the ZeRO optimizers with
their DynamicLossScaler), the loss scaling, the overflow checks and the files are
DeepSpeed's own code, unpatched; torch computes the fp16 matmuls on the CPU as it does
for any fp16 tensor. The patch changes no number DeepSpeed computes.

The fixtures (:data:`FP16_CASES`) train :class:`Net` as the fp32 and bf16 ones do, with
dynamic loss scaling (:func:`fp16_config`): at ZeRO 2 and 3 a first scale of 2**18
overflows the tiny model's fp16 gradients at steps 0 and 1 (the hysteresis of 2 spent,
then halved: saved at 2**17 with no overflow left before the next halving), and again at
step 4 after the save (halved at once to 2**16). The window of 9 keeps a doubling out of
the 10 recorded steps: after an overflow DeepSpeed doubles after window + 1 clean steps,
hybrid after window, and on the step it doubles DeepSpeed's ZeRO optimizers unscale the
gradients by the doubled scale (the export's peer test shows that step). Without ZeRO
DeepSpeed 0.19.8 never scales the loss (``engine.backward`` scales it for ZeRO optimizers
only) while FP16_UnfusedOptimizer divides the gradients by its scale: that fixture never
overflows, and its steps are on gradients 2**18 times too small (recorded as it runs).
The ZeRO 2 save is also converted by DeepSpeed's ``ds_to_universal`` (:data:`UNIVERSAL`).
"""

from __future__ import annotations

import json
import os

import torch

# dynamic loss scaling (DeepSpeed's fp16 block): the first scale 2**INITIAL_POWER, grown
# after WINDOW clean steps, halved after HYSTERESIS overflows (ZeRO's DynamicLossScaler;
# FP16_UnfusedOptimizer halves on each)
INITIAL_POWER = 18
WINDOW = 9
HYSTERESIS = 2

# name -> ZeRO stage (DeepSpeed's optimizer: FP16_UnfusedOptimizer without ZeRO for
# torch's AdamW, the ZeRO optimizers otherwise)
FP16_CASES = {"net_fp16_zero0": 0, "net_fp16_zero2": 2, "net_fp16_zero3": 3}
UNIVERSAL = ("net_fp16_zero2",)  # also converted by DeepSpeed's ds_to_universal


def allow_fp16_on_cpu() -> None:
    """The Note's patch: DeepSpeed's CPU accelerator reports fp16 as supported."""
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator
    CPU_Accelerator.is_fp16_supported = lambda self: True


def fp16_config(base: dict) -> dict:
    """``base`` (the recorder's ``config(stage)``) in fp16 with dynamic loss scaling."""
    return {**base, "fp16": {"enabled": True, "loss_scale": 0,
                             "initial_scale_power": INITIAL_POWER,
                             "loss_scale_window": WINDOW, "hysteresis": HYSTERESIS,
                             "min_loss_scale": 1}}


def fp16_loss(loss_of, model, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The fp16 model's loss: fp16 inputs, ``loss_of`` in fp32 of its fp16 logits."""
    return loss_of(model(x.to(torch.float16)).float(), y)


def scaler_state(engine) -> dict:
    """The loss scale DeepSpeed's optimizer holds and its counters (for losses.json)."""
    opt = engine.optimizer
    held = getattr(opt, "loss_scaler", None) or getattr(opt, "loss_scale_config", None)
    return {k: getattr(held, k) for k in ("cur_scale", "cur_iter", "last_overflow_iter",
                                          "cur_hysteresis") if hasattr(held, k)}


def record(rec, rank: int, out_dir: str, name: str) -> None:
    """One rank of fixture ``name`` (``rec``: the recorder module): SAVED_AT steps, the
    save, CONTINUED steps; rank 0 writes losses.json (with each step's loss scale and
    the steps DeepSpeed skipped)."""
    import deepspeed
    allow_fp16_on_cpu()
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    net = rec.Net()
    engine, *_ = deepspeed.initialize(model=net, model_parameters=net.parameters(),
                                      config=fp16_config(rec.config(FP16_CASES[name])))
    per, losses, scales, skipped = rec.GLOBAL_BATCH // rec.WORLD, [], [], []
    for step in range(rec.SAVED_AT + rec.CONTINUED):
        if step == rec.SAVED_AT:
            # (the info ds_to_universal asks of a client: none needed)
            engine.save_checkpoint(out_dir, client_state={"universal_checkpoint_info": {}})
            saved = scaler_state(engine)
        x, y = rec.batch(step)
        rows = slice(rank * per, (rank + 1) * per)
        scales.append(float(engine.optimizer.loss_scale))
        losses.append(rec.step_mean(engine, fp16_loss(rec.loss_of, engine, x[rows], y[rows]),
                                    rec.WORLD))
        skipped.append(int(engine.skipped_steps))
    if rank == 0:
        with open(os.path.join(out_dir, "losses.json"), "w") as f:
            json.dump({"deepspeed": deepspeed.__version__, "world_size": rec.WORLD,
                       "zero_stage": FP16_CASES[name], "fp16": True,
                       "optimizer": type(engine.optimizer).__name__,
                       "patch": "benchmarks/peers/deepspeed_fp16.py allow_fp16_on_cpu",
                       "saved_at": rec.SAVED_AT, "scaler_at_save": saved,
                       "loss_scales": scales, "skipped_steps": skipped,
                       "before": losses[:rec.SAVED_AT], "after": losses[rec.SAVED_AT:]},
                      f, indent=1)
    rec.end_rank()
