#!/usr/bin/env python
"""Merge a sharded hybrid checkpoint (any PP x TP x DP x ZeRO stage) into one file, or verify one.

    python scripts/convert_checkpoint.py CHECKPOINT_DIR_OR_SAVE_DIR OUT.pt [--with-optimizer]
    python scripts/convert_checkpoint.py verify CHECKPOINT_DIR_OR_SAVE_DIR
    python scripts/convert_checkpoint.py export --to dcp CHECKPOINT_DIR_OR_SAVE_DIR OUT_DIR
    python scripts/convert_checkpoint.py export --to megatron CHECKPOINT_DIR_OR_SAVE_DIR OUT_DIR \
        [--tensor-model-parallel-size T] [--data-parallel-size D] \
        [--pipeline-model-parallel-size P] [--decoder-first-pipeline-num-layers F] \
        [--decoder-last-pipeline-num-layers L] [--virtual-pipeline-model-parallel-size V] \
        [--expert-model-parallel-size E] \
        [--megatron-dist-opt dp_reshardable|fully_reshardable] \
        [--megatron-layer-spec local|transformer_engine] [--megatron-ddp-bucket-size N] \
        [--dtype fp32|bf16]
    python scripts/convert_checkpoint.py export --to deepspeed CHECKPOINT_DIR_OR_SAVE_DIR OUT_DIR \
        [--dp-size N] [--zero-stage {0,1,2,3}] [--tag TAG] [--param-groups matrices|one] \
        [--dtype fp32|bf16|fp16] [--ds-config DS_CONFIG.json]

``export --to deepspeed`` writes DeepSpeed 0.19.8's ``OUT_DIR/global_stepN/`` (and
``latest``) for DeepSpeed's ``engine.load_checkpoint(OUT_DIR)`` at that DP size and ZeRO
stage: masters, Adam moments, step, ``global_steps``/``global_samples`` and the
``hybrid.deepspeed`` engine's scheduler state; a ``pretrain_gpt.py`` GPT-2 as a
transformers ``GPT2LMHeadModel`` (its ``config.json`` beside ``latest``). ``--dtype bf16``
writes a bf16 run's files (``bf16_zero_pp_rank_*``, the module's weights in bf16; the
default for a checkpoint trained in bf16, or where ``--ds-config``, the DeepSpeed run's
config recorded in the files, enables bf16); ``--dtype fp16`` an fp16 run's, with its
loss scale (the default for a checkpoint trained in fp16, or a ``--ds-config`` enabling
fp16).

``verify`` reads every file of the checkpoint (the newest one of a --save
directory) and checks it against the checksums saved with it; it prints one
JSON line (files, bytes, seconds) and exits 0, or names every damaged file and
exits 2. A load checks the bytes it reads anyway; this checks a checkpoint
before it is needed (after a copy, before deleting the ones before it).

``export --to dcp`` writes the checkpoint as torchtitan's ``OUT_DIR/step-N/`` torch DCP
checkpoint, model and optimizer state (hybrid/checkpoint/peers/dcp_export.py).

OUT.pt holds ``{"model": {name: full fp32 tensor}, "metadata": {...}}`` (and
``"optimizer": {name: {"exp_avg", "exp_avg_sq"}}`` with --with-optimizer), loadable
with ``torch.load`` and, for the model, into a TP=1 ``models.gpt.GPT`` (fused
parameters are saved with their full shape -- SwiGLU's ``(2, F, C)`` -- which
:func:`hybrid.checkpoint.full_model.load_full_weights` reshapes to the model's).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from hybrid.checkpoint import iter_full_params, resolve_checkpoint
from hybrid.checkpoint.files import complete_checkpoints
from hybrid.checkpoint.integrity import verify_checkpoint
from hybrid.errors import CheckpointError


def verify(argv) -> int:
    ap = argparse.ArgumentParser(prog="convert_checkpoint.py verify",
                                 description="check every byte of a checkpoint against the "
                                             "checksums saved with it")
    ap.add_argument("checkpoint", help="an iter_* directory, or a --save directory (newest)")
    a = ap.parse_args(argv)
    try:
        report = verify_checkpoint(resolve_checkpoint(a.checkpoint))
    except CheckpointError as e:
        print(f"convert_checkpoint.py: error: {e}", file=sys.stderr)
        return 2
    for message in report["damaged"]:
        print(f"convert_checkpoint.py: error: {message}", file=sys.stderr)
    print(json.dumps({k: v for k, v in report.items() if k != "damaged"}
                     | {"damaged": len(report["damaged"])}))
    return 2 if report["damaged"] else 0


def _refuse_hybrid_output(out: str) -> None:
    """An export's output directory that holds hybrid checkpoints (often the checkpoint's
    own --save directory) is refused: the peer's files would go beside hybrid's, and
    DeepSpeed's ``latest`` over hybrid's."""
    names = complete_checkpoints(out) if os.path.isdir(out) else []
    if names:
        raise CheckpointError(f"{out}: holds hybrid checkpoints ({names[-1]}), which the "
                              f"export would write beside (DeepSpeed's latest over "
                              f"hybrid's): give a new output directory")


def export_dcp(argv) -> int:
    """``export --to dcp CKPT OUT``: a torchtitan-structured DCP checkpoint
    (hybrid/checkpoint/peers/dcp_export.py, :func:`write`)."""
    from hybrid.checkpoint.peers import dcp_export
    ap = argparse.ArgumentParser(prog="convert_checkpoint.py export --to dcp",
                                 description="write a hybrid checkpoint as torchtitan's "
                                             "step-N/ DCP checkpoint, which FSDP2 / TP "
                                             "runs load at any layout")
    ap.add_argument("checkpoint", help="an iter_* directory, or a --save directory (newest)")
    ap.add_argument("output", help="the checkpoint folder to write step-N/ into")
    ap.add_argument("--lr", type=float, help="the learning rate the optimizer state holds "
                                             "(default: hybrid's schedule's for the next step)")
    ap.add_argument("--param-groups", choices=("matrices", "one"), default="matrices",
                    help="the loading optimizer's groups: matrices (weight decay on the "
                         "matrices only, hybrid's rule) or one (decay on every parameter, "
                         "torchtitan's default)")
    a = ap.parse_args(argv)
    try:
        _refuse_hybrid_output(a.output)
        summary = dcp_export.write(resolve_checkpoint(a.checkpoint), a.output, lr=a.lr,
                            groups=a.param_groups)
    except CheckpointError as e:
        print(f"convert_checkpoint.py: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(summary))
    return 0


def export_megatron(argv) -> int:
    """``export --to megatron``: Megatron-LM's save directory (torch_dist), which
    megatron-core's dist_checkpointing.load reads at any TP
    (:func:`hybrid.checkpoint.peers.megatron.write`)."""
    from hybrid.checkpoint.peers import megatron
    ap = argparse.ArgumentParser(prog="convert_checkpoint.py export --to megatron",
                                 description="write a hybrid checkpoint as a Megatron-LM "
                                             "torch_dist save directory")
    ap.add_argument("checkpoint", help="an iter_* directory, or a --save directory (newest)")
    ap.add_argument("output", help="the Megatron-LM save directory to write (--load there)")
    ap.add_argument("--tensor-model-parallel-size", type=int, default=1,
                    help="the TP recorded in args (the non-distributed optimizer's files "
                         "load at any TP; dp_reshardable's buckets are this TP's)")
    ap.add_argument("--data-parallel-size", type=int, default=1,
                    help="the DP recorded in args (dp_reshardable: its buckets' padding "
                         "and chunks; they load at any DP)")
    ap.add_argument("--pipeline-model-parallel-size", type=int, default=1,
                    help="the PP recorded in args (dp_reshardable: one group of buckets "
                         "per stage and TP rank, for Megatron-LM's split of the layers "
                         "(even, which PP must divide, or the next two flags'); the tied "
                         "word embeddings' copy on the last stage; the other optimizer "
                         "layouts do not depend on it)")
    ap.add_argument("--decoder-first-pipeline-num-layers", type=int, default=None,
                    help="with --pipeline-model-parallel-size: the loading run's layers on "
                         "its first stage (Megatron-LM's flag; the rest split evenly)")
    ap.add_argument("--decoder-last-pipeline-num-layers", type=int, default=None,
                    help="with --pipeline-model-parallel-size: the loading run's layers on "
                         "its last stage")
    ap.add_argument("--virtual-pipeline-model-parallel-size", type=int, default=None,
                    help="with --pipeline-model-parallel-size: the loading run's model "
                         "chunks per stage (dp_reshardable: one grad buffer each)")
    ap.add_argument("--expert-model-parallel-size", type=int, default=1,
                    help="an MoE checkpoint: the EP recorded in args (dp_reshardable: one "
                         "group of expert buckets per EP rank, over DP / EP ranks; the "
                         "non-distributed optimizer's files load at any EP)")
    ap.add_argument("--megatron-dist-opt", default=None, metavar="{dp_reshardable,"
                    "fully_reshardable}",
                    help="write the optimizer state for megatron-core's DistributedOptimizer "
                         "(--use-distributed-optimizer): dp_reshardable (Megatron-LM's "
                         "default sharding type) or fully_reshardable "
                         "(--dist-ckpt-optim-fully-reshardable); default: the non-"
                         "distributed optimizer's")
    ap.add_argument("--megatron-layer-spec", default="local",
                    metavar="{local,transformer_engine}",
                    help="dp_reshardable: the loading run's layer spec (--transformer-impl), "
                         "which orders its parameters in the buckets")
    ap.add_argument("--megatron-ddp-bucket-size", type=int, default=None,
                    help="dp_reshardable: the loading run's --ddp-bucket-size under "
                         "--overlap-grad-reduce (default: one bucket, Megatron-LM's without "
                         "--overlap-grad-reduce)")
    ap.add_argument("--dtype", default=None, metavar="{fp32,bf16}",
                    help="the loading run's precision (bf16: Megatron-LM's --bf16, its "
                         "weights bf16 and its grad buffer's keys dtype_(torch.bfloat16, "
                         "torch.float32)); default: the checkpoint's")
    a = ap.parse_args(argv)
    try:
        _refuse_hybrid_output(a.output)
        out = megatron.write(a.checkpoint, a.output, tp=a.tensor_model_parallel_size,
                             dp=a.data_parallel_size, pp=a.pipeline_model_parallel_size,
                             dist_opt=a.megatron_dist_opt,
                             spec=a.megatron_layer_spec,
                             bucket_size=a.megatron_ddp_bucket_size, dtype=a.dtype,
                             first=a.decoder_first_pipeline_num_layers,
                             last=a.decoder_last_pipeline_num_layers,
                             vpp=a.virtual_pipeline_model_parallel_size,
                             ep=a.expert_model_parallel_size)
    except CheckpointError as e:
        print(f"convert_checkpoint.py: error: {e}", file=sys.stderr)
        return 2
    what = f", {a.megatron_dist_opt} optimizer state" if a.megatron_dist_opt else ""
    print(f"wrote {out} (Megatron-LM torch_dist{what})")
    return 0


def export_deepspeed(argv) -> int:
    """``export --to deepspeed CKPT OUT [--dp-size N] [--zero-stage K] [--tag T]
    [--param-groups G] [--dtype D] [--ds-config F]``:
    DeepSpeed's ZeRO checkpoint (:func:`hybrid.checkpoint.peers.deepspeed.write`)."""
    from hybrid.checkpoint.peers.deepspeed import write
    ap = argparse.ArgumentParser(prog="convert_checkpoint.py export --to deepspeed",
                                 description="write a hybrid checkpoint as DeepSpeed's ZeRO "
                                             "checkpoint, which its engine.load_checkpoint "
                                             "continues from")
    ap.add_argument("checkpoint", help="an iter_* directory, or a --save directory (newest)")
    ap.add_argument("out_dir", help="the peer's save directory (its load_checkpoint dir)")
    ap.add_argument("--dp-size", type=int, default=1,
                    help="the data-parallel size DeepSpeed will load it at")
    ap.add_argument("--zero-stage", type=int, default=2, choices=[0, 1, 2, 3],
                    help="the ZeRO stage of its optimizer files (0: none, the optimizer state in "
                         "the model-state file)")
    ap.add_argument("--tag", default=None, help="the tag (default global_stepN)")
    ap.add_argument("--param-groups", default=None, choices=["matrices", "one"],
                    help="DeepSpeed's optimizer groups: 'matrices' (weight decay on the "
                         "matrices, none on biases and norms: hybrid's rule, Hugging Face's "
                         "Trainer's groups; the default for a pretrain_gpt.py checkpoint) or "
                         "'one' (model.parameters(); the default for a hybrid.deepspeed one)")
    ap.add_argument("--dtype", default=None, choices=["fp32", "bf16", "fp16"],
                    help="the dtype DeepSpeed trains in: bf16 (fp16) writes a bf16 (an fp16) "
                         "run's files "
                         "(default: --ds-config's, else the checkpoint's own)")
    ap.add_argument("--ds-config", default=None,
                    help="the DeepSpeed run's ds_config (JSON), recorded in the files; its "
                         "bf16 block sets the dtype, and at ZeRO 1 in bf16 its "
                         "data_types.grad_accum_dtype fp32 means BF16_Optimizer's files")
    a = ap.parse_args(argv)
    try:
        _refuse_hybrid_output(a.out_dir)
        ds_config = None
        if a.ds_config is not None:
            try:
                with open(a.ds_config) as f:
                    ds_config = json.load(f)
            except (OSError, ValueError) as e:
                raise CheckpointError(f"--ds-config {a.ds_config}: {e}") from None
            if not isinstance(ds_config, dict):
                raise CheckpointError(f"--ds-config {a.ds_config}: holds a "
                                      f"{type(ds_config).__name__}, not a ds_config object")
        out = write(a.checkpoint, a.out_dir, a.dp_size, a.zero_stage, tag=a.tag,
                    param_groups=a.param_groups, dtype=a.dtype, ds_config=ds_config)
    except CheckpointError as e:
        print(f"convert_checkpoint.py: error: {e}", file=sys.stderr)
        return 2
    dtype = _written_dtype(out)
    print(f"wrote {out}: a DeepSpeed ZeRO {a.zero_stage} {dtype} checkpoint for DP "
          f"{a.dp_size}")
    return 0


