"""The estimators' input: one rank's share of a GPT training run, torch-free.

:class:`Workload` is what :mod:`hybrid.estimate.memory`, :mod:`.context_parallel`
and :mod:`.tiers` read; :func:`workload` builds it from a
:class:`hybrid.config.TrainConfig`. (Both are importable from
:mod:`hybrid.estimate.memory` too, where they first lived.)
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from hybrid.config.model import ModelConfig


@dataclass(frozen=True)
class Workload:
    """One rank's share of a GPT training run: the model (its section, vocabulary
    known: sizes, dropout, ``seq_length``, the Llama-family options) and how the run
    lays it out -- TP, CP, DP, PP, micro-batches, ZeRO stage, precision, recompute.

    With PP > 1 the rank is one of pipeline stage ``stage`` (its pipeline rank), which
    holds ``stage_layers[stage]`` transformer layers (all its chunks together;
    ``chunk_layers[stage]`` per chunk), the embedding on stage 0 and the output layer on
    the last: ``psi`` and everything ZeRO derives from it (model states, buffers, DP
    traffic) are that stage's. Its activations are those of the micro-batches the
    ``schedule`` keeps in flight on it (:mod:`hybrid.estimate.pipeline`). At ZeRO 3 a
    pipeline step gathers each unit once and holds the stage whole until its last
    weight-reading backward, unless ``reshard_after_micro_batch``
    (``--pipeline-reshard-after-micro-batch``) frees them after every use, as PP 1 does
    (:attr:`holds_stage`).
    """

    model: ModelConfig
    micro_batch_size: int
    tp: int = 1
    sequence_parallel: bool = False
    dp: int = 1
    micro_batches: int = 1  # per optimizer step (gradient accumulation)
    zero_stage: int = 0
    params_dtype: str = "fp32"
    grads_dtype: str | None = None
    recompute: bool = False  # full: whole layers
    recompute_num_layers: int | None = None  # block method: only the first N layers
    recompute_layers_per_checkpoint: int = 1  # uniform method: layers per stored input
    selective_recompute: bool = False  # the attention core only
    partition_activations: bool = False
    cpu_checkpointing: bool = False
    reduce_bucket_size: int = 50_000_000
    device: str = "cuda"  # "cpu": the kernels and masks of a CPU run
    cp: int = 1  # context-parallel ranks splitting each sequence
    cp_comm_type: str = "p2p"  # p2p | all_gather | a2a
    cp_layout: str = "load_balanced"  # load_balanced | striped
    loss_mask: bool = False  # --eod-mask-loss: CP all-reduces [sum, count] of the loss
    pp: int = 1  # pipeline stages
    stage_layers: tuple[int, ...] | None = None  # layers of each stage (None: PP 1, all)
    stage: int = 0  # the pipeline stage this rank is one of
    # layers of each chunk of each stage (None: one chunk of stage_layers[s] each)
    chunk_layers: tuple[tuple[int, ...], ...] | None = None
    schedule: str = "1f1b"  # --pipeline-schedule (interleaved_1f1b with chunks)
    reshard_after_micro_batch: bool = False  # --pipeline-reshard-after-micro-batch
    # the global layer ids of each stage (all its chunks): which of them are MoE layers
    stage_layer_ids: tuple[tuple[int, ...], ...] | None = None
    ep: int = 1  # expert-parallel ranks an MoE layer's experts are split over
    etp: int = 1  # expert-tensor-parallel ranks each expert's hidden units are split over

    @property
    def holds_stage(self) -> bool:
        """Whether ZeRO 3 gathers each unit once a step and holds the whole stage through
        it (a pipeline step's default) instead of gathering it for every forward and
        backward and freeing it after (PP 1, or PP > 1 with
        ``reshard_after_micro_batch``). Meaningful at ZeRO 3 only."""
        return self.pp > 1 and not self.reshard_after_micro_batch

    @property
    def root_psi(self) -> int:
        """Parameters of this rank's root unit, outside the blocks: the whole model's
        embeddings, final norm and output layer at PP 1; with PP what its stage holds
        of them (the embeddings on stage 0, the final norm and output layer on the last,
        nothing between)."""
        if self.pp == 1 or self.stage_layers is None:
            return self.model.root_parameters(self.tp)
        return self.model.stage_parameters(self.tp, 0, self.stage == 0,
                                           self.stage == self.pp - 1)

    @property
    def seq_per_rank(self) -> int:
        """Tokens of each sequence this rank holds: ``seq_length / cp``."""
        return self.model.seq_length // self.cp

    @property
    def shard_ranks(self) -> int:
        """Ranks ZeRO shards the model states over and reduces gradients across:
        DP x CP (every rank holding the same TP slice; :mod:`hybrid.zero.engine`)."""
        return self.dp * self.cp

    @property
    def psi(self) -> int:
        """Parameters of one TP rank of this stage (:meth:`ModelConfig.num_parameters`;
        with PP, :meth:`ModelConfig.stage_parameters`)."""
        return self.stage_psi(self.stage)

    def stage_psi(self, stage: int) -> int:
        """Parameters of one TP rank of pipeline stage ``stage`` (an MoE layer's experts
        whole: :attr:`expert_psi` says how many of them, and EP splits them)."""
        if self.pp == 1 or self.stage_layers is None:
            return self.model.num_parameters(self.tp)
        layers = (self.stage_layer_ids[stage] if self.stage_layer_ids is not None
                  else self.stage_layers[stage])
        return self.model.stage_parameters(self.tp, layers, stage == 0, stage == self.pp - 1)

    def layer_ids(self, stage: int) -> tuple[int, ...]:
        """The global ids of stage ``stage``'s layers."""
        if self.stage_layer_ids is not None:
            return self.stage_layer_ids[stage]
        if self.pp == 1 or self.stage_layers is None:
            return tuple(range(self.model.num_layers))
        start = sum(self.stage_layers[:stage])
        return tuple(range(start, start + self.stage_layers[stage]))

    @property
    def expert_psi(self) -> int:
        """The routed experts' parameters among :attr:`psi` (every expert of this stage's
        MoE layers): this rank holds ``expert_psi / (ep x etp)`` of them, sharded by ZeRO over
        the expert DP group (:attr:`expert_shard_ranks`); the rest of ``psi`` over
        :attr:`shard_ranks`."""
        return self.model.expert_parameters(self.layer_ids(self.stage))

    @property
    def expert_shard_ranks(self) -> int:
        """Ranks ZeRO shards the experts over: the expert DP group, TP x DP x CP / (EP x
        ETP) (the ETP x EP group folds over the stage's TP ranks too)."""
        return self.shard_ranks * self.tp // (self.ep * self.etp)

    @property
    def vpp(self) -> int:
        """Model chunks (virtual stages) per pipeline rank."""
        return len(self.chunk_layers[0]) if self.chunk_layers else 1

    def stage_chunks(self, stage: int) -> tuple[int, ...]:
        """Layers of each chunk of pipeline stage ``stage``, in chunk order."""
        if self.chunk_layers is not None:
            return self.chunk_layers[stage]
        return (self.stage_layers[stage] if self.stage_layers else self.model.num_layers,)

    def heaviest_stage(self) -> Workload:
        """This workload on the stage with the most parameters (the first of equals)."""
        stages = range(self.pp)
        return replace(self, stage=max(stages, key=lambda s: (self.stage_psi(s), -s)))

    @property
    def padded_vocab_size(self) -> int:
        """Embedding rows at this TP size (:meth:`ModelConfig.padded_vocab_size`)."""
        return self.model.padded_vocab_size(self.tp)

    def with_stage(self, stage: int) -> Workload:
        return replace(self, zero_stage=stage)


def workload(cfg, vocab_size: int, device: str = "cuda") -> Workload:
    """The :class:`Workload` of a :class:`hybrid.config.TrainConfig` run with the
    tokenizer's ``vocab_size`` (at its full global batch, after any ramp-up), on pipeline
    stage 0 (:meth:`Workload.heaviest_stage` picks another)."""
    p, zero, rc, split = cfg.parallel, cfg.zero, cfg.recompute, cfg.pipeline.split
    pp = p.pipeline_model_parallel_size
    piped = split is not None and pp > 1
    stage_layers = tuple(split.rank_layers(s) for s in range(pp)) if piped else None
    chunk_layers = (tuple(tuple(len(split.layer_ids(s, c)) for c in range(split.vpp))
                          for s in range(pp)) if piped else None)
    layer_ids = (tuple(tuple(i for c in range(split.vpp) for i in split.layer_ids(s, c))
                       for s in range(pp)) if piped else None)
    return Workload(
        model=cfg.model.with_vocab_size(vocab_size),
        micro_batch_size=cfg.loop.micro_batch_size,
        tp=p.tensor_model_parallel_size, sequence_parallel=p.sequence_parallel,
        dp=p.data_parallel_size, micro_batches=cfg.num_micro_batches, zero_stage=zero.stage,
        params_dtype=cfg.precision.params_dtype, grads_dtype=cfg.precision.grads_dtype,
        recompute=rc.granularity == "full", recompute_num_layers=rc.num_layers,
        recompute_layers_per_checkpoint=rc.layers_per_checkpoint,
        selective_recompute=rc.granularity == "selective",
        partition_activations=rc.partition_activations,
        cpu_checkpointing=rc.cpu_checkpointing, reduce_bucket_size=zero.reduce_bucket_size,
        device=device, cp=p.context_parallel_size, cp_comm_type=p.cp_comm_type,
        cp_layout=p.cp_layout, loss_mask=cfg.data.eod_mask_loss, pp=pp,
        stage_layers=stage_layers, chunk_layers=chunk_layers,
        schedule=cfg.pipeline.schedule,
        reshard_after_micro_batch=cfg.pipeline.reshard_after_micro_batch,
        stage_layer_ids=layer_ids, ep=p.expert_model_parallel_size,
        etp=p.expert_tensor_parallel_size)
