"""Megatron-LM flags hybrid does not take as its own, and what happens to each.

A Megatron launch script should run with only the entry point renamed, or
stop at once with one line that says which flag and what to use instead --
never argparse's generic "unrecognized arguments". Three kinds:

* **no effect**: flags that pick one of Megatron's implementations of the same
  math (fusions, mcore vs legacy, Transformer Engine) or tune its logging and
  data-loader internals. They are dropped; the run logs them once.
* **only one value**: parallel sizes hybrid implements only as 1 (expert
  parallelism, until it lands). The value 1 is accepted; anything else is refused.
* **refused**: features hybrid does not have (FP8, FSDP variants, some MoE
  options, ...), each with what to use instead. A prefix (``--moe-``) refuses the
  flags under it that hybrid does not take as its own.

Flags hybrid implements are fields of :class:`hybrid.config.flags.Flags`; anything
in none of these tables is reported by the parser as an unknown flag.
"""

from __future__ import annotations

from collections.abc import Collection

from hybrid.errors import ConfigError

# flag -> number of values it takes (Megatron's nargs)
NO_EFFECT: dict[str, int] = {
    "--use-mcore-models": 0, "--use-legacy-models": 0, "--transformer-impl": 1,
    "--no-masked-softmax-fusion": 0, "--no-bias-gelu-fusion": 0,
    "--no-bias-swiglu-fusion": 0, "--no-bias-dropout-fusion": 0, "--no-rope-fusion": 0,
    "--no-gradient-accumulation-fusion": 0, "--no-persist-layer-norm": 0,
    "--no-async-tensor-model-parallel-allreduce": 0, "--cross-entropy-loss-fusion": 0,
    "--apply-query-key-layer-scaling": 0, "--attention-softmax-in-fp32": 0,
    "--use-cpu-initialization": 0, "--use-checkpoint-opt_param-scheduler": 0,
    "--num-workers": 1, "--dataloader-type": 1, "--no-create-attention-mask-in-dataloader": 0,
    "--timing-log-level": 1, "--timing-log-option": 1, "--log-timers-to-tensorboard": 0,
    "--log-validation-ppl-to-tensorboard": 0, "--log-memory-to-tensorboard": 0,
    "--log-params-norm": 0, "--log-num-zeros-in-grad": 0,
    "--log-loss-scale-to-tensorboard": 0, "--log-batch-size-to-tensorboard": 0,
    "--log-world-size-to-tensorboard": 0, "--tensorboard-log-interval": 1,
    "--tensorboard-queue-size": 1, "--ckpt-format": 1,
    "--manual-gc": 0, "--manual-gc-interval": 1, "--empty-unused-memory-level": 1,
    "--distributed-backend-timeout": 1, "--ckpt-fully-parallel-save": 0,
    "--ckpt-fully-parallel-load": 0, "--dist-ckpt-strictness": 1,
    "--num-dataset-builder-threads": 1, "--mmap-bin-files": 0, "--no-mmap-bin-files": 0,
    "--use-dist-ckpt": 0, "--auto-detect-ckpt-format": 0, "--log-progress": 0,
    "--log-straggler": 0,  # hybrid logs the slowest and fastest rank every log line
    "--check-for-nan-in-loss-and-grad": 0,  # hybrid always checks (and says where)
    "--no-check-for-nan-in-loss-and-grad": 0,
    "--wandb-project": 1, "--wandb-exp-name": 1, "--wandb-save-dir": 1, "--local-rank": 1,
    # Megatron-DeepSpeed: a device sync at each checkpoint boundary, and its profiling
    # (hybrid's recompute needs neither: the boundaries are ordered on the stream)
    "--synchronize-each-layer": 0, "--profile-backward": 0,
    "--local_rank": 1,  # the deepspeed launcher's spelling
    # MoE: fusions and overlaps of Megatron's kernels, its logging switch (hybrid logs every
    # MoE layer's numbers every log line)
    "--moe-permute-fusion": 0, "--moe-router-fusion": 0, "--moe-shared-expert-overlap": 0,
    "--moe-per-layer-logging": 0, "--moe-use-legacy-grouped-gemm": 0,
}

# Megatron's "optimizer" is accepted only as the one hybrid runs.
_ONLY_VALUE: dict[str, tuple[str, str]] = {
    "--optimizer": ("adam", "hybrid trains with AdamW (decoupled weight decay, as Megatron's "
                            "adam); drop --optimizer or pass adam"),
    "--moe-router-dtype": ("fp32", "hybrid decides routing in fp32"),
}

