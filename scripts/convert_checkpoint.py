#!/usr/bin/env python
"""Merge a sharded hybrid checkpoint (any PP x TP x DP x ZeRO stage) into one file, or verify one.

    python scripts/convert_checkpoint.py CHECKPOINT_DIR_OR_SAVE_DIR OUT.pt [--with-optimizer]
    python scripts/convert_checkpoint.py verify CHECKPOINT_DIR_OR_SAVE_DIR
    python scripts/convert_checkpoint.py export --to deepspeed CHECKPOINT OUT_DIR \
        [--dp-size N] [--zero-stage {1,2,3}] [--tag TAG]

``export --to deepspeed`` writes DeepSpeed 0.19.8's ``OUT_DIR/global_stepN/`` (and
``latest``) for DeepSpeed's ``engine.load_checkpoint(OUT_DIR)`` at that DP size and ZeRO
stage: masters, Adam moments, step, ``global_steps``/``global_samples`` and the
``hybrid.deepspeed`` engine's scheduler state; a ``pretrain_gpt.py`` GPT-2 as a
transformers ``GPT2LMHeadModel`` (its ``config.json`` beside ``latest``).

``verify`` reads every file of the checkpoint (the newest one of a --save
directory) and checks it against the checksums saved with it; it prints one
JSON line (files, bytes, seconds) and exits 0, or names every damaged file and
exits 2. A load checks the bytes it reads anyway; this checks a checkpoint
before it is needed (after a copy, before deleting the ones before it).

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


def export(argv) -> int:
    """``export --to FORMAT CHECKPOINT OUT_DIR [layout options]``: a hybrid checkpoint in
    another framework's format, which that framework loads and continues from."""
    ap = argparse.ArgumentParser(prog="convert_checkpoint.py export",
                                 description="write a hybrid checkpoint in another "
                                             "framework's checkpoint format")
    ap.add_argument("--to", required=True, choices=["deepspeed"], help="the format")
    ap.add_argument("checkpoint", help="an iter_* directory, or a --save directory (newest)")
    ap.add_argument("out_dir", help="the peer's save directory (its load_checkpoint dir)")
    ap.add_argument("--dp-size", type=int, default=1,
                    help="deepspeed: the data-parallel size DeepSpeed will load it at")
    ap.add_argument("--zero-stage", type=int, default=2, choices=[1, 2, 3],
                    help="deepspeed: the ZeRO stage of its optimizer files")
    ap.add_argument("--tag", default=None, help="deepspeed: the tag (default global_stepN)")
    a = ap.parse_args(argv)
    try:
        if a.to == "deepspeed":
            from hybrid.checkpoint.peers.deepspeed import write
            out = write(a.checkpoint, a.out_dir, a.dp_size, a.zero_stage, tag=a.tag)
            what = f"DeepSpeed ZeRO {a.zero_stage} checkpoint for DP {a.dp_size}"
    except CheckpointError as e:
        print(f"convert_checkpoint.py: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out}: a {what}")
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["verify"]:
        return verify(argv[1:])
    if argv[:1] == ["export"]:
        return export(argv[1:])
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
