#!/usr/bin/env python
"""Merge a sharded hybrid checkpoint (any TP x DP x ZeRO stage) into one file.

    python scripts/convert_checkpoint.py CHECKPOINT_DIR_OR_SAVE_DIR OUT.pt [--with-optimizer]

OUT.pt holds ``{"model": {name: full fp32 tensor}, "metadata": {...}}`` (and
``"optimizer": {name: {"exp_avg", "exp_avg_sq"}}`` with --with-optimizer), loadable
with ``torch.load`` and, for the model, into a TP=1 ``models.gpt.GPT`` (fused
parameters are saved with their full shape -- SwiGLU's ``(2, F, C)`` -- which
:func:`hybrid.checkpoint.full_model.load_full_weights` reshapes to the model's).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from hybrid.checkpoint import iter_full_params, resolve_checkpoint
from hybrid.errors import CheckpointError


def main(argv=None) -> int:
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
          f"{meta['iteration']} (saved at TP {meta['tensor_model_parallel_size']} x DP "
          f"{meta['data_parallel_size']}, ZeRO stage {meta['zero_stage']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
