"""Megatron-LM's ``torch_dist`` iterations read in: :class:`MegatronCheckpoint`.

The DCP metadata give each tensor's full shape and where each chunk's bytes are; one
hybrid parameter's chunks are read at a time (a layer's slice of a stacked tensor only).
The distributed optimizer's default ``dp_reshardable`` state (flat buckets per TP rank)
is mapped to parameters by :class:`_Buckets` (an MoE run's two chained optimizers too:
the dense buffer, and the experts' per EP rank).
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

import torch

from hybrid.checkpoint.peers import megatron_names as names
from hybrid.checkpoint.peers.megatron_args import (
    arg,
    check_run_numbers,
    megatron_flags,
    tokenizer_vocab,
)
from hybrid.checkpoint.peers.megatron_files import (
    COMMON,
    DCP_METADATA,
    FORMAT,
    MOMENTS,
    DcpFiles,
    load_megatron_file,
)
from hybrid.config.stage_split import split_layers
from hybrid.errors import CheckpointError, ConfigError

_MASTER_COLUMNS = ("fp32_param", "param")
# the non-distributed optimizer's per-parameter state: ``optimizer.state.<column>.<key>``,
# or, for an MoE run's chained optimizers (one for the dense parameters, one for the
# experts'), ``chained_<i>.optimizer.state.<column>.<key>``
_STATE_KEY = re.compile(r"(chained_\d+\.)?optimizer\.state\.(fp32_param|param|exp_avg|"
                        r"exp_avg_sq)\.(.+)")
# the distributed optimizer's dp_reshardable state: per TP x PP rank (its DP group's index),
# per grad buffer and dtype, per bucket, one flat tensor of each column
_BUCKETS = "optimizer.distributed."
_PAIRS = tuple(str(p) for p in names.BUFFER_DTYPES)  # (as the keys spell them)
# (an MoE run's chained distributed optimizers, dense and expert, each ``chained_<i>.``)
_BUCKET_KEY = re.compile(r"((?:chained_\d+\.)?)optimizer\.distributed\.dp_group_idx_(\d+)\."
                         r"gbuf_idx_(\d+)\.dtype_(.+)\.bucket_idx_(\d+)\."
                         r"(param|exp_avg|exp_avg_sq)")
_EXPERTS = names.EXPERTS  # (hybrid's stacked experts, per layer)


def load_common(iter_dir: str) -> dict:
    """``common.pt`` (:func:`load_megatron_file`)."""
    return load_megatron_file(os.path.join(iter_dir, COMMON))


class MegatronCheckpoint:
    """One ``torch_dist`` iteration opened for reading (:class:`~.base.PeerCheckpoint`)."""

    format = FORMAT
    frozen_shapes: dict[str, list[int]] = {}  # (a GPT: every parameter trains)
    excludes_frozen = False

    def __init__(self, iter_dir: str):
        self.path = iter_dir
        meta_path = os.path.join(iter_dir, "metadata.json")
        try:
            with open(meta_path, encoding="utf-8") as f:
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
        self.iteration = int(common.get("iteration", arg(self.args, "iteration", 0)) or 0)
        self.consumed_samples = int(arg(self.args, "consumed_train_samples", 0) or 0)
        self.notes: list[str] = []
        if arg(self.args, "consumed_train_samples") is None:
            self.notes.append("no args.consumed_train_samples: the data position starts at 0")
        self.swiglu = bool(arg(self.args, "swiglu", False))
        self.flags = megatron_flags(self.args)
        self.vocab_size = tokenizer_vocab(self.args)
        self._keys: dict[str, tuple[str, int | None]] = {}  # hybrid name -> (key, layer)
        # the non-distributed optimizer's state: (column, model key) -> its tensor's key
        self._state: dict[tuple[str, str], str] = {}
        for key in self.files.tensors:
            m = _STATE_KEY.fullmatch(key)
            if m:
                self._state[(m.group(2), m.group(3))] = key
        self.shapes = self._map(os.path.join(iter_dir, DCP_METADATA))
        if "swiglu" not in self.flags and any(n.endswith("mlp.fc.weight") for n in self.shapes):
            self.notes.append("no args.swiglu: linear_fc1 read as a plain MLP's")
        opt = common.get("optimizer") or {}
        self._buckets: _Buckets | None = None
        self.columns, self.step = self._optimizer(opt)
        self._scheduler(common.get("opt_param_scheduler"))
        self.notes.append("the RNG states (Python's, NumPy's, torch's and CUDA's per TP "
                          "rank) do not map to hybrid's seeded streams: hybrid seeds them "
                          "from --seed and the iteration")

    def _map(self, where: str) -> dict[str, list[int]]:
        per_layer: dict[int, dict[str, tuple[str, int | None]]] = {}
        head: dict[str, str] = {}
        for key in self.files.tensors:
            if (key.startswith(("optimizer.", "rng_state")) or _STATE_KEY.fullmatch(key)
                    or _BUCKET_KEY.fullmatch(key)):
                continue
            if key.startswith("chained_"):
                raise CheckpointError(f"{where}: {key}: a chained optimizer's state hybrid "
                                      f"does not read")
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
        groups = opt.get("param_groups")
        if any(k.startswith(_BUCKETS) or _BUCKET_KEY.fullmatch(k) for k in keys):
            self._buckets = _Buckets(self)
            groups = self._buckets.param_groups
        elif not self._has_moments(keys):
            self.notes.append("no optimizer state: Adam's moments start at zero")
            return ("master",), 0
        if groups is None:  # fully_reshardable's, and a bf16 run's non-distributed optimizer's
            groups = (opt.get("optimizer") or {}).get("param_groups")
        # (the non-distributed optimizer's: FP32Optimizer's at the top, a --bf16 run's
        # Float16OptimizerWithFloat16Params' under its torch optimizer's "optimizer")
        state = opt.get("state") or (opt.get("optimizer") or {}).get("state") or {}
        step = state.get("common_step")
        if (step is None and self._buckets is None and opt
                and all(isinstance(k, int) for k in opt)):
            # an MoE run's chained optimizers (dense, experts): one step, theirs
            steps = {float(o.get("state", {}).get("common_step", -1)) for o in opt.values()
                     if isinstance(o, dict)}
            if len(steps) != 1 or -1 in steps:
                raise CheckpointError(f"{os.path.join(self.path, COMMON)}: the chained "
                                      f"optimizers' common_step {sorted(steps)}: hybrid "
                                      f"reads one step for all parameters")
            step = steps.pop()
            groups = [g for o in opt.values() for g in o.get("param_groups") or []]
        if step is None:  # the distributed optimizer's: in its param groups
            step = next((g["step"] for g in groups or []
                         if isinstance(g, dict) and g.get("step") is not None), None)
        if step is None:
            self.notes.append("no optimizer step count (common_step): Adam's bias correction "
                              "counts from the iteration")
            step = self.iteration
        return ("master", "exp_avg", "exp_avg_sq"), int(step)

    def _has_moments(self, keys: set[str]) -> bool:
        first = next(iter(self._keys.values()))[0]
        return all((m, first) in self._state for m in MOMENTS)

    def _scheduler(self, sched: dict | None) -> None:
        if not sched:
            self.notes.append("no opt_param_scheduler: the learning rate follows the run's "
                              "flags at the iteration")
            return
        gbs = arg(self.args, "global_batch_size")
        if gbs and sched.get("num_steps") != self.iteration * gbs:
            self.notes.append(f"opt_param_scheduler.num_steps {sched.get('num_steps')} is "
                              f"not iteration x global batch ({self.iteration} x {gbs}): "
                              f"hybrid's schedule is a function of the iteration")

    def read(self, name: str) -> dict[str, torch.Tensor]:
        key, layer = self._keys[name]
        if self._buckets is not None:
            return self._buckets.read(name)

        def get(k: str) -> torch.Tensor:
            return names.to_hybrid_layout(name, self.files.read(k, layer), self.swiglu)
        master_key = next((self._state[(c, key)] for c in _MASTER_COLUMNS
                           if (c, key) in self._state), key)
        out = {"master": get(master_key)}
        if len(self.columns) > 1:
            for m in MOMENTS:
                if (m, key) not in self._state:
                    raise CheckpointError(f"{self.path}: no optimizer state {m} of {key}")
                out[m] = get(self._state[(m, key)])
        return out

    def untrained(self) -> dict[str, torch.Tensor]:
        return {}  # (a GPT: no frozen parameter, no persistent buffer)

    def configure(self, config: dict) -> None:
        """The checkpoint records every shape it needs; the numbers of the model its args
        record and hybrid takes from the run's flags must be the run's
        (:func:`check_run_numbers`)."""
        check_run_numbers(self.args, config, self.path)

    def close(self) -> None:
        return None  # (each chunk's file is opened and closed as it is read)


class _Buckets:
    """The distributed optimizer's ``dp_reshardable`` state (Megatron-LM's default with
    ``--use-distributed-optimizer``): for each (PP stage, TP rank) -- ``dp_group_idx_G``,
    G the rank in megatron's model-parallel group, ``stage * TP + TP rank`` -- its
    grad buffer's buckets, each saved as one flat tensor per column (``param``, the fp32
    master; ``exp_avg``; ``exp_avg_sq``) of the bucket's length without its end padding,
    each DP rank's shard of it at its place. The buffer's key names its (param, grad)
    dtype pair: an fp32 run's or a bf16 run's (:data:`~.megatron_names.BUFFER_DTYPES`;
    the columns are fp32 in each, and the layout is the same); another pair, or two, is
    one error naming the key.

    Where a parameter lies is megatron-core's ``_ParamAndGradBuffer`` layout, derived
    by the functions the export writes with (:func:`~.megatron_names.split_stages`,
    :func:`~.megatron_names.stage_buffer`): the stage's parameters on the TP rank (their
    TP-local sizes, from the model's keys; a stage holds its consecutive layers of
    Megatron-LM's split -- ``num_layers / PP``, or the uneven first or last stage's and
    the rest even --, the first the embeddings, the last the final norm and the output
    layer; with virtual stages, V per PP rank, each model chunk of a stage is a grad
    buffer of its own, ``gbuf_idx_v``, over piece ``v x PP + stage`` of the model) in
    the reverse of the GPTModel's parameter order, each starting at a multiple of 64, a
    bucket closing where its saved ``per_bucket_numel_unpadded`` says (tied embeddings at
    PP > 1: the word embeddings and the last stage's copy in buckets of their own). The
    derivation is checked against the files: every parameter's range on every TP rank
    must be exactly tiled by saved chunks (megatron saves each DP rank's piece of each
    parameter, and each gap, as a chunk of its own), for the layer spec
    ``args.transformer_impl`` names or else the other one; neither fitting is one error.
    One parameter's pieces are read at a time."""

    def __init__(self, ckpt: MegatronCheckpoint):
        self.ckpt, self.files = ckpt, ckpt.files
        where = os.path.join(ckpt.path, DCP_METADATA)
        # chain ("", or an MoE run's "chained_<i>.") -> buffer (group x V + chunk) -> bucket
        # -> key prefix
        chains: dict[str, dict[int, dict[int, str]]] = {}
        self.dtypes: set[str] = set()  # the buffers' (param, grad) pairs, as keys spell them
        self.tp = int(arg(ckpt.args, "tensor_model_parallel_size", 1) or 1)
        self.pp = int(arg(ckpt.args, "pipeline_model_parallel_size", 1) or 1)
        # each model piece's parameters; V, the model chunks (virtual stages) per PP rank,
        # each a grad buffer of its own (gbuf_idx_v): a buffer's index is group x V + v
        self.stages, self.vpp = self._stages()
        for key in self.files.tensors:
            m = _BUCKET_KEY.fullmatch(key)
            if m is None:
                if key.startswith(_BUCKETS):
                    raise CheckpointError(f"{where}: {key}: a distributed optimizer key "
                                          f"hybrid does not read")
                continue
            if m.group(4) not in _PAIRS:
                raise CheckpointError(f"{where}: {key}: a grad buffer of dtypes "
                                      f"{m.group(4)}; hybrid reads {', '.join(_PAIRS)}")
            if int(m.group(3)) >= self.vpp:
                raise CheckpointError(f"{where}: {key}: a second grad buffer (another "
                                      f"dtype): hybrid reads one buffer per optimizer "
                                      f"and model chunk")
            chains.setdefault(m.group(1), {}).setdefault(
                int(m.group(2)) * self.vpp + int(m.group(3)), {})[
                int(m.group(5))] = key.rsplit(".", 1)[0]
            self.dtypes.add(m.group(4))
        objects = set(self.files.objects)

        def obj(t: int, what: str, chain: str | None = None) -> Any:
            chain = self.chain if chain is None else chain
            key = next((k for k in objects if k.startswith(
                f"{chain}{_BUCKETS}dp_group_idx_{t}.{what}/")), None)
            if key is None:
                raise CheckpointError(f"{where}: no {chain}{_BUCKETS}dp_group_idx_{t}.{what}")
            value = self.files.read_object(key)
            return value[0] if isinstance(value, list) and len(value) == 1 else value
        self._obj = obj
        # which optimizer holds what: the dense parameters, and an MoE run's experts (the
        # second of megatron-core's chained optimizers, its param groups is_expert_parallel)
        expert: str | None = None
        self.chain = ""
        self.param_groups = None
        for chain in sorted(chains):
            saved = obj(min(chains[chain]) // self.vpp, "optimizer", chain)
            groups = saved.get("param_groups") if isinstance(saved, dict) else None
            if any(isinstance(g, dict) and g.get("is_expert_parallel") for g in groups or []):
                expert = chain
            else:
                self.chain, self.param_groups = chain, groups
        if len(chains) > 2 or (len(chains) == 2 and expert is None):
            raise CheckpointError(f"{where}: distributed optimizers {sorted(chains)}: hybrid "
                                  f"reads one, or an MoE run's dense and expert ones")
        if expert is None and any(n.endswith(_EXPERTS) for n in ckpt.shapes):
            raise CheckpointError(f"{where}: experts without the expert optimizer's state")
        buckets = chains[self.chain]
        tp, pp, vpp = self.tp, self.pp, self.vpp
        if sorted(buckets) != list(range(tp * pp * vpp)):
            chunks = f" x V {vpp}" if vpp > 1 else ""
            raise CheckpointError(f"{where}: the distributed optimizer's state of grad "
                                  f"buffers {sorted(buckets)} (DP group x V + chunk) at TP "
                                  f"{tp} x PP {pp}{chunks}: hybrid reads its dp_reshardable "
                                  f"layout of one group per (PP stage, TP rank), one buffer "
                                  f"per model chunk, {tp * pp * vpp} here")
        if len(self.dtypes) != 1:
            raise CheckpointError(f"{where}: the TP ranks' buffers have dtypes "
                                  f"{sorted(self.dtypes)}: one run saves one pair")
        self.prefixes = {t: [b[i] for i in range(len(b))] for t, b in buckets.items()}
        self.place: dict[str, list[tuple[str, int, int]]] = {}  # name -> per TP rank
        # the last stage's copy of tied word embeddings, per TP rank (PP > 1)
        self.tied_copy: list[tuple[str, int, int]] = []
        specs = ["local", "transformer_engine"]
        if arg(ckpt.args, "transformer_impl") == "transformer_engine":
            specs.reverse()
        for t in range(tp * pp * vpp):
            sizes = self._sizes(self.chain, t // vpp, len(self.prefixes[t]), t % vpp, vpp)
            for spec in specs:
                placed = self._layout(t, sizes, spec)
                if placed is not None:
                    break
            else:
                stage = f"PP stage {t // vpp // tp}, " if pp > 1 else ""
                stage += f"model chunk {t % vpp}, " if vpp > 1 else ""
                raise CheckpointError(
                    f"{where}: the distributed optimizer's buckets of {stage}TP rank "
                    f"{t // vpp % tp} do not "
                    f"hold the model's parameters where megatron-core's buffer layout puts "
                    f"them (in GPTModel's order, 64-aligned, buckets of {sizes}); hybrid "
                    f"reads a dense GPT's dp_reshardable state")
            copy = placed.pop(names.TIED_COPY, None)
            if copy is not None:  # (its state is the first stage's: read there)
                self.tied_copy.append(copy)
            for name, at in placed.items():
                self.place.setdefault(name, []).append(at)
        # name -> per EP rank, per local expert: (bucket key, start, stop)
        self.expert_place: dict[str, list[list[tuple[str, int, int]]]] = {}
        if expert is not None:
            self._experts(expert, chains[expert])

    def _sizes(self, chain: str, t: int, saved: int, chunk: int = 0,
               chunks: int = 1) -> list[int]:
        """Group ``t``'s saved unpadded bucket sizes (of ``saved`` buckets) of its grad
        buffer ``chunk`` (model chunk; of ``chunks``, one buffer each)."""
        where = f"{os.path.join(self.ckpt.path, DCP_METADATA)}: {chain}dp_group_idx_{t}"
        unpadded = self._obj(t, "per_bucket_numel_unpadded", chain)
        counts = (unpadded[chunk] if isinstance(unpadded, list) and len(unpadded) == chunks
                  else None)
        if not isinstance(counts, dict) or len(counts) != 1:
            raise CheckpointError(f"{where}.per_bucket_numel_unpadded {unpadded!r}: hybrid "
                                  f"reads one grad buffer of one dtype")
        if {str(k) for k in counts} != self.dtypes:
            raise CheckpointError(f"{where}.per_bucket_numel_unpadded is of dtypes "
                                  f"{list(counts)}, its buckets' keys of "
                                  f"{sorted(self.dtypes)}")
        sizes = [int(n) for n in next(iter(counts.values()))]
        if len(sizes) != saved:
            raise CheckpointError(f"{where}: {len(sizes)} buckets in "
                                  f"per_bucket_numel_unpadded, {saved} saved")
        return sizes

    def _experts(self, chain: str, groups: dict[int, dict[int, str]]) -> None:
        """An MoE run's expert optimizer (megatron-core's second chained one): one group
        per EP rank (``dp_group_idx_<EP rank>``, at TP 1, PP 1, expert TP 1), its buffer
        holding the rank's local experts -- layer after layer, local expert after local
        expert, ``linear_fc1`` then ``linear_fc2``, each one parameter of its own -- in the
        reverse of that order, laid out as the dense buffer (:func:`~.megatron_names.
        bucket_layout`) and checked against the saved chunks the same way."""
        where = os.path.join(self.ckpt.path, DCP_METADATA)
        args, shapes = self.ckpt.args, self.ckpt.shapes
        ep = int(arg(args, "expert_model_parallel_size", 1) or 1)
        etp = int(arg(args, "expert_tensor_parallel_size", 1) or 1)
        if self.tp != 1 or self.pp != 1 or etp != 1 or sorted(groups) != list(range(ep)):
            raise CheckpointError(
                f"{where}: the expert optimizer's state of groups {sorted(groups)} at TP "
                f"{self.tp}, PP {self.pp}, expert TP {etp}, EP {ep}: hybrid reads its "
                f"dp_reshardable layout at TP 1, PP 1 and expert TP 1, one group per EP rank")
        experts = [n for n in shapes if n.endswith(_EXPERTS)]
        local = shapes[experts[0]][0] // ep
        self.expert_place = {n: [[] for _ in range(ep)] for n in experts}
        for e in range(ep):
            prefixes = [groups[e][b] for b in range(len(groups[e]))]
            sizes = self._sizes(chain, e, len(prefixes))
            order, placed, got = names.expert_buffer(
                shapes, ep, lambda b, stop, sizes=sizes: b < len(sizes) and stop >= sizes[b])
            if got != sizes or not all(self.files.tiles(
                    f"{prefixes[b]}.param", start, stop) for b, start, stop in placed.values()):
                raise CheckpointError(
                    f"{where}: the expert optimizer's buckets of EP rank {e} do not hold "
                    f"its {local} local experts where megatron-core's buffer layout puts "
                    f"them (buckets of {sizes})")
            for n, k in order:
                b, start, stop = placed[(n, k)]
                self.expert_place[n][e].append((prefixes[b], start, stop))

    def _stages(self) -> tuple[list[list[str]], int]:
        """(Each model piece's parameters (hybrid's names), V): Megatron-LM's split of the
        layers into PP x V pieces (V the model chunks per PP rank,
        ``args.virtual_pipeline_model_parallel_size``, or 1; piece ``i`` is chunk ``i //
        PP`` of PP rank ``i % PP``), even or with the uneven first or last stage
        ``common.pt``'s args name (``decoder_first_pipeline_num_layers`` /
        ``decoder_last_pipeline_num_layers``, Megatron-LM's ``--decoder-first/last-
        pipeline-num-layers``; megatron-core's ``num_layers_in_first/last_pipeline_stage``
        read the same), the rest split evenly (:func:`~.megatron_names.split_stages`). A
        pipeline layout, or the embedding or loss counted as a layer, is one error naming
        the args."""
        args, pp = self.ckpt.args, self.pp
        dense = [n for n in self.ckpt.shapes if not n.endswith(_EXPERTS)]
        if pp == 1:
            return [dense], 1
        layers = int(arg(args, "num_layers", 0) or 0)
        ends = {f: arg(args, f) or arg(args, core) for f, core in (
            ("decoder_first_pipeline_num_layers", "num_layers_in_first_pipeline_stage"),
            ("decoder_last_pipeline_num_layers", "num_layers_in_last_pipeline_stage"))}
        chunks = {f: arg(args, f) for f in ("virtual_pipeline_model_parallel_size",
                                            "num_layers_per_virtual_pipeline_stage")}
        other = {f: arg(args, f) for f in (
            "pipeline_model_parallel_layout", "account_for_embedding_in_pipeline_split",
            "account_for_loss_in_pipeline_split")}
        other = {f: v for f, v in other.items() if v}
        said = "".join(f", args.{f} {v!r}" for f, v in {**ends, **chunks, **other}.items()
                       if v)
        where = (f"{os.path.join(self.ckpt.path, COMMON)}: the distributed optimizer's state "
                 f"at PP {pp} of args.num_layers {layers or None}{said}")
        if not layers or other:
            raise CheckpointError(
                f"{where}: hybrid reads its dp_reshardable layout at PP > 1 for Megatron-LM's "
                f"even split of the layers or an uneven first or last stage only (virtual "
                f"stages too)")
        try:
            split = split_layers(
                layers, pp, chunks["virtual_pipeline_model_parallel_size"] or None,
                layers_per_virtual_stage=chunks["num_layers_per_virtual_pipeline_stage"],
                first=ends["decoder_first_pipeline_num_layers"],
                last=ends["decoder_last_pipeline_num_layers"])
        except ConfigError as e:
            raise CheckpointError(f"{where}: not a split Megatron-LM makes ({e})") from None
        tied = not bool(arg(args, "untie_embeddings_and_output_weights", True))
        return names.split_stages(dense, list(split.layers), tied), split.vpp

    def _local_numel(self, name: str) -> int:
        n = 1
        for d in self._local_shape(name):
            n *= d
        return n

    def _local_shape(self, name: str) -> list[int]:
        """The megatron tensor's shape on one TP rank."""
        if name == names.TIED_COPY:
            name = "wte.weight"
        key, layer = self.ckpt._keys[name]
        shape = self.files.shape(key)[(1 if layer is not None else 0):]
        dim = names.tp_dim(name)
        if dim is not None and self.tp > 1:
            shape[dim] //= self.tp
        return shape

    def _layout(self, t: int, sizes: list[int], spec: str) -> dict | None:
        """Where each parameter of grad buffer ``t`` (DP group x V + model chunk) lies,
        {name: (bucket key, start, stop)}, in megatron-core's layout under layer spec
        ``spec``
        (:func:`~.megatron_names.stage_buffer`, buckets closed at the saved unpadded
        ``sizes``), or None when the files' chunks or bucket sizes say otherwise."""
        group, chunk = divmod(t, self.vpp)  # (the piece: chunk x PP + PP rank)
        placed, got = names.stage_buffer(
            self.stages, chunk * self.pp + group // self.tp, spec, self._local_numel,
            lambda b, stop: b < len(sizes) and stop >= sizes[b])
        if got != sizes:
            return None
        out: dict[str, tuple[str, int, int]] = {}
        for name, (bucket, start, stop) in placed.items():
            prefix = self.prefixes[t][bucket]
            if not self.files.tiles(f"{prefix}.param", start, stop):
                return None
            out[name] = (prefix, start, stop)
        return out

    def read(self, name: str) -> dict[str, torch.Tensor]:
        if name in self.expert_place:  # (each EP rank's local experts, in global order)
            shape = self.ckpt.shapes[name][1:]
            return {col: torch.stack([
                self.files.read_flat(f"{prefix}.{saved}", start, stop).reshape(shape)
                for rank in self.expert_place[name] for prefix, start, stop in rank])
                for col, saved in (("master", "param"), ("exp_avg", "exp_avg"),
                                   ("exp_avg_sq", "exp_avg_sq"))}
        shape = self._local_shape(name)
        # (a parameter TP does not cut is the same on every TP rank: rank 0's)
        places = self.place[name] if names.tp_dim(name) is not None else self.place[name][:1]
        out = {}
        for col, saved in (("master", "param"), ("exp_avg", "exp_avg"),
                           ("exp_avg_sq", "exp_avg_sq")):
            shards = [self.files.read_flat(f"{prefix}.{saved}", start, stop).reshape(shape)
                      for prefix, start, stop in places]
            out[col] = names.merge_tp(name, shards, self.ckpt.swiglu)
        return out
