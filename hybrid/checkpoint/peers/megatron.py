"""Megatron-LM's ``torch_dist`` checkpoints (its default format): read in, written back;
its legacy ``torch`` format read in (:class:`LegacyCheckpoint`).

A Megatron-LM save directory holds ``latest_checkpointed_iteration.txt`` and one
``iter_NNNNNNN/`` per save, written by ``megatron.core.dist_checkpointing.save``:
``metadata.json`` (``{"sharded_backend": "torch_dist", ...}``), ``common.pt`` (what
every rank shares: ``args``, ``iteration``, ``opt_param_scheduler``, the optimizer's
param groups and step) and torch DCP's ``.metadata`` and ``__R_I.distcp`` files, which
hold each ShardedTensor's chunks at their place in the full tensor (the layers stacked
on a first axis of ``num_layers``). :func:`open` reads it on one process: the DCP
metadata give each tensor's full shape and where each chunk's bytes are; one hybrid
parameter's chunks are read at a time (the layer's slice of a stacked tensor only).

What comes over: the weights (``hybrid.checkpoint.peers.megatron_names``), the fp32
masters (a bf16/fp16 run's ``optimizer.state.fp32_param``; an fp32 run's weights are its
masters), Adam's moments (``optimizer.state.exp_avg`` / ``exp_avg_sq``, the
non-distributed optimizer's and the distributed one's ``fully_sharded_model_space``
layout), the iteration, ``args.consumed_train_samples`` and the optimizer's step count.
The scheduler's position is the iteration (hybrid's schedule is a function of it);
what does not map is a line in ``notes``.

:func:`write` is the way back: a hybrid checkpoint as an ``iter_NNNNNNN/`` that
megatron-core's ``dist_checkpointing.load`` reads into a GPTModel and its (non-
distributed) optimizer at any TP, one parameter in memory at a time.
"""

from __future__ import annotations

import argparse
import builtins
import glob
import io
import json
import os
import pickle
import re
import shutil
from typing import Any

import torch

from hybrid.checkpoint.peers import megatron_names as names
from hybrid.errors import CheckpointError

FORMAT = "Megatron-LM torch_dist"
LATEST = "latest_checkpointed_iteration.txt"
COMMON = "common.pt"
DCP_METADATA = ".metadata"
LEGACY_FILE = "model_optim_rng.pt"
LEGACY = "Megatron-LM torch (legacy)"
_MASTER_KEYS = ("optimizer.state.fp32_param.", "optimizer.state.param.")
_MOMENTS = ("exp_avg", "exp_avg_sq")


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
    next to it, or the iteration's own files. A bounded number of stats and globs."""
    if is_iteration_dir(path) and os.path.isfile(os.path.join(path, "metadata.json")):
        return True
    if is_legacy_dir(path):
        return True
    if not os.path.isfile(os.path.join(path, LATEST)):
        return False
    here = glob.escape(path)
    return bool(glob.glob(os.path.join(here, "iter_*", COMMON))
                or glob.glob(os.path.join(here, "iter_*", "mp_rank_*", LEGACY_FILE)))


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


class _Stub:
    """What a class of the peer's own (an enum of ``args``) unpickles as here."""

    def __init__(self, *a, **k):
        self.args = a

    def __setstate__(self, state):
        self.state = state


def _allowed(module: str, name: str) -> bool:
    """The classes and functions a Megatron-LM torch file needs that are data, not code
    to run: containers, ``argparse.Namespace``, torch's tensor and storage rebuilding,
    dtypes and sizes, NumPy's arrays (its RNG state)."""
    if module == "builtins":
        return name in ("set", "frozenset", "slice", "complex", "bytearray", "range", "dict",
                        "list", "tuple", "int", "float", "bool", "str", "bytes")
    if (module, name) in (("collections", "OrderedDict"), ("argparse", "Namespace"),
                          ("_codecs", "encode"), ("torch", "Size"), ("torch", "device"),
                          ("torch._tensor", "_rebuild_from_type_v2"),
                          ("torch.nn.parameter", "Parameter")):
        return True
    if module == "torch._utils":
        return name.startswith("_rebuild_")
    if module == "torch":
        return name.endswith("Storage") or isinstance(getattr(torch, name, None), torch.dtype)
    if module in ("numpy.core.multiarray", "numpy._core.multiarray"):
        return name in ("_reconstruct", "scalar")
    return (module, name) in (("numpy", "ndarray"), ("numpy", "dtype")) or (
        module == "numpy.dtypes" and name.endswith("DType"))


