"""Megatron-LM's checkpoints: detected, opened (:func:`open`) and written back (:func:`write`).

A Megatron-LM save directory holds ``latest_checkpointed_iteration.txt`` and one
``iter_NNNNNNN/`` per save. In ``torch_dist``, its default format, written by
``megatron.core.dist_checkpointing.save``: ``metadata.json`` (``{"sharded_backend":
"torch_dist", ...}``), ``common.pt`` (``args``, ``iteration``, ``opt_param_scheduler``,
the optimizer's param groups and step) and torch DCP's ``.metadata`` and
``__R_I.distcp`` files holding each tensor's chunks at their place in the full tensor
(the layers stacked on a first axis) -- read by :mod:`.megatron_dist`. In the legacy
``torch`` format, ``mp_rank_XX/model_optim_rng.pt`` per TP rank -- read by
:mod:`.megatron_legacy`. The files themselves: :mod:`.megatron_files`; the names:
:mod:`.megatron_names`.

What comes over: the weights, the fp32 masters (a bf16/fp16 run's; an fp32 run's
weights are its masters), Adam's moments (the non-distributed optimizer's, and the
distributed one's in its default ``dp_reshardable`` buckets or ``fully_reshardable``),
the iteration, ``args.consumed_train_samples`` and the optimizer's step count; the
scheduler's position is the iteration (hybrid's schedule is a function of it); what does
not map is a line in ``notes``.

:func:`write` is the way back: a hybrid checkpoint as a ``torch_dist`` ``iter_NNNNNNN/``
that megatron-core's ``dist_checkpointing.load`` reads into a GPTModel and its optimizer:
the non-distributed one at any TP, or the DistributedOptimizer (its ``dp_reshardable``
buckets laid out for the loading run's TP, PP, layer spec and bucket size, or
``fully_reshardable``: :mod:`.megatron_distopt_export`), one parameter in memory at a
time; a bf16 checkpoint as a ``--bf16`` run's (bf16 weights, its buffer's dtype pair); a
mixture of experts as megatron-core's MoE GPT at EP ``ep`` with its chained dense and
expert optimizers (:mod:`.megatron_moe_export`).
"""

from __future__ import annotations

import argparse
import builtins
import glob
import json
import os
import shutil
from collections.abc import Sequence
from typing import Any

import torch

from hybrid.checkpoint.peers import megatron_names as names
from hybrid.checkpoint.peers.megatron_dist import MegatronCheckpoint
from hybrid.checkpoint.peers.megatron_files import (
    COMMON,
    DCP_METADATA,
    FORMAT,
    LATEST,
    LEGACY_FILE,
    MOMENTS,
    DcpWriter,
)
from hybrid.checkpoint.peers.megatron_legacy import LegacyCheckpoint
from hybrid.errors import CheckpointError


def is_legacy_dir(path: str) -> bool:
    """Whether ``path`` is an iteration of Megatron-LM's legacy ``torch`` format (one
    glob)."""
    return bool(glob.glob(os.path.join(glob.escape(path), "mp_rank_*", LEGACY_FILE)))


def is_iteration_dir(path: str) -> bool:
    """Whether ``path`` is one of Megatron's ``torch_dist`` iterations (two stats)."""
    return (os.path.isfile(os.path.join(path, COMMON))
            or os.path.isfile(os.path.join(path, DCP_METADATA)))


def detect(path: str) -> bool:
    """Whether ``path`` is a Megatron-LM ``torch_dist`` save directory or one of its
    iterations: its ``latest_checkpointed_iteration.txt`` with an ``iter_*/common.pt``
    (or ``release/``'s) next to it, or the iteration's own files. A bounded number of
    stats and globs."""
    if is_iteration_dir(path) and os.path.isfile(os.path.join(path, "metadata.json")):
        return True
    if is_legacy_dir(path):
        return True
    if not os.path.isfile(os.path.join(path, LATEST)):
        return False
    here = glob.escape(path)
    return any(glob.glob(os.path.join(here, it, COMMON))  # (release: a released checkpoint)
               or glob.glob(os.path.join(here, it, "mp_rank_*", LEGACY_FILE))
               for it in ("iter_*", "release"))