_MOE = "hybrid's MoE layers do not have this option (docs/moe.md lists what they take)"
_FP8 = "hybrid has no FP8 training: use --bf16"
REFUSED: dict[str, str] = {
    "--moe-": _MOE, "--fp8-format": _FP8, "--fp8-": _FP8,
    "--moe-use-upcycling": "turn the dense checkpoint into an MoE one with "
                           "scripts/upcycle_checkpoint.py, then --load its output",
    "--moe-input-jitter-eps": "hybrid's router takes its input as it is",
    "--moe-layer-recompute": "recompute whole blocks: --recompute-granularity full",
    "--moe-extended-tp": "use --expert-tensor-parallel-size when it lands",
    "--moe-enable-deepep": "hybrid has no DeepEP dispatcher: --moe-token-dispatcher-type "
                           "alltoall",
    "--fp4-": _FP8,
    "--overlap-p2p-communication": "hybrid's pipeline schedules decide when their P2P "
                                   "transfers run: drop it",
    "--tp-comm-overlap": "hybrid overlaps ZeRO's DP collectives (--overlap-comm), not TP's "
                         "with userbuffers: drop it",
    "--use-torch-fsdp2": "hybrid's ZeRO stage 3 is its fully sharded mode: use --zero-stage 3",
    "--use-custom-fsdp": "use --zero-stage 3", "--use-megatron-fsdp": "use --zero-stage 3",
    "--data-parallel-sharding-strategy": "use --zero-stage 1, 2 or 3",
    "--optimizer-cpu-offload": "use --offload-optimizer (with --zero-stage 1, 2 or 3)",
    "--cpu-offloading": "activations go to the host with --recompute-granularity full "
                        "--cpu-checkpointing",
    "--ddp-bucket-size": "use --reduce-bucket-size and --allgather-bucket-size (elements)",
    "--multi-latent-attention": "hybrid has no multi-latent attention",
    "--mtp-num-layers": "hybrid has no multi-token prediction",
    "--squared-relu": "hybrid has no squared ReLU",
    "--apply-residual-connection-post-layernorm": "hybrid's blocks are pre-LayerNorm",
    "--reset-position-ids": "hybrid does not reset positions at document boundaries",
    "--reset-attention-mask": "hybrid attends across document boundaries (as Megatron "
                              "does by default)",
    "--spec": "hybrid builds its model from flags, not layer specs",
    "--yaml-cfg": "pass flags on the command line",
    "--use-precision-aware-optimizer": "hybrid keeps fp32 master weights and moments",
    "--calculate-per-token-loss": "hybrid averages the loss per micro-batch, as Megatron "
                                  "does by default",
    "--use-rotary-position-embeddings": "use --position-embedding-type rope",
    "--apply-layernorm-1p": "hybrid's norms scale by their weight, not 1 + weight",
    "--weight-decay-incr-style": "--weight-decay is constant",
    "--start-weight-decay": "--weight-decay is constant",
    "--end-weight-decay": "--weight-decay is constant",
    "--sgd-momentum": "hybrid trains with AdamW",
    "--init-method-xavier-uniform": "weights are initialized normal(0, --init-method-std)",
    "--data-parallel-random-init": "every DP replica starts from the same --seed",
    "--decoder-seq-length": "hybrid trains decoder-only GPTs: use --seq-length",
    "--profile": "run torch.profiler around a benchmarks/bench_*.py instead",
    "--retro-": "hybrid has no RETRO", "--vision-": "hybrid trains text GPTs only",
    "--encoder-": "hybrid trains decoder-only GPTs",
}


def _refusal(name: str, known: Collection[str]) -> str | None:
    if name in REFUSED:
        return REFUSED[name]
    if name in known or name in _ONLY_VALUE or name in NO_EFFECT:
        return None  # (a prefix refuses only what no table here or Flags takes)
    for prefix, why in REFUSED.items():
        if prefix.endswith("-") and name.startswith(prefix):
            return why
    return None


def split_megatron_flags(argv: list[str], known: Collection[str] = ()
                         ) -> tuple[list[str], list[str]]:
    """(the arguments hybrid parses, the no-effect flags dropped from them); ``known``:
    hybrid's own flags (``--moe-aux-loss-coeff``), which a refused prefix leaves alone.

    Raises ConfigError for a refused flag, or a one-value flag given another value.
    """
    ours, ignored, i = [], [], 0
    while i < len(argv):
        arg = argv[i]
        name, eq, inline = arg.partition("=")
        if not arg.startswith("--"):
            ours.append(arg)
            i += 1
            continue
        why = _refusal(name, known)
        if why is not None:
            raise ConfigError(f"{name} is a Megatron-LM flag hybrid does not implement: {why}")
        if name in _ONLY_VALUE:
            value = inline if eq else (argv[i + 1] if i + 1 < len(argv) else "")
            want, why = _ONLY_VALUE[name]
            if value != want:
                raise ConfigError(f"{name} {value}: hybrid implements only {want}. {why}")
            ignored.append(f"{name} {value}")
            i += 1 if eq else 2
            continue
        if name in NO_EFFECT:
            nargs = 0 if eq else NO_EFFECT[name]
            ignored.append(" ".join([arg] + argv[i + 1:i + 1 + nargs]))
            i += 1 + nargs
            continue
        ours.append(arg)
        i += 1
    return ours, ignored
