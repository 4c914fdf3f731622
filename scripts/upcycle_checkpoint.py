#!/usr/bin/env python
"""Turn a dense hybrid checkpoint into an MoE one whose experts start as the dense MLPs
(upcycling, Megatron's ``--moe-use-upcycling``).

    python scripts/upcycle_checkpoint.py DENSE_CKPT SAVE_DIR --num-experts 8 [--moe-router-topk 2]
        [--moe-layer-freq 1] [--seed 1234]
    bash scripts/pretrain_gpt.sh --load SAVE_DIR ... (the flags it prints)

Reads the dense checkpoint (any layout; an ``iter_*`` directory or the newest under a
``--save`` directory) one parameter at a time and writes ``SAVE_DIR/iter_0000000`` with
a fresh optimizer: every parameter as it was, except that each MoE layer's (by
``--moe-layer-freq``) MLP becomes ``--num-experts`` copies of itself and a router drawn
from Normal(0, the run's ``--init-method-std``) with ``--seed``. With the default
router (a softmax over the top k logits: the gates sum to 1) the upcycled model computes
the dense model's function to rounding, whatever the router's draw: every expert is the
same MLP. The experts have no biases, so the dense model must have none
(``--disable-bias-linear``); the experts' width is the dense MLP's. Prints the flags to
train it with. A dense model into an MoE run without this step is refused by name at
``--load``.
"""

from __future__ import annotations

import argparse
import sys

import torch

from hybrid.checkpoint import iter_full_params, resolve_checkpoint
from hybrid.checkpoint.single_rank import write_unsharded_checkpoint
from hybrid.config.architecture import architecture_fields
from hybrid.config.moe import MoEConfig
from hybrid.errors import CheckpointError, ConfigError


def upcycle(dense: dict[str, torch.Tensor], config: dict, num_experts: int, topk: int,
            freq: str, seed: int) -> tuple[dict[str, torch.Tensor], dict]:
    """(the MoE model's full tensors, its config) from a dense model's and its saved
    config (module doc). The experts are expanded views of the dense weights: nothing is
    copied until written, one parameter at a time."""
    if config.get("num_experts"):
        raise CheckpointError(f"the checkpoint already has MoE layers (--num-experts "
                              f"{config['num_experts']}); upcycling takes a dense one")
    if architecture_fields(config)["add_bias_linear"]:
        raise CheckpointError("the dense model's MLPs have biases and experts have none; "
                              "upcycle a model trained with --disable-bias-linear")
    layers = config["num_layers"]
    moe_config = dict(config, num_experts=num_experts, moe_router_topk=topk,
                      moe_layer_freq=freq)
    moe = MoEConfig.from_flags(moe_config)
    assert moe is not None
    which = moe.layers(layers)  # (ConfigError for a pattern that does not fit)
    if topk > num_experts:
        raise ConfigError(f"--moe-router-topk {topk} is more than --num-experts {num_experts}")
    hidden = config["hidden_size"]
    gen = torch.Generator().manual_seed(seed)
    std = float(config.get("init_method_std") or 0.02)
    out: dict[str, torch.Tensor] = {}
    for name, t in dense.items():
        parts = name.split(".")
        if not (len(parts) > 3 and parts[0] == "blocks" and parts[2] == "mlp"
                and which[int(parts[1])]):
            out[name] = t
            continue
        block = f"blocks.{parts[1]}.mlp.experts."
        if parts[3] == "fc":  # (2, F, C) for SwiGLU ([gate; up]), (F, C) for GELU
            w = t.reshape(-1, hidden)
            out[block + "router.weight"] = torch.randn(num_experts, hidden, generator=gen) * std
            out[block + "fc"] = w.unsqueeze(0).expand(num_experts, *w.shape)
        elif parts[3] == "proj" and parts[-1] == "weight":
            out[block + "proj"] = t.unsqueeze(0).expand(num_experts, *t.shape)
        else:
            raise CheckpointError(f"{name}: not a dense MLP's weight this script knows")
    return out, moe_config


def _flag_words(flags: dict) -> str:
    return " ".join(f"--{k.replace('_', '-')} {v}" for k, v in flags.items())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoint", help="the dense checkpoint: an iter_* directory, or a "
                                       "--save directory (its newest)")
    ap.add_argument("save_dir")
    ap.add_argument("--num-experts", type=int, required=True)
    ap.add_argument("--moe-router-topk", type=int, default=2)
    ap.add_argument("--moe-layer-freq", default="1",
                    help="which layers become MoE, as pretrain_gpt.py's flag")
    ap.add_argument("--seed", type=int, default=1234, help="the routers' draw")
    a = ap.parse_args(argv)
    if a.num_experts < 1:
        print("upcycle_checkpoint.py: error: --num-experts must be at least 1",
              file=sys.stderr)
        return 2
    try:
        ckpt = resolve_checkpoint(a.checkpoint)
        meta, params = iter_full_params(ckpt, ("master",))  # one parameter at a time
        dense = {n: s["master"] for n, s in params}
        model, config = upcycle(dense, meta["config"], a.num_experts, a.moe_router_topk,
                                a.moe_layer_freq, a.seed)
        out = write_unsharded_checkpoint(a.save_dir, model, config, meta["vocab_size"])
    except (CheckpointError, ConfigError) as e:
        print(f"upcycle_checkpoint.py: error: {e}", file=sys.stderr)
        return 2
    flags = {"num_experts": a.num_experts, "moe_router_topk": a.moe_router_topk,
             "moe_layer_freq": a.moe_layer_freq}
    print(f"wrote {out}; train it with --load {a.save_dir} and the dense run's flags plus "
          f"{_flag_words(flags)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
