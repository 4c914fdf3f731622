#!/usr/bin/env python
"""Sample text from a checkpoint (any layout), on one process.

    python scripts/generate.py --load runs/ckpt --prompt "ROMEO:" --max-new-tokens 200

Rebuilds the full model from the sharded checkpoint, uses the tokenizer the run
trained with (its flags are in the checkpoint's metadata; override with
--tokenizer-type/--vocab-file/--merge-file/--tokenizer-model/--vocab-size), and samples with
temperature and top-k.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch

from hybrid.checkpoint import resolve_checkpoint
from hybrid.checkpoint.full_model import load_full_model
from hybrid.config import kernel_config_from_env
from hybrid.config.sections import TokenizerConfig
from hybrid.data.tokenizer import build_tokenizer
from hybrid.errors import CheckpointError, ConfigError, DataError
from hybrid.kernels import configure


def load_model(ckpt: str, device: str):
    """(the checkpoint's model on ``device``, eval mode; its saved config)."""
    return load_full_model(ckpt, device)


@torch.no_grad()
def sample(model, ids: list[int], n: int, temperature: float, top_k: int, seed: int):
    g = torch.Generator(device="cpu").manual_seed(seed)
    ctx = model.cfg.max_position_embeddings
    x = torch.tensor([ids], dtype=torch.long, device=next(model.parameters()).device)
    for _ in range(n):
        logits = model(x[:, -ctx:])[0, -1, : model.cfg.vocab_size].float().cpu()
        if temperature <= 0:
            nxt = int(logits.argmax())
        else:
            logits = logits / temperature
            if top_k > 0:
                kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
                logits[logits < kth] = float("-inf")
            nxt = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=g))
        x = torch.cat([x, torch.tensor([[nxt]], device=x.device)], dim=1)
    return x[0].tolist()


def _check_args(a) -> str | None:
    """What is wrong with the sampling flags (None: nothing), naming the flag."""
    if a.max_new_tokens < 0:
        return f"--max-new-tokens must be >= 0, got {a.max_new_tokens}"
    if not 0 <= a.temperature < math.inf:
        return f"--temperature must be a finite number >= 0 (0: greedy), got {a.temperature}"
    if a.top_k < 0:
        return f"--top-k must be >= 0 (0: the whole vocabulary), got {a.top_k}"
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        return f"--device {a.device}: this torch sees no CUDA device (use --device cpu)"
    return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--load", required=True, help="a --save directory or an iter_* directory")
    ap.add_argument("--prompt", default="\n")
    ap.add_argument("--max-new-tokens", type=int, default=200)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--top-k", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tokenizer-type", default=None)
    ap.add_argument("--vocab-file")
    ap.add_argument("--merge-file")
    ap.add_argument("--tokenizer-file")
    ap.add_argument("--tokenizer-model")
    ap.add_argument("--vocab-size", type=int)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = ap.parse_args(argv)
    bad = _check_args(a)
    if bad:
        print(f"generate.py: error: {bad}", file=sys.stderr)
        return 2
    configure(kernel_config_from_env(os.environ))  # this script's entry point: HYBRID_* settings
    try:
        ckpt = resolve_checkpoint(a.load)
        model, c = load_model(ckpt, a.device)
        # each tokenizer flag given here, else the checkpoint's (its saved flat flags)
        tok = build_tokenizer(TokenizerConfig.from_flags({
            name: getattr(a, name) or c.get(name)
            for name in ("tokenizer_type", "vocab_file", "merge_file", "tokenizer_file",
                         "tokenizer_model", "vocab_size")}))
        if tok.vocab_size > model.cfg.vocab_size:  # as hybrid.checkpoint.load.check_model
            raise DataError(f"--load {a.load}: the checkpoint was trained on a vocabulary of "
                            f"{model.cfg.vocab_size} tokens, this tokenizer has "
                            f"{tok.vocab_size}: drop the tokenizer flags to use the "
                            f"checkpoint's own, or give that one")
    except (CheckpointError, ConfigError, DataError) as e:
        print(f"generate.py: error: {e}", file=sys.stderr)
        return 2
    prompt = tok.encode(a.prompt) or [tok.eod]
    out = sample(model, prompt, a.max_new_tokens, a.temperature, a.top_k, a.seed)
    print(tok.decode(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
