"""Megatron-LM's legacy ``torch`` checkpoints (``iter_NNNNNNN/mp_rank_XX/model_optim_rng.pt``,
one file per TP rank at PP 1) read in: :class:`LegacyCheckpoint`."""

from __future__ import annotations

import glob
import os
import re

import torch

from hybrid.checkpoint.peers import megatron_names as names
from hybrid.checkpoint.peers.megatron_args import arg, megatron_flags, tokenizer_vocab
from hybrid.checkpoint.peers.megatron_dist import MegatronCheckpoint
from hybrid.checkpoint.peers.megatron_files import (
    LEGACY,
    LEGACY_FILE,
    MOMENTS,
    load_megatron_file,
)
from hybrid.errors import CheckpointError


class LegacyCheckpoint(MegatronCheckpoint):
    """One iteration of Megatron-LM's legacy ``torch`` format opened for reading:
    ``mp_rank_XX/model_optim_rng.pt`` per TP rank (memory-mapped), each holding its
    rank's pieces of the model's state dict and the optimizer's plain (torch) state
    dict, whose parameter numbers follow the optimizer's param groups: within each
    group (told apart by ``wd_mult``, or the weight decay), the model's parameters in
    their order, weight-decayed unless 1-D or a bias (Megatron-LM's rule)."""

    format = LEGACY

    def __init__(self, iter_dir: str):  # noqa: PLR0915 -- (one pass over the files)
        self.path = iter_dir
        paths = sorted(glob.glob(os.path.join(glob.escape(iter_dir), "mp_rank_*", LEGACY_FILE)))
        if any(not re.fullmatch(r"mp_rank_\d\d", os.path.basename(os.path.dirname(p)))
               for p in paths):
            raise CheckpointError(f"{paths[-1]}: a pipeline-parallel legacy checkpoint "
                                  f"(mp_rank_TT_PPP), which hybrid does not read")
        self.ranks = [load_megatron_file(p) for p in paths]
        self.paths = paths
        first = self.ranks[0]
        version = first.get("checkpoint_version", 0)  # (Megatron-LM's default when absent)
        if not isinstance(version, (int, float)) or not 2 <= version <= 3:
            # (before 2.0 the QKV rows were laid out otherwise; after 3.0, unknown)
            raise CheckpointError(f"{paths[0]}: checkpoint_version {version!r}; hybrid "
                                  f"reads Megatron-LM's legacy checkpoints of version 2.0 "
                                  f"to 3.0 (tested: 3.0)")
        self.args = first.get("args")
        tp = arg(self.args, "tensor_model_parallel_size", len(paths))
        if tp != len(paths):
            raise CheckpointError(f"{iter_dir}: {len(paths)} mp_rank_* files, its args say "
                                  f"tensor_model_parallel_size {tp}")
        self.iteration = int(first.get("iteration", 0) or 0)
        for p, sd in zip(paths, self.ranks):
            if int(sd.get("iteration", -1)) != self.iteration:
                raise CheckpointError(f"{p}: iteration {sd.get('iteration')}, "
                                      f"{paths[0]}'s is {self.iteration}: files of two saves")
        self.consumed_samples = int(arg(self.args, "consumed_train_samples", 0) or 0)
        self.notes = []
        self.swiglu = bool(arg(self.args, "swiglu", False))
        self.flags = megatron_flags(self.args)
        self.vocab_size = tokenizer_vocab(self.args)
        model = first.get("model")
        if not isinstance(model, dict):
            raise CheckpointError(f"{paths[0]}: no model state dict")
        self._megatron: dict[str, str] = {}  # hybrid name -> Megatron's
        self.shapes = {}
        for key, t in model.items():
            if not isinstance(t, torch.Tensor):
                continue  # (the linears' _extra_state)
            part = self._hybrid(key, paths[0])
            self._megatron[part] = key
            self.shapes[part] = list(self._merged(part, "model", key).shape)
        self._opt_ids = self._optimizer_ids(first.get("optimizer"), list(self._megatron))
        self.columns = ("master", "exp_avg", "exp_avg_sq") if self._opt_ids else ("master",)
        self.step = 0
        if self._opt_ids:
            state = self._inner(first)["state"]
            some = state[next(iter(self._opt_ids.values()))]
            self.step = int(some.get("step", self.iteration))
        elif os.path.isfile(os.path.join(os.path.dirname(paths[0]), "distrib_optim.pt")):
            # (Megatron-LM's --use-distributed-optimizer in this format: the moments go to
            # a file of their own, the grad buffers coalesced, which hybrid does not read)
            self.notes.append(f"{os.path.dirname(paths[0])}/distrib_optim.pt: the "
                              f"distributed optimizer's state in the legacy format is not "
                              f"read (save with --ckpt-format torch_dist to carry it): "
                              f"weights only, Adam's moments start at zero")
        else:
            self.notes.append("no optimizer state: Adam's moments start at zero")
        self._scheduler(first.get("opt_param_scheduler"))
        self.notes.append("the RNG states (Python's, NumPy's, torch's and CUDA's per TP "
                          "rank) do not map to hybrid's seeded streams: hybrid seeds them "
                          "from --seed and the iteration")

    @staticmethod
    def _hybrid(key: str, where: str) -> str:
        m = re.fullmatch(r"decoder\.layers\.(\d+)\.(.+)", key)
        part = (names.layer_part(m.group(2)) if m else names.global_part(key))
        if part is None:
            raise CheckpointError(f"{where}: {key} has no place in hybrid's GPT")
        return f"blocks.{m.group(1)}.{part}" if m else part

    @staticmethod
    def _inner(sd: dict) -> dict:
        """The torch optimizer's state dict (a bf16/fp16 run's wrapper holds it under
        ``optimizer``)."""
        opt = sd.get("optimizer") or {}
        return opt.get("optimizer", opt) if "fp32_from_fp16_params" in opt else opt

    def _optimizer_ids(self, opt, order: list[str]) -> dict[str, int]:
        """hybrid name -> the optimizer's number of it (empty: no optimizer state)."""
        if not opt:
            return {}
        inner = self._inner({"optimizer": opt})
        groups = inner.get("param_groups") or []
        if not inner.get("state"):
            return {}
        decayed = {n: not (n.endswith(".bias") or len(self.shapes[n]) == 1) for n in order}
        out: dict[str, int] = {}
        for g in groups:
            wd = g.get("wd_mult", 1.0 if g.get("weight_decay", 0.0) > 0 else 0.0)
            members = [n for n in order if decayed[n] == (wd > 0)]
            if len(members) != len(g["params"]):
                raise CheckpointError(
                    f"{self.paths[0]}: an optimizer param group of {len(g['params'])} "
                    f"parameters where Megatron-LM's rule gives {len(members)}: which state "
                    f"is which parameter cannot be told")
            out.update(zip(members, g["params"]))
        return out

    def _merged(self, name: str, what: str, key) -> torch.Tensor:
        if what == "model":
            shards = [sd["model"][key] for sd in self.ranks]
        elif what == "fp32":
            shards = [self._fp32(sd, key) for sd in self.ranks]
        else:
            shards = [self._inner(sd)["state"][key][what] for sd in self.ranks]
        return names.merge_tp(name, [t.float() for t in shards], self.swiglu)

    def _fp32(self, sd: dict, pid: int) -> torch.Tensor:
        """A bf16/fp16 run's fp32 master of optimizer parameter ``pid``."""
        inner, masters = self._inner(sd), sd["optimizer"]["fp32_from_fp16_params"]
        for g, group in enumerate(inner["param_groups"]):
            if pid in group["params"]:
                return masters[g][group["params"].index(pid)]
        raise KeyError(pid)

    def read(self, name: str) -> dict[str, torch.Tensor]:
        opt = self.ranks[0].get("optimizer") or {}
        if name in self._opt_ids and "fp32_from_fp16_params" in opt:
            out = {"master": self._merged(name, "fp32", self._opt_ids[name])}
        else:
            out = {"master": self._merged(name, "model", self._megatron[name])}
        if len(self.columns) > 1:
            for m in MOMENTS:
                out[m] = self._merged(name, m, self._opt_ids[name])
        return out

    def close(self) -> None:
        self.ranks = []  # (the mapped files go with their tensors)