def _iteration_dir(path: str, step: int | None) -> str:
    if is_iteration_dir(path) or is_legacy_dir(path):
        return path
    if step is not None:
        return os.path.join(path, f"iter_{step:07d}")
    latest = os.path.join(path, LATEST)
    try:
        with builtins.open(latest, encoding="utf-8", errors="replace") as f:
            text = f.read(64).strip()
    except OSError as e:
        raise CheckpointError(f"{latest}: cannot read it ({e})") from e
    if text == "release":
        return os.path.join(path, "release")
    if not text.isdigit():
        raise CheckpointError(f"{latest}: {text!r} is not an iteration number")
    return os.path.join(path, f"iter_{int(text):07d}")
def open(path: str, step: int | None = None) -> MegatronCheckpoint:  # noqa: A001
    """The iteration ``path`` names (an ``iter_*`` directory), or under a save directory
    the one ``latest_checkpointed_iteration.txt`` names (or ``step``): ``torch_dist``, or
    the legacy ``torch`` format (``mp_rank_XX/model_optim_rng.pt``)."""
    iter_dir = _iteration_dir(path, step)
    if not os.path.isdir(iter_dir):
        raise CheckpointError(f"{iter_dir}: no such Megatron-LM iteration directory")
    if is_legacy_dir(iter_dir) and not is_iteration_dir(iter_dir):
        return LegacyCheckpoint(iter_dir)
    return MegatronCheckpoint(iter_dir)


# -- the way back -------------------------------------------------------------------------

def _namespace(cfg: dict, meta: dict, tp: int, dp: int, vocab: int, gbs: int,
               dist: dict, dtypes: tuple[torch.dtype, torch.dtype], pp: int = 1,
               moe: dict | None = None) -> Any:
    """Megatron-LM's ``args`` for hybrid's flat config (the fields its
    ``check_checkpoint_args`` and a reader use); ``dist``: the distributed optimizer's
    fields; ``dtypes``: the run's grad buffer's (param, grad) dtypes (its ``--bf16``
    and ``--accumulate-allreduce-grads-in-fp32``); ``moe``: an MoE model's fields
    (:func:`~.megatron_moe_export.moe_args`)."""
    heads = cfg["num_attention_heads"]
    groups = cfg.get("num_query_groups") or heads
    eps = cfg.get("norm_epsilon") or 1e-5
    return argparse.Namespace(
        num_layers=cfg["num_layers"], hidden_size=cfg["hidden_size"],
        num_attention_heads=heads, group_query_attention=groups != heads,
        num_query_groups=groups, kv_channels=cfg.get("kv_channels")
        or cfg["hidden_size"] // heads, ffn_hidden_size=cfg.get("ffn_hidden_size"),
        seq_length=cfg.get("seq_length"),
        max_position_embeddings=cfg.get("max_position_embeddings"),
        vocab_size=meta.get("vocab_size"), padded_vocab_size=vocab,
        normalization=cfg.get("normalization", "LayerNorm"),
        # (Megatron-LM 0.16.1's args name it layernorm_epsilon, older ones norm_epsilon)
        norm_epsilon=eps, layernorm_epsilon=eps, swiglu=bool(cfg.get("swiglu")),
        position_embedding_type=cfg.get("position_embedding_type", "learned_absolute"),
        add_bias_linear=not cfg.get("disable_bias_linear", False),
        add_qkv_bias=bool(cfg.get("add_qkv_bias")),
        untie_embeddings_and_output_weights=bool(
            cfg.get("untie_embeddings_and_output_weights")),
        qk_layernorm=bool(cfg.get("qk_layernorm")), tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp, data_parallel_size=dp, world_size=tp * pp * dp,
        micro_batch_size=cfg.get("micro_batch_size"), global_batch_size=gbs,
        lr=cfg.get("lr"), min_lr=cfg.get("min_lr"), weight_decay=cfg.get("weight_decay"),
        adam_beta1=cfg.get("adam_beta1"), adam_beta2=cfg.get("adam_beta2"),
        adam_eps=cfg.get("adam_eps"), clip_grad=cfg.get("clip_grad"), seed=cfg.get("seed"),
        ckpt_format="torch_dist", fp16=False, bf16=dtypes[0] == torch.bfloat16,
        params_dtype=str(dtypes[0]),
        accumulate_allreduce_grads_in_fp32=dtypes != (torch.bfloat16, torch.bfloat16),
        iteration=meta["iteration"], consumed_train_samples=meta.get("consumed_samples", 0),
        consumed_valid_samples=0, **dist, **(moe or {}))

