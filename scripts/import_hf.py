#!/usr/bin/env python
"""Turn a Hugging Face GPT-2 model directory on disk into a hybrid checkpoint.

    python scripts/import_hf.py HF_DIR SAVE_DIR
    bash scripts/pretrain_gpt.sh --load SAVE_DIR --num-layers ... (matching shape)

Reads ``config.json`` and ``model.safetensors`` (or ``pytorch_model.bin``) and
writes ``SAVE_DIR/iter_0000000`` with a fresh optimizer; ``--load`` then reads
it into any TP x DP x ZeRO layout. Prints the flags that match the model.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from hybrid.checkpoint.save import write_unsharded_checkpoint  # noqa: E402
from hybrid.errors import CheckpointError  # noqa: E402
from hybrid.hf import from_hf  # noqa: E402


def _read_weights(hf_dir: str) -> dict:
    st = os.path.join(hf_dir, "model.safetensors")
    if os.path.isfile(st):
        from safetensors.torch import load_file
        return load_file(st)
    pt = os.path.join(hf_dir, "pytorch_model.bin")
    if os.path.isfile(pt):
        return torch.load(pt, map_location="cpu", weights_only=True)
    raise CheckpointError(f"{hf_dir}: no model.safetensors or pytorch_model.bin")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("hf_dir")
    ap.add_argument("save_dir")
    a = ap.parse_args(argv)
    try:
        path = os.path.join(a.hf_dir, "config.json")
        try:
            with open(path, encoding="utf-8") as f:
                hc = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{path}: missing or unreadable ({e})") from e
        if hc.get("model_type") != "gpt2":
            raise CheckpointError(f"{path}: model_type {hc.get('model_type')!r}, expected gpt2")
        ffn = hc.get("n_inner") or 4 * hc["n_embd"]
        model = from_hf(_read_weights(a.hf_dir), hc["n_layer"], hc["n_head"])
        flags = {"num_layers": hc["n_layer"], "hidden_size": hc["n_embd"],
                 "num_attention_heads": hc["n_head"], "ffn_hidden_size": ffn,
                 "max_position_embeddings": hc["n_positions"]}
        out = write_unsharded_checkpoint(a.save_dir, model, flags, hc["vocab_size"])
    except CheckpointError as e:
        print(f"import_hf.py: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out}; train from it with --load {a.save_dir} "
          + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in flags.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
