"""A whole checkpoint as one single-process model (TP 1), for generation and export checks.

``load_full_model(ckpt)`` reads every parameter's full tensor (any saved
layout, one parameter at a time), rebuilds the GPT the run trained -- GPT-2
or Llama-shaped, its model section rebuilt from the flags in ``metadata.json``
(:func:`saved_model_config`) -- and loads them:
the padded vocabulary rows are re-padded for TP 1, and a fused parameter
saved with its full shape (SwiGLU's ``(2, F, C)``) takes the model's local
shape, which at TP 1 is the same elements in the same order.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from hybrid.checkpoint.load import VOCAB_PARAMS
from hybrid.checkpoint.reshard import iter_full_params
from hybrid.config.model import ModelConfig
from hybrid.errors import CheckpointError
from hybrid.parallel.state import ParallelState
from models.gpt import GPT


def saved_model_config(meta: dict) -> ModelConfig:
    """The model section a checkpoint was trained with, from its metadata.json ``meta``:
    the saved flat flags (``"config"``, read as the command line is; a key an older
    checkpoint lacks takes its default, 128 for ``make_vocab_size_divisible_by``) and
    the tokenizer's ``"vocab_size"``."""
    return ModelConfig.from_flags(meta["config"]).with_vocab_size(meta["vocab_size"])


def load_full_weights(model: GPT, weights: dict[str, torch.Tensor],
                      buffers: dict[str, list[float]] | None = None) -> GPT:
    """Load full (unsharded) ``weights`` into a TP-1 ``model``; the vocabulary
    parameters may have any number of padding rows. ``buffers``: a checkpoint's saved
    buffers (metadata ``"buffers"``: the MoE routers' expert biases), by name; a buffer
    not there keeps the model's own value."""
    sd: dict[str, torch.Tensor] = {
        name: (torch.tensor(buffers[name], dtype=b.dtype) if buffers and name in buffers
               else b) for name, b in model.named_buffers()}
    vocab = model.cfg.vocab_size
    assert vocab is not None  # (a built GPT knows its vocabulary)
    for name, p in model.named_parameters():
        if name not in weights:
            raise CheckpointError(f"the checkpoint has no {name!r}; a different model")
        w = weights[name]
        if name in VOCAB_PARAMS:
            rows = min(vocab, w.shape[0])
            w = torch.cat([w[:rows], w.new_zeros(p.shape[0] - rows, *w.shape[1:])])
        if w.numel() != p.numel():
            raise CheckpointError(f"{name}: {list(w.shape)} in the checkpoint, "
                                  f"{list(p.shape)} in the model")
        sd[name] = w.reshape(p.shape)
    model.load_state_dict(sd)
    return model


def load_full_model(ckpt: str, device: str | torch.device = "cpu") -> tuple[GPT, dict]:
    """(the checkpoint's model on one process in eval mode, its saved config dict)."""
    meta, params = iter_full_params(ckpt, ("master",))  # one parameter read at a time
    weights = {n: s["master"] for n, s in params}
    c = meta["config"]
    # No dropout (eval), and torch's own choice of attention kernel: the one the run
    # trained with may not exist on this machine, and it computes the same function.
    cfg = replace(saved_model_config(meta), hidden_dropout=0.0, attention_dropout=0.0,
                  attention_backend="auto")
    model = GPT(cfg, ParallelState.single().tp_group, device="meta")
    model.to_empty(device="cpu")
    model.init_buffers("cpu")
    load_full_weights(model, weights, meta.get("buffers"))
    return model.to(device).eval(), c
