#!/usr/bin/env python
"""Export a hybrid checkpoint (any layout) as a Hugging Face GPT-2 model directory.

    python scripts/export_hf.py SAVE_DIR_OR_CHECKPOINT OUT_DIR

Writes ``OUT_DIR/config.json`` and ``OUT_DIR/model.safetensors``, which
``transformers.GPT2LMHeadModel.from_pretrained(OUT_DIR)`` loads. Needs the
``safetensors`` package (``pip install -e '.[dev]'`` has it).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hybrid.checkpoint import iter_full_params, resolve_checkpoint  # noqa: E402
from hybrid.errors import CheckpointError  # noqa: E402
from hybrid.hf import hf_config, to_hf  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoint")
    ap.add_argument("output_dir")
    a = ap.parse_args(argv)
    try:
        from safetensors.torch import save_file
    except ImportError:
        print("export_hf.py: error: needs the safetensors package (pip install safetensors)",
              file=sys.stderr)
        return 2
    try:
        ckpt = resolve_checkpoint(a.checkpoint)
        if os.path.exists(os.path.join(a.output_dir, "model.safetensors")):
            raise CheckpointError(f"{a.output_dir}: already holds a model; not overwriting it")
        meta, params = iter_full_params(ckpt, ("master",))  # one parameter at a time
        weights = {n: s["master"] for n, s in params}
        cfg, vocab = meta["config"], meta["vocab_size"]
        if cfg.get("ffn_hidden_size") is None:
            cfg = dict(cfg, ffn_hidden_size=4 * cfg["hidden_size"])
        tensors = to_hf(weights, cfg["num_layers"],
                        cfg["num_attention_heads"], vocab)
    except CheckpointError as e:
        print(f"export_hf.py: error: {e}", file=sys.stderr)
        return 2
    os.makedirs(a.output_dir, exist_ok=True)
    # HF ties lm_head to wte, so only the embedding is stored.
    save_file(tensors, os.path.join(a.output_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(a.output_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(hf_config(cfg, vocab), f, indent=1)
    print(f"wrote {a.output_dir} (GPT-2, {cfg['num_layers']} layers, hidden "
          f"{cfg['hidden_size']}, vocab {vocab}) from {ckpt}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