class _StubUnpickler(pickle.Unpickler):
    """What :func:`_allowed` names as itself; any other class or function (a megatron
    enum in ``args``) as :class:`_Stub`, so nothing of the peer is imported or run."""

    def find_class(self, module, name):
        return super().find_class(module, name) if _allowed(module, name) else _Stub


class _StubPickle:
    Unpickler = _StubUnpickler
    load = pickle.load
    __name__ = "pickle"


def load_common(iter_dir: str) -> dict:
    """``common.pt`` (:func:`load_megatron_file`)."""
    return load_megatron_file(os.path.join(iter_dir, COMMON))


def load_megatron_file(path: str) -> dict:
    """One of Megatron-LM's torch files (``common.pt``, a legacy ``model_optim_rng.pt``,
    its tensors memory-mapped): torch.load of plain values and ``argparse.Namespace``; a
    Megatron-LM ``args`` holding classes of its own (its enums) or NumPy's RNG state is
    read with :class:`_StubUnpickler`, never importing the peer. CheckpointError naming
    the file otherwise."""
    try:
        with torch.serialization.safe_globals([argparse.Namespace]):
            out = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError:
        try:
            out = torch.load(path, map_location="cpu", weights_only=False, mmap=True,
                             pickle_module=_StubPickle)
        except Exception as e:  # noqa: BLE001 -- any unpickling failure is a bad file
            raise CheckpointError(f"{path}: not a readable Megatron-LM torch file "
                                  f"({type(e).__name__}: {e})") from e
    except (OSError, RuntimeError, EOFError) as e:
        raise CheckpointError(f"{path}: missing, truncated or not a torch file "
                              f"({type(e).__name__}: {e})") from e
    if not isinstance(out, dict):
        raise CheckpointError(f"{path}: not a Megatron-LM state dict (a "
                              f"{type(out).__name__})")
    return out


class DcpFiles:
    """One DCP directory's tensors, read chunk by chunk on one process: ``shape(key)``
    and ``read(key, layer)`` (the whole tensor, or its slice ``layer`` of the first
    axis). Errors name the file."""

    def __init__(self, iter_dir: str):
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata
        self.dir = iter_dir
        where = os.path.join(iter_dir, DCP_METADATA)
        try:
            md = FileSystemReader(iter_dir).read_metadata()
        except Exception as e:  # noqa: BLE001 -- a pickle of DCP's classes, or not
            raise CheckpointError(f"{where}: missing, truncated or not torch DCP metadata "
                                  f"({type(e).__name__}: {e})") from e
        self.tensors = {k: v for k, v in md.state_dict_metadata.items()
                        if isinstance(v, TensorStorageMetadata)}
        self.storage = md.storage_data
        self._check_files()

    def _check_files(self) -> None:
        """Every data file is there and long enough for what the metadata put in it
        (one stat per file): a truncated or missing one is named before anything is
        read."""
        need: dict[str, int] = {}
        for info in self.storage.values():
            if getattr(info, "transform_descriptors", None):
                raise CheckpointError(f"{os.path.join(self.dir, info.relative_path)}: "
                                      f"compressed or transformed chunks, which hybrid "
                                      f"does not read")
            end = info.offset + info.length
            need[info.relative_path] = max(need.get(info.relative_path, 0), end)
        for rel, end in sorted(need.items()):
            path = os.path.join(self.dir, rel)
            try:
                size = os.path.getsize(path)
            except OSError as e:
                raise CheckpointError(f"{path}: missing ({e})") from e
            if size < end:
                raise CheckpointError(f"{path}: truncated ({size} bytes, the checkpoint's "
                                      f"metadata has data up to byte {end})")

    def shape(self, key: str) -> list[int]:
        return list(self.tensors[key].size)

    def read(self, key: str, layer: int | None = None) -> torch.Tensor:
        """The full fp32 tensor ``key`` (or its ``[layer]`` slice)."""
        from torch.distributed.checkpoint.metadata import MetadataIndex
        md = self.tensors[key]
        full = list(md.size)
        want = full[1:] if layer is not None else full
        out = torch.empty(want, dtype=torch.float32)
        covered = 0
        for chunk in md.chunks:
            off, size = list(chunk.offsets), list(chunk.sizes)
            if layer is not None and not off[0] <= layer < off[0] + size[0]:
                continue  # (another layer's chunk)
            info = self.storage[MetadataIndex(key, chunk.offsets)]
            t = self._chunk(key, info, size)
            if layer is not None:
                t, off = t[layer - off[0]], off[1:]
            dst = out
            for d, (o, n) in enumerate(zip(off, t.shape)):
                dst = dst.narrow(d, o, n)
            dst.copy_(t)
            covered += t.numel()
        if covered != out.numel():
            raise CheckpointError(f"{os.path.join(self.dir, DCP_METADATA)}: {key}'s chunks "
                                  f"cover {covered} of its {out.numel()} values")
        return out

    def _chunk(self, key: str, info, size: list[int]) -> torch.Tensor:
        path = os.path.join(self.dir, info.relative_path)
        try:
            with builtins.open(path, "rb") as f:
                f.seek(info.offset)
                data = f.read(info.length)
            if len(data) != info.length:
                raise EOFError(f"{len(data)} of {info.length} bytes")
            t = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 -- OSError, EOF, a bad pickle: the file's
            raise CheckpointError(f"{path}: {key}: truncated or corrupt chunk "
                                  f"({type(e).__name__}: {e})") from e
        if not isinstance(t, torch.Tensor) or list(t.shape) != size:
            raise CheckpointError(f"{path}: {key}: a chunk of shape "
                                  f"{list(getattr(t, 'shape', []))}, the metadata says {size}")
        return t.float()


