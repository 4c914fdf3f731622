"""The way back to torchtitan: a hybrid checkpoint written as torch DCP in torchtitan's
structure (:func:`write`), under the names and layouts :mod:`.dcp` reads (its ``TOP`` and
``LAYER`` tables, RoPE rows back to complex pairs)."""

from __future__ import annotations

import os
import re
import shutil
import warnings
from typing import Any

import torch

from hybrid.checkpoint.peers.dcp import LAYER, TOP, _next_lr, halves_to_interleaved
from hybrid.checkpoint.peers.spill import Spill
from hybrid.errors import CheckpointError
from hybrid.hf.llama import _qkv_to_hf


def _torchtitan_state(name: str, value: torch.Tensor, heads: int, groups: int
                      ) -> list[tuple[str, torch.Tensor]]:
    """hybrid parameter ``name``'s full tensor -> [(torchtitan name, tensor)]."""
    m = re.fullmatch(r"blocks\.(\d+)\.(.+)", name)
    if m is None:
        if name not in TOP:
            raise CheckpointError(f"{name}: no torchtitan Llama counterpart")
        return [(TOP[name][0], value)]
    i, rest = m.groups()
    if rest not in LAYER:
        raise CheckpointError(f"{name}: no torchtitan Llama counterpart (a bias, an expert, "
                              f"a q/k norm: torchtitan's Llama3 has none)")
    dst = [f"layers.{i}.{t}" for t in LAYER[rest]]
    if rest == "attn.qkv.weight":
        q, k, v = _qkv_to_hf(value, groups, heads)
        return list(zip(dst, (halves_to_interleaved(q, heads), halves_to_interleaved(k, groups),
                              v.contiguous()), strict=True))
    if rest == "mlp.fc.weight":
        return [(dst[0], value[0].contiguous()), (dst[1], value[1].contiguous())]
    return [(dst[0], value)]


def _titan_entries(params, spill: Spill, group: dict, weight_decay: float, groups: str,
                   heads: int, kv: int, vocab: int | None, step: int
                   ) -> tuple[dict[str, torch.Tensor], dict, bool]:
    """(the model's entries, the optimizer's flat entries, whether moments were saved)
    of torchtitan's state dict, from ``params`` (:func:`~hybrid.checkpoint.iter_full_params`'
    iterator), each tensor parked in ``spill``: the weights under torchtitan's names
    (hybrid's vocabulary padding rows dropped), each parameter's group settings (``group``
    with weight decay on the matrices only, or on all for ``groups`` "one") and its
    moments and step."""
    model: dict[str, torch.Tensor] = {}
    optim: dict = {}
    with_moments = False
    for name, cols in params:
        with_moments = "exp_avg" in cols
        for col, full in cols.items():
            # hybrid's padding rows past the vocabulary are not the model's
            cut = full[:vocab] if name in ("wte.weight", "output_layer.weight") and vocab \
                else full
            for tt, part in _torchtitan_state(name, cut, heads, kv):
                t = spill.keep(part)
                if col != "master":
                    optim[f"state.{tt}.{col}"] = t
                    continue
                model[tt] = t
                decay = weight_decay if t.ndim >= 2 or groups == "one" else 0.0
                for key, v in (group | {"weight_decay": decay, "param_names": tt}).items():
                    optim[f"param_groups.{tt}.{key}"] = v
                if with_moments:
                    optim[f"state.{tt}.step"] = torch.tensor(float(step))
    return model, optim, with_moments