def _written_dtype(tag_dir: str) -> str:
    """The dtype of the DeepSpeed run an export's files are for (its recorded ds_config)."""
    from hybrid.checkpoint.peers.deepspeed_bf16 import bf16_enabled, fp16_enabled
    from hybrid.checkpoint.peers.deepspeed_files import load_file
    model = sorted(n for n in os.listdir(tag_dir) if n.endswith("model_states.pt"))[0]
    config = load_file(os.path.join(tag_dir, model)).get("ds_config")
    return "bf16" if bf16_enabled(config) else "fp16" if fp16_enabled(config) else "fp32"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["verify"]:
        return verify(argv[1:])
    if argv[:3] == ["export", "--to", "dcp"]:
        return export_dcp(argv[3:])
    if argv[:3] == ["export", "--to", "megatron"]:
        return export_megatron(argv[3:])
    if argv[:3] == ["export", "--to", "deepspeed"]:
        return export_deepspeed(argv[3:])
    if argv[:1] == ["export"]:
        print("convert_checkpoint.py: error: export takes --to deepspeed, megatron or dcp "
              "first (export --to FORMAT CHECKPOINT OUT_DIR)", file=sys.stderr)
        return 2
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoint", help="an iter_* directory, or a --save directory (newest)")
    ap.add_argument("output", help="the single file to write")
    ap.add_argument("--with-optimizer", action="store_true", help="include Adam moments")
    a = ap.parse_args(argv)
    try:
        ckpt = resolve_checkpoint(a.checkpoint)
        if os.path.exists(a.output):
            raise CheckpointError(f"{a.output}: already exists; not overwriting it")
        keys = ("master", "exp_avg", "exp_avg_sq") if a.with_optimizer else ("master",)
        meta, params = iter_full_params(ckpt, keys)  # one parameter read at a time
        out = {"model": {}, "metadata": meta}
        for n, s in params:
            out["model"][n] = s["master"]
            if a.with_optimizer:
                out.setdefault("optimizer", {})[n] = {"exp_avg": s["exp_avg"],
                                                      "exp_avg_sq": s["exp_avg_sq"]}
        tmp = a.output + ".tmp"
        try:
            torch.save(out, tmp)
            os.replace(tmp, a.output)
        except (OSError, RuntimeError) as e:  # torch.save's file errors are RuntimeErrors
            raise CheckpointError(f"{a.output}: cannot write ({e})") from e
    except CheckpointError as e:
        print(f"convert_checkpoint.py: error: {e}", file=sys.stderr)
        return 2
    n = sum(t.numel() for t in out["model"].values())
    print(f"wrote {a.output}: {len(out['model'])} tensors, {n} parameters, iteration "
          f"{meta['iteration']} (saved at PP {meta.get('pipeline_model_parallel_size', 1)} x "
          f"TP {meta['tensor_model_parallel_size']} x DP {meta['data_parallel_size']}, ZeRO "
          f"stage {meta['zero_stage']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