def _arg(args: Any, name: str, default=None):
    return getattr(args, name, default) if args is not None else default


def _flags(args: Any) -> dict:
    """hybrid's architecture flags for Megatron-LM's ``args`` (the ones it records)."""
    if args is None:
        return {}
    out: dict[str, Any] = {}
    for mine, theirs in (("num_layers", "num_layers"), ("hidden_size", "hidden_size"),
                         ("num_attention_heads", "num_attention_heads"),
                         ("ffn_hidden_size", "ffn_hidden_size"),
                         ("normalization", "normalization"), ("swiglu", "swiglu"),
                         ("position_embedding_type", "position_embedding_type"),
                         ("untie_embeddings_and_output_weights",
                          "untie_embeddings_and_output_weights"),
                         ("qk_layernorm", "qk_layernorm")):
        v = _arg(args, theirs)
        if v is not None:
            out[mine] = v
    if _arg(args, "add_bias_linear") is not None:
        out["disable_bias_linear"] = not args.add_bias_linear
        # (biases on q, k and v alone: with every linear's, Megatron's qkv has one anyway)
        out["add_qkv_bias"] = bool(_arg(args, "add_qkv_bias")) and not args.add_bias_linear
    if _arg(args, "group_query_attention"):
        out["group_query_attention"] = True
        out["num_query_groups"] = args.num_query_groups
    return out