def _write_tensors(w: DcpWriter, params, num_layers: int, swiglu: bool, ckpt: str,
                   opt=None, weights: torch.dtype = torch.float32,
                   chain=lambda name: "", extra: tuple[str, ...] = names.EXTRA_STATE,
                   objects: Sequence[str] = ()) -> bool:
    """Each parameter's columns as torch_dist's keys (the layers stacked, one chunk per
    layer) and the linears' extra state; whether the moments were there. The weights in
    ``weights`` (a bf16 run's: the masters rounded, as megatron-core's step leaves them);
    the optimizer state fp32: the non-distributed optimizer's ``optimizer.state.exp_avg.*``
    keys (and a bf16 run's masters, ``optimizer.state.fp32_param.*``), or ``opt``'s (a
    :mod:`.megatron_distopt_export` layout, handed each parameter). An MoE model's:
    ``chain(name)`` the non-distributed state's chained optimizer prefix, ``extra`` the
    linears with per-layer extra state, ``objects`` the experts' extra state keys
    (:mod:`.megatron_moe_export`)."""
    moments = True
    for name, cols in params:
        try:
            layer, key = names.to_megatron(name)
        except KeyError:
            raise CheckpointError(f"{ckpt}: {name} has no place in megatron-core's GPTModel "
                                  f"(hybrid writes its dense GPT layers)") from None
        moments = moments and "exp_avg" in cols

        def place(prefix: str, t: torch.Tensor, dtype: torch.dtype = torch.float32,
                  layer=layer, key=key, name=name) -> None:
            t = names.to_megatron_layout(name, t, swiglu)
            if layer is None:
                w.tensor(prefix + key, list(t.shape), [0] * t.dim(), t, dtype)
            else:  # the layers stacked on a first axis, one chunk per layer
                w.tensor(prefix + names.LAYERS_PREFIX + key, [num_layers, *t.shape],
                         [layer] + [0] * t.dim(), t.unsqueeze(0), dtype)
        place("", cols["master"], weights)
        if opt is not None:
            if not moments:
                raise CheckpointError(f"{ckpt}: no Adam moments (saved with "
                                      f"--no-save-optim?): the distributed optimizer's "
                                      f"state cannot be written")
            opt.put(w, name, cols, place)
        else:
            if weights != torch.float32:  # (an fp32 run's masters are its weights)
                place(f"{chain(name)}optimizer.state.fp32_param.", cols["master"])
            for m in MOMENTS:
                if m in cols:
                    place(f"{chain(name)}optimizer.state.{m}.", cols[m])
    if opt is not None:
        opt.finish(w)
    for i in range(num_layers):  # the (empty) extra state megatron-core's linears load,
        for lin in extra:  # a list of the rank's objects, as its save writes it
            w.obj(f"{names.LAYERS_PREFIX}{lin}._extra_state/shard_{i}_{num_layers}", [None])
    for key in objects:
        w.obj(key, [None])
    w.close()
    return moments


def _plain_optimizer(cfg: dict, step: int, moments: bool, fp32: bool, moe: bool = False
                     ) -> dict:
    """``common.pt``'s ``optimizer`` for megatron-core's non-distributed optimizer: torch
    AdamW's param groups (megatron-core's two, without the distributed optimizer's
    ``step``) and the step as ``common_step``; an fp32 run's ``FP32Optimizer`` holds them
    at the top, a bf16 run's ``Float16OptimizerWithFloat16Params`` under ``optimizer``
    (its masters, ``fp32_from_fp16_params``, are the ``optimizer.state.fp32_param.*``
    tensors). ``moe``: the chained dense and expert optimizers' (fp32),
    :func:`~.megatron_moe_export.plain_common`."""
    from hybrid.checkpoint.peers import megatron_moe_export
    from hybrid.checkpoint.peers.megatron_distopt_export import param_groups
    groups = param_groups(cfg, step)
    torch_optimizer = {
        "state": {"common_step": torch.tensor(float(step))} if moments else {},
        "param_groups": [{k: v for k, v in g.items() if k != "step"} for g in groups]}
    if moe:
        return megatron_moe_export.plain_common(
            torch_optimizer, megatron_moe_export.expert_groups(groups), moments, step)
    return torch_optimizer if fp32 else {"optimizer": torch_optimizer}


