"""The Megatron recorder's command line (benchmarks/peers/record_megatron_checkpoint.py):
its flags, their checks and default output directories, and the worker's argv the
launcher hands each rank."""

from __future__ import annotations

import argparse
import os

from benchmarks.peers.megatron_pipeline import Split
from benchmarks.peers.megatron_recipe import ARCH, BUCKET, moe_config


def parse(description: str, out: str, legacy_out: str) -> argparse.Namespace:
    """The recorder's flags, checked (argparse's exit 2 on a bad combination); ``out`` and
    ``legacy_out``: the default directories of the torch_dist and legacy fixtures (a run
    of --dist-opt, experts or PP > 1 goes beside them under its own name)."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--out", default=out)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--world", type=int, default=2)
    p.add_argument(
        "--pp",
        type=int,
        default=1,
        help="pipeline stages (with --dist-opt: megatron-core's pipeline schedule), "
        "into ..._pp<N> by default",
    )
    p.add_argument(
        "--layers",
        type=int,
        default=Split().layers,
        help="the model's layers (with --pp: split over the stages)",
    )
    p.add_argument(
        "--first-stage-layers",
        type=int,
        help="with --pp: the first stage's layers (megatron-core's "
        "num_layers_in_first_pipeline_stage)",
    )
    p.add_argument(
        "--last-stage-layers",
        type=int,
        help="with --pp: the last stage's layers (num_layers_in_last_pipeline_stage)",
    )
    p.add_argument(
        "--model",
        choices=sorted(ARCH),
        default="llama",
        help="mixtral: experts in every layer, into .../megatron_moe_ep<EP>",
    )
    p.add_argument("--ep", type=int, default=1, help="megatron's --expert-model-parallel-size")
    p.add_argument(
        "--format",
        choices=("torch_dist", "torch"),
        default="torch_dist",
        help="torch: Megatron-LM's legacy format, into "
        "tests/fixtures/peers/megatron_legacy by default",
    )
    p.add_argument(
        "--dist-opt",
        choices=("dp_reshardable", "fully_reshardable"),
        help="megatron-core's DistributedOptimizer, saved in this sharding type "
        "(into tests/fixtures/peers/megatron_distopt_<type> by default)",
    )
    p.add_argument(
        "--ddp-bucket-size",
        type=int,
        default=BUCKET,
        help="with --dist-opt: DDP's bucket size under --overlap-grad-reduce; 0: "
        "Megatron-LM's default (no overlap: one bucket)",
    )
    p.add_argument(
        "--bf16",
        action="store_true",
        help="Megatron-LM's --bf16 (bf16 params, fp32 masters, grads reduced in "
        "fp32): with --dist-opt, into ..._<type>_bf16 by default; without, "
        "the non-distributed optimizer, with --resume only",
    )
    p.add_argument(
        "--resume",
        help="instead: an iter_* directory to load and continue "
        "(on the batches of --tokens, a JSON list)",
    )
    p.add_argument("--tokens")
    p.add_argument("--losses", help="with --resume: where the losses JSON goes")
    p.add_argument("--resave", help="with --resume: save what was loaded there first")
    p.add_argument(
        "--also",
        action="append",
        help="with --resume --dist-opt: then this iter_* directory, loaded into "
        "a fresh run of the same flags in the sharding type its common.pt "
        "records, stepping the same batches (its losses under 'also')",
    )
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.format == "torch" and a.out == out:
        a.out = legacy_out
    if (a.dist_opt or moe_config(a.model)) and a.out == out:  # (experts: megatron_moe_ep<N>_)
        a.out = os.path.join(
            os.path.dirname(out),
            (f"megatron_moe_ep{a.ep}_" if moe_config(a.model) else "megatron_")
            + (f"distopt_{a.dist_opt}" if a.dist_opt else "")
            + ("_bf16" if a.bf16 else "")
            + (f"_pp{a.pp}" if a.pp > 1 else ""),
        ).rstrip("_")
    if a.pp > 1 and not a.dist_opt:
        p.error("--pp is recorded with --dist-opt only (megatron-core's DistributedOptimizer)")
    if a.bf16 and not a.dist_opt and not a.resume:
        p.error(
            "--bf16 is recorded with --dist-opt only (megatron-core's DistributedOptimizer); "
            "without it, with --resume only"
        )
    if (a.first_stage_layers or a.last_stage_layers) and a.pp < 2:
        p.error("--first-stage-layers / --last-stage-layers: with --pp 2 or more")
    return a


def layer_split(a: argparse.Namespace) -> Split:
    """The run's split of its layers over the PP stages."""
    return Split(a.layers, a.first_stage_layers, a.last_stage_layers)


def worker_argv(a: argparse.Namespace) -> list[str]:
    """The flags each rank's ``--worker`` gets (the launcher's own dropped)."""
    more = (
        [
            "--resume",
            a.resume,
            "--tokens",
            a.tokens,
            "--losses",
            a.losses,
            *(["--resave", a.resave] if a.resave else []),
            *[f for d in a.also or [] for f in ("--also", d)],
        ]
        if a.resume
        else []
    )
    return [
        "--worker",
        "--out",
        a.out,
        "--tp",
        str(a.tp),
        "--pp",
        str(a.pp),
        "--layers",
        str(a.layers),
        *(["--first-stage-layers", str(a.first_stage_layers)] if a.first_stage_layers else []),
        *(["--last-stage-layers", str(a.last_stage_layers)] if a.last_stage_layers else []),
        "--ep",
        str(a.ep),
        "--model",
        a.model,
        "--format",
        a.format,
        *more,
        "--ddp-bucket-size",
        str(a.ddp_bucket_size),
        *(["--dist-opt", a.dist_opt] if a.dist_opt else []),
        *(["--bf16"] if a.bf16 else []),
    ]