class MegatronCheckpoint:
    """One ``torch_dist`` iteration opened for reading (:class:`~.base.PeerCheckpoint`)."""

    format = FORMAT

    def __init__(self, iter_dir: str):
        self.path = iter_dir
        meta_path = os.path.join(iter_dir, "metadata.json")
        try:
            with builtins.open(meta_path, encoding="utf-8") as f:
                meta = json.loads(f.read(1 << 16))
        except (OSError, ValueError) as e:
            raise CheckpointError(f"{meta_path}: missing or not JSON ({e}); not a "
                                  f"Megatron-LM torch_dist iteration") from e
        backend, version = meta.get("sharded_backend"), meta.get("sharded_backend_version")
        if backend != "torch_dist" or version != 1:
            raise CheckpointError(f"{meta_path}: sharded_backend {backend!r} version "
                                  f"{version!r}; hybrid reads Megatron's torch_dist "
                                  f"version 1 only")
        common = load_common(iter_dir)
        self.args = common.get("args")
        self.files = DcpFiles(iter_dir)
        self.iteration = int(common.get("iteration", _arg(self.args, "iteration", 0)) or 0)
        self.consumed_samples = int(_arg(self.args, "consumed_train_samples", 0) or 0)
        self.notes: list[str] = []
        if _arg(self.args, "consumed_train_samples") is None:
            self.notes.append("no args.consumed_train_samples: the data position starts at 0")
        self.swiglu = bool(_arg(self.args, "swiglu", False))
        self.flags = _flags(self.args)
        self.vocab_size = _arg(self.args, "vocab_size")
        self._keys: dict[str, tuple[str, int | None]] = {}  # hybrid name -> (key, layer)
        self.shapes = self._map(os.path.join(iter_dir, DCP_METADATA))
        if "swiglu" not in self.flags and any(n.endswith("mlp.fc.weight") for n in self.shapes):
            self.notes.append("no args.swiglu: linear_fc1 read as a plain MLP's")
        opt = common.get("optimizer") or {}
        self.columns, self.step = self._optimizer(opt)
        self._scheduler(common.get("opt_param_scheduler"))
        self.notes.append("the RNG states (Python's, NumPy's, torch's and CUDA's per TP "
                          "rank) do not map to hybrid's seeded streams: hybrid seeds them "
                          "from --seed and the iteration")

    def _map(self, where: str) -> dict[str, list[int]]:
        per_layer: dict[int, dict[str, tuple[str, int | None]]] = {}
        head: dict[str, str] = {}
        for key in self.files.tensors:
            if key.startswith(("optimizer.", "rng_state")):
                continue
            if key.startswith(names.LAYERS_PREFIX):
                rest = key[len(names.LAYERS_PREFIX):]
                m = re.match(r"(\d+)\.(.+)", rest)
                places: list[tuple[int, str, int | None]]
                if m:  # one layer's own tensor
                    part = names.layer_part(m.group(2))
                    places = [(int(m.group(1)), key, None)]
                else:  # the layers stacked
                    part = names.layer_part(rest)
                    places = [(i, key, i) for i in range(self.files.shape(key)[0])]
                if part is None:
                    raise CheckpointError(f"{where}: {key} has no place in hybrid's GPT "
                                          f"(hybrid maps {FORMAT}'s dense GPT layers)")
                for i, k, layer in places:
                    per_layer.setdefault(i, {})[part] = (k, layer)
                continue
            part = names.global_part(key)
            if part is None:
                raise CheckpointError(f"{where}: {key} has no place in hybrid's GPT")
            head[part] = key
        shapes: dict[str, list[int]] = {}

        def add(name: str, key: str, layer: int | None) -> None:
            shape = self.files.shape(key)[(1 if layer is not None else 0):]
            if names.is_swiglu_fc(name, self.swiglu):
                shape = [2, shape[0] // 2, *shape[1:]]
            shapes[name], self._keys[name] = shape, (key, layer)
        for part in ("wte.weight", "wpe.weight"):
            if part in head:
                add(part, head[part], None)
        order = {h: j for j, (_, h) in enumerate(names.LAYER)}
        for i in sorted(per_layer):
            for part, (key, layer) in sorted(per_layer[i].items(), key=lambda x: order[x[0]]):
                add(f"blocks.{i}.{part}", key, layer)
        for part in ("ln_f.weight", "ln_f.bias", "output_layer.weight"):
            if part in head:
                add(part, head[part], None)
        if not shapes:
            raise CheckpointError(f"{where}: no model tensors")
        return shapes

    def _optimizer(self, opt: dict) -> tuple[tuple[str, ...], int]:
        keys = set(self.files.tensors)
        if any(k.startswith("optimizer.distributed.") for k in keys):
            raise CheckpointError(
                f"{os.path.join(self.path, DCP_METADATA)}: the distributed optimizer's "
                f"state in its dp_reshardable layout (flat buffers per DP rank), which "
                f"hybrid does not read: save it with --dist-ckpt-optim-fully-reshardable, "
                f"or load with --no-load-optim")
        first = next(iter(self._keys.values()))[0]
        if not all(f"optimizer.state.{m}.{first}" in keys for m in _MOMENTS):
            self.notes.append("no optimizer state: Adam's moments start at zero")
            return ("master",), 0
        state = opt.get("state") or {}
        step = state.get("common_step")  # (the non-distributed optimizer's)
        if step is None:  # the distributed optimizer's: in its param groups
            step = next((g["step"] for g in opt.get("param_groups") or []
                         if isinstance(g, dict) and g.get("step") is not None), None)
        if step is None:
            self.notes.append("no optimizer step count (common_step): Adam's bias correction "
                              "counts from the iteration")
            step = self.iteration
        return ("master", "exp_avg", "exp_avg_sq"), int(step)

    def _scheduler(self, sched: dict | None) -> None:
        if not sched:
            self.notes.append("no opt_param_scheduler: the learning rate follows the run's "
                              "flags at the iteration")
            return
        gbs = _arg(self.args, "global_batch_size")
        if gbs and sched.get("num_steps") != self.iteration * gbs:
            self.notes.append(f"opt_param_scheduler.num_steps {sched.get('num_steps')} is "
                              f"not iteration x global batch ({self.iteration} x {gbs}): "
                              f"hybrid's schedule is a function of the iteration")
        if sched.get("lr_decay_style") != "constant" or sched.get("lr_warmup_steps"):
            self.notes.append("the learning rate: Megatron-LM's iteration k runs at its "
                              "scheduler's rate after k - 1 steps, hybrid's at "
                              "learning_rate(k): with warmup or decay the rates are one "
                              "iteration apart")

    def read(self, name: str) -> dict[str, torch.Tensor]:
        key, layer = self._keys[name]

        def get(k: str) -> torch.Tensor:
            return names.to_hybrid_layout(name, self.files.read(k, layer), self.swiglu)
        master_key = next((p + key for p in _MASTER_KEYS if p + key in self.files.tensors), key)
        out = {"master": get(master_key)}
        if len(self.columns) > 1:
            for m in _MOMENTS:
                out[m] = get(f"optimizer.state.{m}.{key}")
        return out

    def close(self) -> None:
        return None  # (each chunk's file is opened and closed as it is read)


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
        self.args = first.get("args")
        tp = _arg(self.args, "tensor_model_parallel_size", len(paths))
        if tp != len(paths):
            raise CheckpointError(f"{iter_dir}: {len(paths)} mp_rank_* files, its args say "
                                  f"tensor_model_parallel_size {tp}")
        self.iteration = int(first.get("iteration", 0) or 0)
        for p, sd in zip(paths, self.ranks):
            if int(sd.get("iteration", -1)) != self.iteration:
                raise CheckpointError(f"{p}: iteration {sd.get('iteration')}, "
                                      f"{paths[0]}'s is {self.iteration}: files of two saves")
        self.consumed_samples = int(_arg(self.args, "consumed_train_samples", 0) or 0)
        self.notes = []
        self.swiglu = bool(_arg(self.args, "swiglu", False))
        self.flags = _flags(self.args)
        self.vocab_size = _arg(self.args, "vocab_size")
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
            for m in _MOMENTS:
                out[m] = self._merged(name, m, self._opt_ids[name])
        return out

    def close(self) -> None:
        self.ranks = []  # (the mapped files go with their tensors)


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

def _namespace(cfg: dict, meta: dict, tp: int, dp: int, vocab: int, gbs: int) -> Any:
    """Megatron-LM's ``args`` for hybrid's flat config (the fields its
    ``check_checkpoint_args`` and a reader use)."""
    heads = cfg["num_attention_heads"]
    groups = cfg.get("num_query_groups") or heads
    return argparse.Namespace(
        num_layers=cfg["num_layers"], hidden_size=cfg["hidden_size"],
        num_attention_heads=heads, group_query_attention=groups != heads,
        num_query_groups=groups, kv_channels=cfg.get("kv_channels")
        or cfg["hidden_size"] // heads, ffn_hidden_size=cfg.get("ffn_hidden_size"),
        seq_length=cfg.get("seq_length"),
        max_position_embeddings=cfg.get("max_position_embeddings"),
        vocab_size=meta.get("vocab_size"), padded_vocab_size=vocab,
        normalization=cfg.get("normalization", "LayerNorm"),
        norm_epsilon=cfg.get("norm_epsilon") or 1e-5, swiglu=bool(cfg.get("swiglu")),
        position_embedding_type=cfg.get("position_embedding_type", "learned_absolute"),
        add_bias_linear=not cfg.get("disable_bias_linear", False),
        add_qkv_bias=bool(cfg.get("add_qkv_bias")),
        untie_embeddings_and_output_weights=bool(
            cfg.get("untie_embeddings_and_output_weights")),
        qk_layernorm=bool(cfg.get("qk_layernorm")), tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=1, data_parallel_size=dp, world_size=tp * dp,
        micro_batch_size=cfg.get("micro_batch_size"), global_batch_size=gbs,
        lr=cfg.get("lr"), min_lr=cfg.get("min_lr"), weight_decay=cfg.get("weight_decay"),
        adam_beta1=cfg.get("adam_beta1"), adam_beta2=cfg.get("adam_beta2"),
        adam_eps=cfg.get("adam_eps"), clip_grad=cfg.get("clip_grad"), seed=cfg.get("seed"),
        use_distributed_optimizer=False, ckpt_format="torch_dist", fp16=False, bf16=False,
        iteration=meta["iteration"], consumed_train_samples=meta.get("consumed_samples", 0),
        consumed_valid_samples=0)


class _DcpWriter:
    """torch DCP's on-disk format, one chunk at a time: each chunk ``torch.save``d into
    one data file (``__0_0.distcp``) at its place in its full tensor, byte objects
    (megatron-core's ShardedObjects) as they are, and ``.metadata`` at the end."""

    REL = "__0_0.distcp"  # the data file, in the directory

    def __init__(self, out_dir: str, f):
        self.dir, self.rel, self.f = out_dir, self.REL, f
        self.tensors: dict[str, tuple[list[int], list]] = {}
        self.objects: list[str] = []
        self.storage: dict = {}

    def _put(self, index, data: bytes) -> None:
        from torch.distributed.checkpoint.filesystem import _StorageInfo
        offset = self.f.tell()
        self.f.write(data)
        self.storage[index] = _StorageInfo(self.rel, offset, len(data))

    def tensor(self, key: str, full: list[int], offsets: list[int], t: torch.Tensor) -> None:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
        buf = io.BytesIO()
        torch.save(t.detach().float().contiguous().clone(), buf)
        self._put(MetadataIndex(key, torch.Size(offsets)), buf.getvalue())
        self.tensors.setdefault(key, (full, []))[1].append(
            ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=t.shape))

    def obj(self, key: str, value: Any) -> None:
        from torch.distributed.checkpoint.metadata import MetadataIndex
        buf = io.BytesIO()
        torch.save(value, buf)
        self._put(MetadataIndex(key), buf.getvalue())
        self.objects.append(key)

    def close(self) -> None:
        from torch.distributed.checkpoint.metadata import (
            BytesStorageMetadata,
            Metadata,
            TensorProperties,
            TensorStorageMetadata,
        )
        self.f.flush()
        os.fsync(self.f.fileno())
        md: dict = {k: TensorStorageMetadata(TensorProperties(dtype=torch.float32),
                                             torch.Size(full), chunks)
                    for k, (full, chunks) in self.tensors.items()}
        md.update({k: BytesStorageMetadata() for k in self.objects})
        with builtins.open(os.path.join(self.dir, DCP_METADATA), "wb") as f:
            pickle.dump(Metadata(state_dict_metadata=md, storage_data=self.storage), f)


