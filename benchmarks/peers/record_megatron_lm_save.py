"""Record a checkpoint written by Megatron-LM's own ``save_checkpoint``
(``megatron/training/checkpointing.py``), not by the Megatron recorder's rebuild of its
contents: tests/fixtures/peers/megatron_lm_save/.

    git -C MEGATRON_LM_GIT archive core_v0.16.1 megatron/training megatron/rl \\
        megatron/legacy megatron/post_training | tar -x -C /tmp/mlm
    pip install --no-deps --target /tmp/mlm six        (its tokenizer module imports six)
    OMP_NUM_THREADS=1 /work/venv-peers/bin/python benchmarks/peers/record_megatron_lm_save.py \\
        --megatron-lm /tmp/mlm [--plain] [--tp N --dp M] [--ddp-bucket-size N]
        [--format torch] [--model llama] [--out DIR]

Megatron-LM's ``megatron.training`` at the tag ``core_v0.16.1`` (the release of the
megatron-core 0.16.1 wheel it runs against; the wheel ships ``megatron.core`` only) is
put on ``sys.path`` from ``--megatron-lm DIR``. Its own argument parser and
``validate_args`` build the global args from the command line of the recorder's run
(:func:`megatron_lm_flags`: the GPT-2 family of benchmarks/peers/megatron_recipe.py,
``--ckpt-format torch_dist``, ``--tokenizer-type NullTokenizer --vocab-size 63``, whose
63 tokens and EOD pad to the model's 64 rows), ``set_global_variables`` installs them, and
the Megatron recorder's megatron-core run (record_megatron_checkpoint.py's ``Run``:
GPTModel, DDP and ``get_megatron_optimizer``, the scheduler) trains ``SAVE_AT`` steps;
then Megatron-LM's ``save_checkpoint(iteration, model, optimizer, opt_param_scheduler,
num_floating_point_operations_so_far)`` writes the save directory (the FLOPs counted as
its ``train()`` counts them), the run continues ``CONTINUE`` steps, and megatron-core's
own reload of the save is checked to continue bit for bit. ``losses.json`` has the
recorder's fields (the tests read both alike) and ``megatron_lm`` (the tag).

By default (the committed fixture): ``--use-distributed-optimizer`` at TP 1 x DP 2 with
Megatron-LM's defaults (``dp_reshardable``, one bucket: no ``--overlap-grad-reduce``);
``--plain``: megatron-core's FP32Optimizer instead; ``--ddp-bucket-size N``:
``--overlap-grad-reduce`` in buckets of N; ``--format torch --plain``: Megatron-LM's
legacy format (``mp_rank_XX/model_optim_rng.pt``), reloaded by the recorder's
``Run.load_legacy`` (which has no distributed optimizer: with it, Megatron-LM's legacy
save puts the moments in ``mp_rank_XX/distrib_optim.pt``, which neither reads).

CPU stand-ins beyond the recorder's, none of which changes a saved number:
``validate_args`` asks the GPU's architecture (only to pick a warning): a Hopper's;
``torch.cuda.get_rng_state`` (Megatron-LM's RNG collection saves the CUDA generator's
state beside the CPU's) returns the CPU generator's; and ``initialize.py`` imports a
Triton module (batch-invariant kernels, run only under ``--batch-invariant-mode``), which
is replaced by an empty one.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import types

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks.peers.megatron_recipe import (  # noqa: E402
    ARCH,
    BETA2,
    BUCKET,
    CLIP,
    CONTINUE,
    DECAY,
    EPS,
    LR,
    MIN_LR,
    SAVE_AT,
    SEED,
    SHAPE,
    WARMUP,
    WD,
    batches,
    moe_record,
)

OUT = os.path.join(ROOT, "tests", "fixtures", "peers", "megatron_lm_save")
TAG = "core_v0.16.1"


def megatron_lm_flags(model: str, tp: int, dp: int, dist_opt: bool, save: str,
                      bucket: int = BUCKET, fmt: str = "torch_dist") -> list[str]:
    """Megatron-LM's command line for the recorder's run of ``model`` (pretrain_gpt.py's
    flags): its shape, optimizer, schedule and checkpoint format."""
    s, m = SHAPE, ARCH[model]
    flags = ["--num-layers", s["num_layers"], "--hidden-size", s["hidden_size"],
             "--num-attention-heads", s["heads"], "--ffn-hidden-size", s["ffn"],
             "--seq-length", s["seq_length"], "--max-position-embeddings", s["seq_length"],
             "--micro-batch-size", s["micro"], "--global-batch-size", s["micro"] * dp,
             "--tensor-model-parallel-size", tp, "--normalization", m["normalization"],
             "--norm-epsilon", 1e-5, "--position-embedding-type", m["position"],
             "--hidden-dropout", 0.0, "--attention-dropout", 0.0, "--init-method-std", 0.02,
             "--lr", LR, "--min-lr", MIN_LR, "--lr-decay-style", "cosine",
             "--lr-warmup-iters", WARMUP, "--lr-decay-iters", DECAY, "--weight-decay", WD,
             "--clip-grad", CLIP, "--adam-beta1", 0.9, "--adam-beta2", BETA2,
             "--adam-eps", EPS, "--seed", SEED, "--train-iters", SAVE_AT + CONTINUE,
             # NullTokenizer: vocab + 1 (its EOD) rows, padded to 32 x TP = the model's 64
             "--tokenizer-type", "NullTokenizer", "--vocab-size", s["vocab"] - 1,
             "--make-vocab-size-divisible-by", s["vocab"] // tp,
             "--transformer-impl", "local", "--no-masked-softmax-fusion",
             "--no-bias-gelu-fusion", "--no-bias-dropout-fusion", "--no-bias-swiglu-fusion",
             "--no-gradient-accumulation-fusion", "--no-persist-layer-norm",
             "--use-cpu-initialization", "--ckpt-format", fmt, "--save", save,
             "--save-interval", SAVE_AT]
    if m["query_groups"] != s["heads"]:
        flags += ["--group-query-attention", "--num-query-groups", m["query_groups"]]
    if m["swiglu"]:
        flags += ["--swiglu"]
    if not m["bias"]:
        flags += ["--disable-bias-linear"]
    if not m["tied"]:
        flags += ["--untie-embeddings-and-output-weights"]
    if dist_opt:
        flags += ["--use-distributed-optimizer"]
    if dist_opt and bucket:
        flags += ["--overlap-grad-reduce", "--ddp-bucket-size", bucket]
    return [str(f) for f in flags]


def import_megatron_lm(directory: str):
    """Megatron-LM's ``megatron.training`` from ``directory`` (next to the installed
    megatron-core: ``megatron`` is a namespace package); its modules the recorder calls."""
    sys.path.insert(0, os.path.abspath(directory))
    # initialize.py imports batch-invariant kernels written in Triton (CUDA only), used
    # only under --batch-invariant-mode: an empty stand-in, nothing of it runs
    name = "megatron.core.transformer.custom_layers.batch_invariant_kernels"
    stub = types.ModuleType(name)
    stub.enable_batch_invariant_mode = None  # type: ignore[attr-defined]
    sys.modules[name] = stub
    from megatron.training import arguments, checkpointing, global_vars, training
    return arguments, checkpointing, global_vars, training


@contextlib.contextmanager
def cpu_rng_as_cuda():
    """``torch.cuda.get_rng_state``: Megatron-LM's ``get_rng_state`` saves the CUDA
    generator's state beside the CPU's; here the CPU generator's state stands in for it
    (an RNG state: no weight, moment or loss is in it)."""
    import torch
    saved = torch.cuda.get_rng_state
    torch.cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    try:
        yield
    finally:
        torch.cuda.get_rng_state = saved


def worker(a) -> None:
    import torch
    import torch.distributed as dist

    from benchmarks.peers.megatron_cpu_optim import cpu_tensors_as_cuda
    from benchmarks.peers.megatron_side import patch_megatron_for_cpu
    from benchmarks.peers.record_megatron_checkpoint import Run
    torch.set_num_threads(1)
    patch_megatron_for_cpu()
    # dist_checkpointing's writer waits for the device's copies: on the CPU none is in flight
    torch.cuda.synchronize = lambda device=None: None
    arguments, checkpointing, global_vars, training = import_megatron_lm(a.megatron_lm)
    from megatron.core import parallel_state
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=a.tp)
    dp = world // a.tp
    sys.argv = [sys.argv[0], *megatron_lm_flags(a.model, a.tp, dp, a.dist_opt, a.out,
                                                  a.ddp_bucket_size, a.format)]
    args = arguments.parse_args()
    # validate_args asks the GPU's architecture (for a warning on Hopper and older about
    # CUDA_DEVICE_MAX_CONNECTIONS): a Hopper's 9, as Megatron-LM's documented runs set it
    arguments.get_device_arch_version = lambda: 9
    arguments.validate_args(args, {})
    global_vars.set_global_variables(args, build_tokenizer=True)
    assert args.padded_vocab_size == SHAPE["vocab"], args.padded_vocab_size
    run = Run(a.tp, dp, a.model, "dp_reshardable" if a.dist_opt else None,
              a.ddp_bucket_size)
    data = batches(SAVE_AT + CONTINUE, SHAPE["micro"] * dp, seed=7)
    first = [run.step(b) for b in data[:SAVE_AT]]
    # what Megatron-LM's train() has counted by then: samples, iterations and FLOPs
    args.consumed_train_samples = SAVE_AT * run.gbs
    args.iteration = SAVE_AT
    flops = SAVE_AT * training.num_floating_point_operations(args, run.gbs)
    model = [run.ddp] if run.ddp_path else [run.model]
    with cpu_rng_as_cuda(), cpu_tensors_as_cuda() if a.dist_opt else contextlib.nullcontext():
        checkpointing.save_checkpoint(SAVE_AT, model, run.opt, run.sched, flops)
    losses = [run.step(b) for b in data[SAVE_AT:]]
    again = Run(a.tp, dp, a.model, "dp_reshardable" if a.dist_opt else None,
              a.ddp_bucket_size)
    load = again.load if a.format == "torch_dist" else again.load_legacy
    assert load(os.path.join(a.out, f"iter_{SAVE_AT:07d}")) == SAVE_AT
    reloaded = [again.step(b) for b in data[SAVE_AT:]]
    worst = max(abs(x - y) for x, y in zip(losses, reloaded))
    # (equal lists: a NaN, which max() passes over, fails it)
    assert losses == reloaded, f"megatron-core's reload continues differently ({worst})"
    if dist.get_rank() == 0:
        with open(os.path.join(a.out, "losses.json"), "w") as f:
            json.dump({"megatron_core": __import__("megatron.core").core.__version__,
                       "megatron_lm": TAG, "writer": "megatron.training.checkpointing."
                       "save_checkpoint", "format": a.format, "model": a.model,
                       "tp": a.tp, "dp": dp, "pp": 1, "ep": 1, "moe": moe_record(a.model),
                       "distributed_optimizer": "dp_reshardable" if a.dist_opt else None,
                       "bf16": False, "ddp_bucket_size": a.ddp_bucket_size if a.dist_opt else None,
                       "iteration": SAVE_AT, "shape": SHAPE,
                       "query_groups": ARCH[a.model]["query_groups"], "lr": LR,
                       "min_lr": MIN_LR, "warmup_iters": WARMUP, "decay_iters": DECAY,
                       "weight_decay": WD, "clip_grad": CLIP, "adam_beta2": BETA2,
                       "adam_eps": EPS, "first_losses": first, "losses": losses,
                       "tokens": [b.tolist() for b in data[SAVE_AT:]]}, f)
    dist.barrier()
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--megatron-lm", required=True,
                   help=f"a directory holding Megatron-LM's megatron/training ({TAG})")
    p.add_argument("--out", default=OUT)
    p.add_argument("--model", choices=sorted(set(ARCH) - {"mixtral"}), default="gpt2")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--dp", type=int, default=2)
    p.add_argument("--plain", dest="dist_opt", action="store_false",
                   help="without --use-distributed-optimizer (megatron-core's FP32Optimizer)")
    p.add_argument("--ddp-bucket-size", type=int, default=0,
                   help="with the distributed optimizer: N > 0 adds --overlap-grad-reduce "
                        "--ddp-bucket-size N; 0: Megatron-LM's default (one bucket)")
    p.add_argument("--format", choices=("torch_dist", "torch"), default="torch_dist",
                   help="Megatron-LM's --ckpt-format (torch: its legacy format)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.format == "torch" and a.dist_opt:
        # (the recorder's legacy reload has no distributed optimizer: its moments would
        # start empty -- NaN losses, measured; hybrid does not read distrib_optim.pt either)
        p.error("--format torch is recorded with --plain only")
    if a.worker:
        worker(a)
        return 0
    out = os.path.abspath(a.out)
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_DEVICE_MAX_CONNECTIONS="1")
    return subprocess.call([sys.executable, "-m", "torch.distributed.run", "--standalone",
                            "--nproc-per-node", str(a.tp * a.dp), os.path.abspath(__file__),
                            "--worker", "--megatron-lm", a.megatron_lm, "--out", out,
                            "--model", a.model, "--tp", str(a.tp), "--dp", str(a.dp),
                            "--ddp-bucket-size", str(a.ddp_bucket_size),
                            "--format", a.format, *([] if a.dist_opt else ["--plain"])],
                           env=env, cwd=ROOT)


if __name__ == "__main__":
    sys.exit(main())
