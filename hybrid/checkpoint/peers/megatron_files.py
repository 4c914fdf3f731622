"""The files of Megatron-LM's checkpoints, read and written without megatron: its torch
files (``common.pt``, a legacy ``model_optim_rng.pt``) unpickled as data only, and torch
DCP's on-disk format (``.metadata``, ``__R_I.distcp``) read and written chunk by chunk on
one process. Errors name the file."""

from __future__ import annotations

import argparse
import io
import os
import pickle
from typing import Any

import torch

from hybrid.errors import CheckpointError

# the files' names, and the formats' (for messages)
DCP_METADATA = ".metadata"
FORMAT = "Megatron-LM torch_dist"
LATEST = "latest_checkpointed_iteration.txt"
COMMON = "common.pt"
LEGACY_FILE = "model_optim_rng.pt"
LEGACY = "Megatron-LM torch (legacy)"
MOMENTS = ("exp_avg", "exp_avg_sq")


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
        from torch.distributed.checkpoint.metadata import (
            BytesStorageMetadata,
            TensorStorageMetadata,
        )
        self.dir = iter_dir
        where = os.path.join(iter_dir, DCP_METADATA)
        try:
            md = FileSystemReader(iter_dir).read_metadata()
        except Exception as e:  # noqa: BLE001 -- a pickle of DCP's classes, or not
            raise CheckpointError(f"{where}: missing, truncated or not torch DCP metadata "
                                  f"({type(e).__name__}: {e})") from e
        self.tensors = {k: v for k, v in md.state_dict_metadata.items()
                        if isinstance(v, TensorStorageMetadata)}
        self.objects = [k for k, v in md.state_dict_metadata.items()
                        if isinstance(v, BytesStorageMetadata)]
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

    def _pieces(self, key: str, start: int, stop: int) -> list | None:
        """The chunks of 1-D ``key`` that tile ``[start, stop)`` exactly, in order (one
        starts at ``start``, one ends at ``stop``, none straddles either), or None."""
        pieces = sorted(((int(c.offsets[0]), int(c.sizes[0]), c)
                         for c in self.tensors[key].chunks
                         if c.offsets[0] < stop and c.offsets[0] + c.sizes[0] > start),
                        key=lambda x: x[0])
        at = start
        for off, n, _ in pieces:
            if off != at or off + n > stop:
                return None
            at = off + n
        return pieces if at == stop else None

    def tiles(self, key: str, start: int, stop: int) -> bool:
        """Whether the chunks of 1-D ``key`` tile ``[start, stop)`` exactly (metadata
        only)."""
        return self._pieces(key, start, stop) is not None

    def read_flat(self, key: str, start: int, stop: int) -> torch.Tensor:
        """Values ``[start, stop)`` of the 1-D tensor ``key``, from the chunks that tile
        that range (:meth:`tiles` first: CheckpointError otherwise)."""
        from torch.distributed.checkpoint.metadata import MetadataIndex
        pieces = self._pieces(key, start, stop)
        if pieces is None:
            raise CheckpointError(f"{os.path.join(self.dir, DCP_METADATA)}: {key}: no "
                                  f"chunks start at {start} and end at {stop}")
        return torch.cat([self._chunk(key, self.storage[MetadataIndex(key, c.offsets)], [n])
                          for _, n, c in pieces])

    def read_object(self, key: str) -> Any:
        """A byte object (a megatron-core ShardedObject: torch-saved) as data only."""
        from torch.distributed.checkpoint.metadata import MetadataIndex
        return self._load(key, self.storage[MetadataIndex(key)])

    def _load(self, key: str, info) -> Any:
        path = os.path.join(self.dir, info.relative_path)
        try:
            with open(path, "rb") as f:
                f.seek(info.offset)
                data = f.read(info.length)
            if len(data) != info.length:
                raise EOFError(f"{len(data)} of {info.length} bytes")
            return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 -- OSError, EOF, a bad pickle: the file's
            raise CheckpointError(f"{path}: {key}: truncated or corrupt chunk "
                                  f"({type(e).__name__}: {e})") from e

    def _chunk(self, key: str, info, size: list[int]) -> torch.Tensor:
        t = self._load(key, info)
        if not isinstance(t, torch.Tensor) or list(t.shape) != size:
            path = os.path.join(self.dir, info.relative_path)
            raise CheckpointError(f"{path}: {key}: a chunk of shape "
                                  f"{list(getattr(t, 'shape', []))}, the metadata says {size}")
        return t.float()


class DcpWriter:
    """torch DCP's on-disk format, one chunk at a time: each chunk ``torch.save``d into
    one data file (``__0_0.distcp``) at its place in its full tensor, byte objects
    (megatron-core's ShardedObjects) as they are, and ``.metadata`` at the end."""

    REL = "__0_0.distcp"  # the data file, in the directory

    def __init__(self, out_dir: str, f):
        self.dir, self.rel, self.f = out_dir, self.REL, f
        self.tensors: dict[str, tuple[list[int], list]] = {}
        self.objects: list[str] = []
        self.storage: dict = {}
        self.dtypes: dict[str, torch.dtype] = {}

    def _put(self, index, data: bytes) -> None:
        from torch.distributed.checkpoint.filesystem import _StorageInfo
        offset = self.f.tell()
        self.f.write(data)
        self.storage[index] = _StorageInfo(self.rel, offset, len(data))

    def tensor(self, key: str, full: list[int], offsets: list[int], t: torch.Tensor,
               dtype: torch.dtype = torch.float32) -> None:
        """One chunk of ``key`` (full shape ``full``) at ``offsets``, stored in ``dtype``
        (a key's chunks share one)."""
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
        buf = io.BytesIO()
        torch.save(t.detach().to(dtype).contiguous().clone(), buf)
        self._put(MetadataIndex(key, torch.Size(offsets)), buf.getvalue())
        self.dtypes[key] = dtype
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
        md: dict = {k: TensorStorageMetadata(TensorProperties(dtype=self.dtypes[k]),
                                             torch.Size(full), chunks)
                    for k, (full, chunks) in self.tensors.items()}
        md.update({k: BytesStorageMetadata() for k in self.objects})
        with open(os.path.join(self.dir, DCP_METADATA), "wb") as f:
            pickle.dump(Metadata(state_dict_metadata=md, storage_data=self.storage), f)