def _write_tensors(w: _DcpWriter, params, num_layers: int, swiglu: bool, ckpt: str) -> bool:
    """Each parameter's columns as torch_dist's keys (the layers stacked, one chunk per
    layer) and the linears' extra state; whether the moments were there."""
    moments = True
    for name, cols in params:
        try:
            layer, key = names.to_megatron(name)
        except KeyError:
            raise CheckpointError(f"{ckpt}: {name} has no place in megatron-core's GPTModel "
                                  f"(hybrid writes its dense GPT layers)") from None
        moments = moments and "exp_avg" in cols
        for col, prefix in (("master", ""), ("exp_avg", "optimizer.state.exp_avg."),
                            ("exp_avg_sq", "optimizer.state.exp_avg_sq.")):
            if col not in cols:
                continue
            t = names.to_megatron_layout(name, cols[col], swiglu)
            if layer is None:
                w.tensor(prefix + key, list(t.shape), [0] * t.dim(), t)
            else:  # the layers stacked on a first axis, one chunk per layer
                w.tensor(prefix + names.LAYERS_PREFIX + key, [num_layers, *t.shape],
                         [layer] + [0] * t.dim(), t.unsqueeze(0))
    for i in range(num_layers):  # the (empty) extra state megatron-core's linears load,
        for lin in names.EXTRA_STATE:  # a list of the rank's objects, as its save writes it
            w.obj(f"{names.LAYERS_PREFIX}{lin}._extra_state/shard_{i}_{num_layers}", [None])
    w.close()
    return moments


