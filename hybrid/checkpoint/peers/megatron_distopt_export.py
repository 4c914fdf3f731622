"""The distributed optimizer's state in hybrid's Megatron export (``export --to megatron
--megatron-dist-opt``): what megatron-core 0.16.1's DistributedOptimizer reads back.

* ``dp_reshardable`` (Megatron-LM's default with ``--use-distributed-optimizer``): per
  (PP stage, TP rank) -- its DP group's index ``G = stage x TP + TP rank`` --, per bucket
  ``B`` of its grad buffer, one flat fp32 tensor per column,
  ``optimizer.distributed.dp_group_idx_G.gbuf_idx_0.dtype_<pair>.bucket_idx_B.{param,
  exp_avg,exp_avg_sq}`` of the bucket's unpadded length, each of the stage's parameters'
  TP-local piece at the place megatron-core's buffer gives it
  (:func:`~.megatron_names.split_stages` and :func:`~.megatron_names.stage_buffer`, the
  functions the reader maps these files with), cut where the DP ranks' shards meet, and
  the gaps (alignment padding) as zero chunks; beside them the objects its load takes
  (``per_bucket_numel``, ``per_bucket_numel_unpadded`` -- the load asserts the latter
  equals its own buffer's -- and ``optimizer``, the param groups with their ``step``).
  At PP > 1 the stages split the layers evenly (``--pipeline-model-parallel-size`` must
  divide them) or with an uneven first or last stage
  (``--decoder-first-pipeline-num-layers`` / ``--decoder-last-pipeline-num-layers``, the
  rest even), the embeddings on the first, the final norm and the output layer on the
  last; with virtual stages (``--virtual-pipeline-model-parallel-size V``) each stage's
  group holds one grad buffer per model chunk, ``gbuf_idx_v`` over piece ``v x PP +
  stage`` of the model, and its ``per_bucket_numel`` objects one entry per chunk (what
  megatron-core 0.16.1 saves); megatron-core buckets piece 0 only; with tied embeddings the last
  stage's buffer also holds megatron-core's copy of the word embeddings (its output
  layer's weight), written with the first stage's master and moments, and each of the
  two copies is a bucket of its own, as megatron-core's buffer makes them.
* ``fully_reshardable`` (``--dist-ckpt-optim-fully-reshardable``): model-shaped
  ``optimizer.state.{param,exp_avg,exp_avg_sq}.<key>``, the param groups in
  ``common.pt``: no layout, the same files at any TP, DP and PP (megatron-core's last
  stage asks for its copy of tied word embeddings under the first stage's key,
  ``embedding.word_embeddings.weight``, and gets the same master and moments).

The bucket layout depends on the run that loads it: its TP and PP sizes, layer spec (the
parameter order) and DDP bucket size (``--overlap-grad-reduce --ddp-bucket-size``;
without overlap, one bucket; at PP > 1 megatron-core buckets the first stage only,
:func:`~.megatron_names.ddp_closes`); the DP size sets only the padding and the chunks. The
buffer's dtype pair in the keys is the checkpoint's run's
(:func:`~.megatron_names.buffer_dtypes`): ``dtype_(torch.float32, torch.float32)`` for an
fp32 run, ``dtype_(torch.bfloat16, torch.float32)`` for a bf16 one (grads reduced in fp32,
Megatron-LM's and hybrid's default under ``--bf16``; ``torch.bfloat16`` twice without);
megatron-core's load finds its buffer's keys by that pair, so a run of another dtype
does not load it. The columns are fp32 in each.

An MoE checkpoint (dp_reshardable at TP 1, PP 1): megatron-core's two chained distributed
optimizers, :class:`Chained` -- the dense buffer as above under ``chained_0.``, and the
experts' under ``chained_1.``, one group per EP rank (:class:`ExpertDpReshardable`);
``common.pt``'s ``optimizer`` ``{0: ..., 1: ...}``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from hybrid.checkpoint.peers import megatron_names as names
from hybrid.checkpoint.peers.megatron_files import DcpWriter
from hybrid.config.stage_split import FIRST, LAST, VPP, split_layers
from hybrid.errors import CheckpointError, ConfigError

MODES = ("dp_reshardable", "fully_reshardable")
SPECS = tuple(names.LAYER_ORDER)
_COLUMNS = (("master", "param"), ("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq"))


def check(mode: str | None, tp: int, dp: int, spec: str, bucket_size: int | None) -> None:
    """One CheckpointError naming the flag for a request :func:`write` cannot honour."""
    if mode is not None and mode not in MODES:
        raise CheckpointError(f"--megatron-dist-opt {mode}: not a distributed optimizer "
                              f"layout hybrid writes ({', '.join(MODES)})")
    if spec not in SPECS:
        raise CheckpointError(f"--megatron-layer-spec {spec}: not one of {', '.join(SPECS)}")
    if tp < 1 or dp < 1:
        raise CheckpointError(f"--tensor-model-parallel-size {tp} / --data-parallel-size "
                              f"{dp}: each must be at least 1")
    if bucket_size is not None and (mode != "dp_reshardable" or bucket_size < 1):
        raise CheckpointError(f"--megatron-ddp-bucket-size {bucket_size}: a positive size, "
                              f"and only with --megatron-dist-opt dp_reshardable (the other "
                              f"layouts do not depend on the buckets)")


def param_groups(cfg: dict, step: int) -> list[dict]:
    """megatron-core's two param groups (decayed; norms and biases undecayed), as its
    DistributedOptimizer's ``state_dict()`` records them: the keys its load matches
    groups by (``wd_mult``, ``lr_mult``, ``is_expert_parallel``, ``is_decoupled_lr``),
    the scheduler's (``max_lr``, ``min_lr``) and torch AdamW's, ``step`` included."""
    lr, wd = float(cfg.get("lr") or 0.0), float(cfg.get("weight_decay") or 0.0)
    group = {"is_expert_parallel": False, "default_config": True, "lr_mult": 1.0,
             "is_decoupled_lr": False, "max_lr": lr, "min_lr": float(cfg.get("min_lr") or 0.0),
             "lr": lr, "betas": (cfg.get("adam_beta1", 0.9), cfg.get("adam_beta2", 0.999)),
             "eps": cfg.get("adam_eps", 1e-8), "amsgrad": False, "maximize": False,
             "foreach": None, "capturable": False, "differentiable": False, "fused": None,
             "decoupled_weight_decay": True, "step": float(step)}
    return [{**group, "wd_mult": 1.0, "weight_decay": wd},
            {**group, "wd_mult": 0.0, "weight_decay": 0.0}]


class FullyReshardable:
    """``fully_reshardable``: each parameter's master and moments model-shaped, under
    ``optimizer.state.{param,exp_avg,exp_avg_sq}.``; :meth:`put` is handed each
    parameter's (megatron-layout) columns by the model writer."""

    def __init__(self, groups: list[dict]):
        self.groups = groups

    def put(self, w: DcpWriter, name: str, cols: dict, place: Callable) -> None:
        for col, saved in _COLUMNS:
            place(f"optimizer.state.{saved}.", cols[col])

    def finish(self, w: DcpWriter) -> None:
        pass  # (nothing beyond the parameters' own keys)

    def common(self) -> dict:
        """``common.pt``'s ``optimizer``."""
        return {"optimizer": {"param_groups": self.groups},
                "param_state_sharding_type": "fully_reshardable"}