def write(hybrid_ckpt: str, out_dir: str, tp: int = 1, dp: int = 1,
          dist_opt: str | None = None, spec: str = "local",
          bucket_size: int | None = None, dtype: str | None = None, pp: int = 1,
          ep: int = 1, first: int | None = None, last: int | None = None,
          vpp: int | None = None) -> str:
    """A hybrid checkpoint (an ``iter_*`` directory or a ``--save`` directory's newest)
    as Megatron-LM save directory ``out_dir``: ``iter_NNNNNNN/`` in ``torch_dist`` (the
    GPTModel's sharded keys, the layers stacked; ``common.pt`` with ``args``,
    ``iteration``, ``opt_param_scheduler`` and the optimizer's param groups -- decayed,
    and norms and biases undecayed -- and step) and ``latest_checkpointed_iteration.txt``.
    The optimizer state: without ``dist_opt``, the non-distributed optimizer's
    ``optimizer.state.exp_avg.*`` / ``exp_avg_sq.*`` (the files load at any TP; ``tp``
    and ``dp`` are recorded in ``args``); with ``dist_opt`` ``dp_reshardable`` or
    ``fully_reshardable``, megatron-core's DistributedOptimizer's
    (:mod:`.megatron_distopt_export`): dp_reshardable's buckets are laid out for a run
    at TP ``tp``, DP ``dp``, PP ``pp`` (Megatron-LM's even split of the layers, or
    ``first`` / ``last`` layers on the first / last stage and the rest even -- its
    ``--decoder-first/last-pipeline-num-layers``, recorded in ``args`` --: one group of
    buckets per stage and TP rank; with ``vpp`` model chunks a stage, one grad buffer per
    chunk), layer spec ``spec`` (``local`` or
    ``transformer_engine``) and DDP bucket size ``bucket_size`` (None: one bucket,
    Megatron-LM's default without ``--overlap-grad-reduce``); the other layouts do not
    depend on PP (``pp`` is only recorded in ``args``). A bf16 checkpoint (config
    ``bf16``) is written as a Megatron-LM ``--bf16`` run's: bf16 weights, ``args.bf16``,
    its buffer's dtype pair (:func:`~.megatron_names.buffer_dtypes`) -- without
    ``dist_opt``, its
    ``Float16OptimizerWithFloat16Params``' state (:func:`_plain_optimizer`); ``dtype``
    ("fp32" or "bf16") writes for a run of that precision instead. A mixture of experts
    (config ``num_experts``) is written for megatron-core's MoE GPT at EP ``ep``
    (:mod:`.megatron_moe_export`: its chained optimizers; fp32, TP 1, PP 1, the local
    spec, no shared expert, expert bias or grouped GEMM). One parameter in memory
    at a time. Returns the iteration's directory; CheckpointError naming the flag for a
    request it cannot honour, before anything is written."""
    from hybrid.checkpoint import iter_full_params, resolve_checkpoint
    from hybrid.checkpoint.peers import megatron_distopt_export as distopt, megatron_moe_export
    distopt.check(dist_opt, tp, dp, spec, bucket_size)
    if dtype not in (None, "fp32", "bf16"):
        raise CheckpointError(f"--dtype {dtype}: hybrid writes Megatron-LM's fp32 and bf16 "
                              f"runs' files (fp32, bf16)")
    ckpt = resolve_checkpoint(hybrid_ckpt)
    meta, params = iter_full_params(ckpt)
    cfg = meta.get("config") or {}
    swiglu = bool(cfg.get("swiglu"))
    it = int(meta["iteration"])
    step = int(meta.get("step") or it)
    shapes = meta["model"]
    # (a bf16 run's buffer: grads in fp32 unless the run said otherwise, as in Megatron-LM)
    dtypes = names.buffer_dtypes(dtype == "bf16" if dtype else bool(cfg.get("bf16")),
                                 cfg.get("accumulate_allreduce_grads_in_fp32", True) is not False)
    moe = megatron_moe_export.is_moe(cfg)
    if moe:
        megatron_moe_export.check(ckpt, cfg, shapes, tp, pp, ep, dp, dist_opt, spec,
                                  dtypes[0] != torch.float32)
    elif ep != 1:
        raise CheckpointError(f"--expert-model-parallel-size {ep}: {ckpt} has no experts")
    counts = distopt.stage_layers(cfg, pp, first, last, vpp)
    opt = (distopt.layout(dist_opt, shapes, cfg, step, tp, dp, spec, bucket_size, dtypes, pp,
                          counts, ep) if dist_opt else None)
    final = os.path.join(out_dir, f"iter_{it:07d}")
    if os.path.exists(final):
        raise CheckpointError(f"{final}: already exists; not overwriting it")
    iter_dir = os.path.join(out_dir, f".tmp_iter_{it:07d}")  # published whole, at the end
    shutil.rmtree(iter_dir, ignore_errors=True)
    try:  # (a failure leaves nothing: a full disk is one line naming OUT)
        os.makedirs(iter_dir)
        num_layers = int(cfg["num_layers"])
        with builtins.open(os.path.join(iter_dir, DcpWriter.REL), "wb") as f:
            w = DcpWriter(iter_dir, f)
            if moe:  # (the chained optimizers; the experts' own extra state)
                moments = _write_tensors(
                    w, params, num_layers, swiglu, ckpt, opt, dtypes[0],
                    megatron_moe_export.chain, names.EXTRA_STATE[:2],
                    megatron_moe_export.extra_state(num_layers, int(cfg["num_experts"])))
            else:
                moments = _write_tensors(w, params, num_layers, swiglu, ckpt, opt, dtypes[0])
        vocab = shapes["wte.weight"][0]
        gbs = int(cfg.get("global_batch_size") or 0)
        lr, min_lr = float(cfg.get("lr") or 0.0), float(cfg.get("min_lr") or 0.0)
        wd = float(cfg.get("weight_decay") or 0.0)
        warm = int(cfg.get("lr_warmup_iters") or 0)
        decay = int(cfg.get("lr_decay_iters") or cfg.get("train_iters") or 0)
        optimizer = opt.common() if opt is not None else _plain_optimizer(
            cfg, step, moments, fp32=dtypes[0] == torch.float32, moe=moe)
        dist = {"use_distributed_optimizer": bool(dist_opt),
                "dist_ckpt_optim_fully_reshardable": dist_opt == "fully_reshardable",
                "overlap_grad_reduce": bucket_size is not None, "ddp_bucket_size": bucket_size,
                "transformer_impl": spec, "decoder_first_pipeline_num_layers": first,
                "decoder_last_pipeline_num_layers": last,
                "virtual_pipeline_model_parallel_size": vpp}
        common = {
            "args": _namespace(cfg, meta, tp, dp, vocab, gbs, dist, dtypes, pp,
                               megatron_moe_export.moe_args(cfg, shapes, ep) if moe else None),
            "checkpoint_version": 3.0,
            "iteration": it, "num_floating_point_operations_so_far": 0,
            "optimizer": optimizer,
            "opt_param_scheduler": {
                "max_lr": lr, "lr_warmup_steps": warm * gbs, "num_steps": it * gbs,
                "lr_decay_style": cfg.get("lr_decay_style", "linear"),
                "lr_decay_steps": decay * gbs, "min_lr": min_lr, "start_wd": wd, "end_wd": wd,
                "wd_incr_style": "constant", "wd_incr_steps": decay * gbs}}
        torch.save(common, os.path.join(iter_dir, COMMON))
        with builtins.open(os.path.join(iter_dir, "metadata.json"), "w") as f:
            json.dump({"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                       "common_backend": "torch", "common_backend_version": 1}, f)
        os.replace(iter_dir, final)
    except CheckpointError:
        shutil.rmtree(iter_dir, ignore_errors=True)
        raise
    except (OSError, RuntimeError) as e:  # (torch.save's write errors are RuntimeErrors)
        shutil.rmtree(iter_dir, ignore_errors=True)
        raise CheckpointError(f"{out_dir}: cannot write the export ({e})") from e
    with builtins.open(os.path.join(out_dir, LATEST), "w") as f:
        f.write(str(it))
    return final


__all__ = ["FORMAT", "detect", "open", "write", "MegatronCheckpoint", "is_iteration_dir"]