def write(hybrid_ckpt: str, out_dir: str, tp: int = 1, dp: int = 1) -> str:
    """A hybrid checkpoint (an ``iter_*`` directory or a ``--save`` directory's newest)
    as Megatron-LM save directory ``out_dir``: ``iter_NNNNNNN/`` in ``torch_dist`` (the
    GPTModel's sharded keys, the layers stacked; the non-distributed optimizer's
    ``optimizer.state.exp_avg.*`` / ``exp_avg_sq.*``, its step and two param groups --
    decayed, and norms and biases undecayed -- in ``common.pt`` with ``args``,
    ``iteration`` and ``opt_param_scheduler``) and ``latest_checkpointed_iteration.txt``.
    ``tp``/``dp``: the layout recorded in ``args`` (the files load at any TP). One
    parameter in memory at a time. Returns the iteration's directory."""
    from hybrid.checkpoint import iter_full_params, resolve_checkpoint
    ckpt = resolve_checkpoint(hybrid_ckpt)
    meta, params = iter_full_params(ckpt)
    cfg = meta.get("config") or {}
    swiglu = bool(cfg.get("swiglu"))
    it = int(meta["iteration"])
    final = os.path.join(out_dir, f"iter_{it:07d}")
    if os.path.exists(final):
        raise CheckpointError(f"{final}: already exists; not overwriting it")
    iter_dir = os.path.join(out_dir, f".tmp_iter_{it:07d}")  # published whole, at the end
    shutil.rmtree(iter_dir, ignore_errors=True)
    os.makedirs(iter_dir)
    shapes = meta["model"]
    num_layers = int(cfg["num_layers"])
    with builtins.open(os.path.join(iter_dir, _DcpWriter.REL), "wb") as f:
        moments = _write_tensors(_DcpWriter(iter_dir, f), params, num_layers, swiglu, ckpt)
    vocab = shapes["wte.weight"][0]
    gbs = int(cfg.get("global_batch_size") or 0)
    lr, min_lr = float(cfg.get("lr") or 0.0), float(cfg.get("min_lr") or 0.0)
    wd = float(cfg.get("weight_decay") or 0.0)
    group = {"lr": lr, "betas": (cfg.get("adam_beta1", 0.9), cfg.get("adam_beta2", 0.999)),
             "eps": cfg.get("adam_eps", 1e-8), "amsgrad": False, "maximize": False,
             "foreach": None, "capturable": False, "differentiable": False, "fused": None,
             "decoupled_weight_decay": True, "lr_mult": 1.0, "is_expert_parallel": False,
             "is_decoupled_lr": False}
    warm = int(cfg.get("lr_warmup_iters") or 0)
    decay = int(cfg.get("lr_decay_iters") or cfg.get("train_iters") or 0)
    common = {
        "args": _namespace(cfg, meta, tp, dp, vocab, gbs), "checkpoint_version": 3.0,
        "iteration": it, "num_floating_point_operations_so_far": 0,
        "optimizer": {"state": {"common_step": torch.tensor(float(meta.get("step") or it))}
                      if moments else {},
                      "param_groups": [{**group, "weight_decay": wd, "wd_mult": 1.0},
                                       {**group, "weight_decay": 0.0, "wd_mult": 0.0}]},
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
    with builtins.open(os.path.join(out_dir, LATEST), "w") as f:
        f.write(str(it))
    return final


__all__ = ["FORMAT", "detect", "open", "write", "MegatronCheckpoint", "is_iteration_dir"]