class DpReshardable:
    """``dp_reshardable``: megatron-core's buckets per (PP stage, TP rank) (the module
    docstring). ``shapes``: hybrid's full shapes of every parameter (the layout needs
    them all before the first is written); ``counts``: each piece's layers
    (:func:`stage_layers`; with V virtual stages per PP rank, PP x V pieces in model
    order, piece ``i`` model chunk ``i // PP`` of stage ``i % PP``: a grad buffer of its
    own, ``gbuf_idx_<i // PP>`` of the stage's groups). One parameter's columns in memory
    at a time; the gaps are written by :meth:`finish`."""

    def __init__(self, shapes: dict[str, list[int]], tp: int, dp: int, pp: int, spec: str,
                 bucket_size: int | None, cfg: dict, groups: list[dict],
                 dtypes: tuple[torch.dtype, torch.dtype], counts: list[int],
                 chain: str = ""):
        self.tp, self.dp, self.pp, self.groups, self.chain = tp, dp, pp, groups, chain
        self.swiglu = bool(cfg.get("swiglu"))
        self.dtypes = dtypes  # (the buffer's (param, grad) pair: its keys and objects)
        local: dict[str, int] = {}
        for name, shape in shapes.items():
            dim = names.tp_dim(name)
            if dim is not None and shape[dim + names.is_swiglu_fc(name, self.swiglu)] % tp:
                raise CheckpointError(f"{name} {shape}: TP {tp} does not divide it "
                                      f"(--tensor-model-parallel-size)")
            local[name] = math.prod(shape) // (tp if dim is not None else 1)
        tied = not cfg.get("untie_embeddings_and_output_weights")
        stages = names.split_stages(list(shapes), counts, tied)
        # name -> [(piece, bucket, start, stop)]: its place, and the tied copy's
        self.place: dict[str, list[tuple[int, int, int, int]]] = {}
        self.unpadded: list[list[int]] = []  # (per piece)
        for stage in range(len(counts)):  # (the pieces: the stages without virtual ones)
            placed, sizes = names.stage_buffer(
                stages, stage, spec,
                lambda n: local["wte.weight" if n == names.TIED_COPY else n],
                names.ddp_closes(stage, bucket_size))
            for name, (bucket, start, stop) in placed.items():
                owner = "wte.weight" if name == names.TIED_COPY else name
                self.place.setdefault(owner, []).append((stage, bucket, start, stop))
            self.unpadded.append(sizes)
        self.padded = [[names.padded_bucket(n, dp) for n in s] for s in self.unpadded]
        self.written: list[list[list[tuple[int, int]]]] = [[[] for _ in s]
                                                           for s in self.unpadded]

    def key(self, piece: int, t: int, bucket: int, col: str) -> str:
        """The key of ``piece``'s bucket on TP rank ``t``: its stage's DP group, its model
        chunk's grad buffer."""
        group, chunk = (piece % self.pp) * self.tp + t, piece // self.pp
        return (f"{self.chain}optimizer.distributed.dp_group_idx_{group}.gbuf_idx_{chunk}."
                f"dtype_{self.dtypes}.bucket_idx_{bucket}.{col}")

    def _pieces(self, stage: int, bucket: int, start: int, stop: int
                ) -> list[tuple[int, int]]:
        """``[start, stop)`` of ``bucket`` of ``stage`` cut where the DP ranks' shards
        meet (megatron saves each rank's piece as a chunk of its own)."""
        return shard_pieces(self.padded[stage][bucket] // self.dp, start, stop)

    def put(self, w: DcpWriter, name: str, cols: dict, place: Callable) -> None:
        for col, saved in _COLUMNS:
            flats = [p.reshape(-1) for p in names.split_tp(name, cols[col], self.tp,
                                                           self.swiglu)]
            for stage, bucket, start, stop in self.place[name]:  # (and the tied copy's)
                for t, flat in enumerate(flats):
                    for a, b in self._pieces(stage, bucket, start, stop):
                        w.tensor(self.key(stage, t, bucket, saved),
                                 [self.unpadded[stage][bucket]], [a],
                                 flat[a - start:b - start])
        for stage, bucket, start, stop in self.place[name]:
            self.written[stage][bucket].append((start, stop))

    def finish(self, w: DcpWriter) -> None:
        """The gaps between parameters as zero chunks (megatron's load reads them), and
        the objects of each (stage, TP rank)'s DP group."""
        for stage, buckets in enumerate(self.written):
            for bucket, spans in enumerate(buckets):
                end = self.unpadded[stage][bucket]
                at = 0
                for start, stop in [*sorted(spans), (end, 0)]:
                    for a, b in self._pieces(stage, bucket, at, start) if start > at else []:
                        for t in range(self.tp):
                            for _, saved in _COLUMNS:
                                w.tensor(self.key(stage, t, bucket, saved), [end],
                                         [a], torch.zeros(b - a))
                    at = max(at, stop)
        for group in range(self.pp * self.tp):
            pieces = range(group // self.tp, len(self.unpadded), self.pp)  # (its chunks)
            group_objects(w, f"{self.chain}optimizer.distributed.dp_group_idx_{group}.",
                          self.dtypes, [self.padded[p] for p in pieces],
                          [self.unpadded[p] for p in pieces], self.groups)

    def common(self) -> dict:
        """``common.pt``'s ``optimizer`` (the param groups are in the objects)."""
        return {"param_state_sharding_type": "dp_reshardable"}


def shard_pieces(shard: int, start: int, stop: int) -> list[tuple[int, int]]:
    """``[start, stop)`` of a bucket cut where the DP ranks' shards of ``shard`` values
    meet (megatron saves each rank's piece as a chunk of its own)."""
    cuts = [start, *range((start // shard + 1) * shard, stop, shard), stop]
    return list(zip(cuts[:-1], cuts[1:]))


def group_objects(w: DcpWriter, prefix: str, dtypes, padded: list[list[int]],
                  unpadded: list[list[int]], groups: list[dict]) -> None:
    """The objects megatron-core's load of one DP group's buckets takes (``prefix``:
    its keys' ``[chained_<i>.]optimizer.distributed.dp_group_idx_<G>.``); ``padded`` and
    ``unpadded``: the bucket sizes of each of its grad buffers (one per model chunk)."""
    # (a ShardedObject of one shard, as a list of the saving rank's objects: one entry
    # per grad buffer)
    w.obj(f"{prefix}per_bucket_numel/shard_0_1", [[{dtypes: list(p)} for p in padded]])
    w.obj(f"{prefix}per_bucket_numel_unpadded/shard_0_1",
          [[{dtypes: list(u)} for u in unpadded]])
    w.obj(f"{prefix}optimizer/shard_0_1", [{"param_groups": groups}])


class ExpertDpReshardable:
    """An MoE run's expert optimizer in ``dp_reshardable`` (megatron-core's second chained
    one, keys ``chained_1.optimizer.distributed.dp_group_idx_<EP rank>.``): one group per
    EP rank, its buffer holding the rank's local experts where
    :func:`~.megatron_names.expert_buffer` puts them (the reader's layout), each bucket
    padded for and cut at the shards of the expert-data-parallel group (``edp`` ranks:
    DP / EP at TP 1); ``groups``: its param groups. :meth:`put` is handed each expert
    tensor ``(E, ...)`` of hybrid's."""

    def __init__(self, shapes: dict[str, list[int]], ep: int, edp: int,
                 bucket_size: int | None, groups: list[dict],
                 dtypes: tuple[torch.dtype, torch.dtype], chain: str):
        self.ep, self.edp, self.groups, self.dtypes, self.chain = ep, edp, groups, dtypes, chain
        experts = {n: s for n, s in shapes.items() if n.endswith(names.EXPERTS)}
        self.local = next(iter(experts.values()))[0] // ep
        _, self.placed, self.unpadded = names.expert_buffer(experts, ep,
                                                            names.ddp_closes(0, bucket_size))
        self.padded = [names.padded_bucket(n, edp) for n in self.unpadded]
        self.written: list[list[tuple[int, int]]] = [[] for _ in self.unpadded]

    def key(self, rank: int, bucket: int, col: str) -> str:
        return (f"{self.chain}optimizer.distributed.dp_group_idx_{rank}.gbuf_idx_0."
                f"dtype_{self.dtypes}.bucket_idx_{bucket}.{col}")

    def _pieces(self, bucket: int, start: int, stop: int) -> list[tuple[int, int]]:
        return shard_pieces(self.padded[bucket] // self.edp, start, stop)

    def put(self, w: DcpWriter, name: str, cols: dict, place: Callable) -> None:
        for col, saved in _COLUMNS:
            for e in range(self.ep):
                for k in range(self.local):
                    bucket, start, stop = self.placed[(name, k)]
                    flat = cols[col][e * self.local + k].reshape(-1)
                    for a, b in self._pieces(bucket, start, stop):
                        w.tensor(self.key(e, bucket, saved), [self.unpadded[bucket]], [a],
                                 flat[a - start:b - start])
        for k in range(self.local):
            bucket, start, stop = self.placed[(name, k)]
            self.written[bucket].append((start, stop))

    def finish(self, w: DcpWriter) -> None:
        """The gaps as zero chunks and each EP rank's group's objects."""
        for bucket, spans in enumerate(self.written):
            end, at = self.unpadded[bucket], 0
            for start, stop in [*sorted(spans), (end, 0)]:
                for a, b in self._pieces(bucket, at, start) if start > at else []:
                    for e in range(self.ep):
                        for _, saved in _COLUMNS:
                            w.tensor(self.key(e, bucket, saved), [end], [a], torch.zeros(b - a))
                at = max(at, stop)
        for e in range(self.ep):
            group_objects(w, f"{self.chain}optimizer.distributed.dp_group_idx_{e}.",
                          self.dtypes, [self.padded], [self.unpadded], self.groups)

    def common(self) -> dict:
        return {"param_state_sharding_type": "dp_reshardable"}


class Chained:
    """An MoE run's two chained distributed optimizers (dense, experts): each parameter's
    state to its own; ``common.pt``'s ``optimizer`` ``{0: dense, 1: experts}``."""

    def __init__(self, dense: DpReshardable, experts: ExpertDpReshardable):
        self.dense, self.experts = dense, experts

    def put(self, w: DcpWriter, name: str, cols: dict, place: Callable) -> None:
        (self.experts if name.endswith(names.EXPERTS) else self.dense).put(w, name, cols, place)

    def finish(self, w: DcpWriter) -> None:
        self.dense.finish(w)
        self.experts.finish(w)

    def common(self) -> dict:
        return {0: self.dense.common(), 1: self.experts.common()}


def stage_layers(cfg: dict, pp: int, first: int | None = None,
                 last: int | None = None, vpp: int | None = None) -> list[int]:
    """Each pipeline piece's layer count in the loading run's split of the model's layers
    (a stage's, or with ``vpp`` model chunks per stage, ``--virtual-pipeline-model-
    parallel-size``, PP x V pieces in model order): Megatron-LM's even split, or with
    ``first`` / ``last`` layers on the first / last stage
    (``--decoder-first-pipeline-num-layers`` / ``--decoder-last-pipeline-num-layers``) and
    the rest even (:func:`hybrid.config.stage_split.split_layers`, Megatron-LM's rules);
    one CheckpointError naming the flags for a split Megatron-LM does not make."""
    layers = int(cfg.get("num_layers") or 0)
    flags = (f"--pipeline-model-parallel-size {pp}" + "".join(
        f" {flag} {n}" for flag, n in ((FIRST, first), (LAST, last), (VPP, vpp))
        if n is not None))
    if pp < 1 or (pp == 1 and (first or last or vpp)):
        raise CheckpointError(f"{flags}: uneven first or last stages and virtual stages "
                              f"need PP 2 or more")
    if pp == 1:
        return [layers]
    try:
        return list(split_layers(layers, pp, vpp, first=first, last=last).layers)
    except ConfigError as e:
        raise CheckpointError(
            f"{flags}: hybrid writes for Megatron-LM's split of the model's {layers} layers "
            f"over the stages (even, or an uneven first or last stage and the rest even; "
            f"virtual stages of either): {e}") from None


def layout(mode: str, shapes: dict[str, list[int]], cfg: dict, step: int, tp: int,
           dp: int, spec: str, bucket_size: int | None,
           dtypes: tuple[torch.dtype, torch.dtype], pp: int = 1,
           counts: list[int] | None = None, ep: int = 1):
    """The writer of ``mode``'s optimizer state (:func:`check` first); ``dtypes``: the
    loading run's grad buffer (param, grad) dtypes; ``pp``: its PP size (dp_reshardable:
    one group of buckets per stage and TP rank), ``counts`` its pieces' layers
    (:func:`stage_layers`; None: the even split); an MoE checkpoint's (dp_reshardable, TP 1,
    PP 1): the dense and expert optimizers chained, the experts' groups per EP rank of
    ``ep`` over ``dp / ep`` expert-data-parallel ranks (:class:`Chained`)."""
    groups = param_groups(cfg, step)
    if mode == "fully_reshardable":
        return FullyReshardable(groups)
    counts = counts or stage_layers(cfg, pp)
    if not any(n.endswith(names.EXPERTS) for n in shapes):
        return DpReshardable(shapes, tp, dp, pp, spec, bucket_size, cfg, groups, dtypes,
                             counts)
    from hybrid.checkpoint.peers import megatron_moe_export as moe
    dense = {n: s for n, s in shapes.items() if not n.endswith(names.EXPERTS)}
    return Chained(
        DpReshardable(dense, tp, dp, pp, spec, bucket_size, cfg, groups, dtypes, counts,
                      moe.DENSE_CHAIN),
        ExpertDpReshardable(shapes, ep, dp // ep, bucket_size, moe.expert_groups(groups),
                            dtypes, moe.EXPERT_CHAIN))


__all__ = ["MODES", "SPECS", "check", "layout", "param_groups", "stage_layers"]