def write(ckpt: str, out_dir: str, lr: float | None = None, groups: str = "matrices") -> dict:
    """Write hybrid checkpoint ``ckpt`` (an ``iter_N`` directory) as torchtitan's
    ``out_dir/step-N/`` DCP checkpoint (one writer; DCP reshards it at load to any FSDP2
    / TP layout): the model's FQNs, the optimizer's flat state (both moments, the step,
    each parameter's group hyperparameters), ``lr_scheduler`` (a LambdaLR's state at
    the iteration, one base rate per group), ``train_state``. No ``dataloader`` entry:
    load with ``checkpoint.exclude_from_loading = ["dataloader"]``.

    ``lr``: the learning rate the optimizer holds (default: hybrid's schedule's for the
    next step). ``groups``: the param groups of the optimizer that will load it, which
    torch's ``set_optimizer_state_dict`` holds to one value per group: "matrices" (two
    groups, weight decay on the matrices only: hybrid's rule, what continues hybrid's
    run exactly) or "one" (one group, weight decay on every parameter: torchtitan's
    default). Returns a summary. DCP writes one state dict of the whole model: its
    tensors are mapped files in a scratch directory beside ``out_dir``'s checkpoint
    (:class:`~hybrid.checkpoint.peers.spill.Spill`), so memory holds about one
    parameter."""
    if groups not in ("matrices", "one"):
        raise ValueError(f"groups {groups!r}: 'matrices' or 'one'")
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from hybrid.checkpoint import iter_full_params
    from hybrid.config.architecture import architecture_fields, is_llama

    meta, params = iter_full_params(ckpt)
    c = meta["config"]
    f = architecture_fields(c)
    missing = is_llama(f)
    if missing or f["add_bias_linear"] or f["add_qkv_bias"] or f["qk_layernorm"]:
        raise CheckpointError(f"{ckpt}: torchtitan's Llama3 is a Llama without biases or q/k "
                              f"norms; this checkpoint's model is not "
                              f"({', '.join(missing) or 'biases or q/k norms'})")
    heads = c["num_attention_heads"]
    kv = f["num_query_groups"] or heads
    iteration, step = int(meta["iteration"]), int(meta.get("step", meta["iteration"]))
    if lr is None:
        lr = _next_lr(c, iteration, int(meta.get("consumed_samples", 0)))
    group = {"lr": lr, "betas": (c.get("adam_beta1", 0.9), c.get("adam_beta2", 0.999)),
             "eps": c.get("adam_eps", 1e-8), "amsgrad": False, "maximize": False,
             "foreach": False, "capturable": False, "differentiable": False, "fused": None,
             "decoupled_weight_decay": True, "initial_lr": lr}
    path = os.path.join(out_dir, f"step-{iteration}")
    if os.path.exists(path):
        raise CheckpointError(f"{path}: already exists; not overwriting it")
    # (the state dict dcp.save takes is the whole model's: its tensors are mapped files)
    try:
        spill = Spill(os.path.join(out_dir, f".scratch_step-{iteration}"))
    except OSError as e:
        raise CheckpointError(f"{path}: cannot write ({e})") from e
    try:
        model, optim, with_moments = _titan_entries(
            params, spill, group, float(c.get("weight_decay", 0.01)), groups, heads, kv,
            meta.get("vocab_size"), step)
    except OSError as e:  # (the scratch files on a full disk)
        spill.close()
        raise CheckpointError(f"{path}: cannot write ({e})") from e
    except BaseException:  # (a parameter torchtitan has no name for)
        spill.close()
        raise
    groups_lrs = [lr] * (2 if groups == "matrices" else 1)
    state: dict[str, Any] = dict(model)
    state["optimizer"] = optim
    state["lr_scheduler"] = {"base_lrs": groups_lrs, "last_epoch": iteration,
                             "_step_count": iteration + 1, "_is_initial": False,
                             "_get_lr_called_within_step": False, "_last_lr": groups_lrs,
                             "lr_lambdas": [None] * len(groups_lrs)}
    state["train_state"] = {"step": iteration,
                            "ntokens_seen": int(meta.get("consumed_samples", 0))
                            * int(c.get("seq_length", 0))}
    tmp = os.path.join(out_dir, f".tmp_step-{iteration}")
    try:
        os.makedirs(tmp, exist_ok=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save(state, checkpoint_id=tmp, no_dist=True)
        os.replace(tmp, path)
    except (OSError, CheckpointException) as e:  # (dcp.save wraps its writer's errors)
        shutil.rmtree(tmp, ignore_errors=True)
        why = e if isinstance(e, OSError) else next(iter(e.failures.values()))[0]
        raise CheckpointError(f"{path}: cannot write ({why})") from None
    finally:
        spill.close()  # (its files unlinked; their space is freed as the tensors go)
    return {"path": path, "step": iteration, "tensors": len(model),
            "optimizer": with_moments, "heads": heads, "query_groups": kv, "lr": lr,
            "param_groups": groups}
