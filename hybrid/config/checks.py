"""Every check that can reject a command line, one function per concern; each
message names the flag to change.

:func:`hybrid.config.build_config` calls them in order on a copy of the
flags; some fill derived defaults into that copy (the global batch, the
recompute method, the LR decay length, the tokenizer type ...).

What one option alone must be is declared on its :class:`~hybrid.config.flags.Flags`
field (``opt(choices=..., at_least=..., above=..., at_most=..., below=...)``, the note of
:mod:`hybrid.config.flags`) and enforced here by one generic check, :func:`check_fields`,
with one message format. The functions after it hold what reads two or more options,
or a value's shape beyond a set or a bound (``--split``'s three numbers,
``--offload-buffer-size``'s multiple of 1024, ``--distributed-timeout-minutes``'s floor
of one second). A message names the flag; :func:`hybrid.config.build._as_given` renames
it after the ds_config key or API argument that gave the value.
"""

from __future__ import annotations

import dataclasses
import math
import os

from hybrid.config.flags import Flags
from hybrid.config.options import BOUNDS, flag_name
from hybrid.config.sections import tokenizer_kind
from hybrid.config.stage_split import StageSplit, split_layers
from hybrid.errors import ConfigError

DEFAULT_TRAIN_ITERS = 200


def canonical_offload(f: Flags) -> None:
    """The other spellings of an offload tier, made canonical before :func:`check_fields`
    reads them: ``Flags(offload_optimizer=True)`` (the bare flag) is cpu; False and
    "none" are no tier."""
    if f.offload_optimizer is True:
        f.offload_optimizer = "cpu"
    if f.offload_optimizer in (False, "none"):
        f.offload_optimizer = None
    if f.offload_param == "none":
        f.offload_param = None


def check_fields(f: Flags) -> None:
    """Every float finite (nan and inf pass argparse's float()), and each field within what
    its ``opt`` declares (:func:`allowed`). One message for all: "--zero-stage must be 0, 1,
    2 or 3, got 5"; None passes where the default is None."""
    for fld in dataclasses.fields(f):
        value = getattr(f, fld.name)
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{flag_name(fld.name)} must be a finite number, got {value}")
        rule = allowed(fld)
        if rule is None or (value is None and fld.default is None) or _within(fld, value):
            continue
        why = fld.metadata.get("refused", {}).get(value) if _hashable(value) else None
        raise ConfigError(f"{flag_name(fld.name)} must be {rule}, got {value!r}"
                          + (f": {why}" if why else ""))


def allowed(fld: dataclasses.Field) -> str | None:
    """What field ``fld`` declares its value must be, as :func:`check_fields` says it ("0,
    1, 2 or 3", ">= 1", "in [0, 1)"), or None where it declares nothing."""
    meta = fld.metadata
    if "choices" in meta:
        names = [str(c) for c in meta["choices"]]
        return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"
    low = next((b for b in ("at_least", "above") if b in meta), None)
    high = next((b for b in ("at_most", "below") if b in meta), None)
    if low and high:
        return (f"in {'[' if low == 'at_least' else '('}{_bound(meta[low])}, "
                f"{_bound(meta[high])}{']' if high == 'at_most' else ')'}")
    side = low or high
    return None if side is None else f"{_SIGN[side]} {_bound(meta[side])}"


_SIGN = {"at_least": ">=", "above": ">", "at_most": "<=", "below": "<"}


def _within(fld: dataclasses.Field, value) -> bool:
    meta = fld.metadata
    if "choices" in meta:
        return _hashable(value) and value in meta["choices"]
    if not isinstance(value, (int, float)):
        return False
    return all(b not in meta or _COMPARE[b](value, meta[b]) for b in BOUNDS)


_COMPARE = {"at_least": lambda v, b: v >= b, "above": lambda v, b: v > b,
            "at_most": lambda v, b: v <= b, "below": lambda v, b: v < b}


def _hashable(value) -> bool:
    try:
        hash(value)
    except TypeError:
        return False
    return True


def _bound(b: float) -> str:
    """A bound as a message writes it: a power of two (or one less) past 2**20 by its
    exponent ("2**32 - 1"), any other number as Python prints it."""
    if isinstance(b, int) and b >= 2**20 and not b & (b - 1):
        return f"2**{b.bit_length() - 1}"
    if isinstance(b, int) and b >= 2**20 and not b & (b + 1):
        return f"2**{b.bit_length()} - 1"
    return str(b)


def check_parallel(f: Flags) -> None:
    tp = f.tensor_model_parallel_size
    if f.sequence_parallel and tp == 1:  # nothing to split: dropped, as Megatron drops it
        f.sequence_parallel = False
        f.ignored_megatron_flags.append("--sequence-parallel (TP 1: nothing to split)")
    if f.sequence_parallel and f.seq_length % tp:
        raise ConfigError(f"--sequence-parallel splits --seq-length {f.seq_length} over "
                          f"--tensor-model-parallel-size {tp}: use a multiple of {tp}")
    _check_context_parallel(f)
    if f.distributed_timeout_minutes * 60 < 1:  # below a second, rendezvous itself times out
        raise ConfigError(f"--distributed-timeout-minutes must be at least 1/60 (one second), "
                          f"got {f.distributed_timeout_minutes}")


def _check_context_parallel(f: Flags) -> None:
    """--context-parallel-size with its comm type and layout: the sequence and the heads
    must split as they say (the layout itself is checked by check_layout)."""
    cp, tp = f.context_parallel_size, f.tensor_model_parallel_size
    if cp == 1:
        return
    chunks = 2 * cp if f.cp_layout == "load_balanced" else cp
    if f.seq_length % chunks:
        raise ConfigError(f"--context-parallel-size {cp} with --cp-layout {f.cp_layout} cuts "
                          f"--seq-length {f.seq_length} into {chunks} equal parts: use a "
                          f"multiple of {chunks}")
    if f.sequence_parallel and (f.seq_length // cp) % tp:
        raise ConfigError(f"--sequence-parallel splits each CP rank's {f.seq_length // cp} "
                          f"tokens (--seq-length / --context-parallel-size) over "
                          f"--tensor-model-parallel-size {tp}: use a --seq-length that is a "
                          f"multiple of {cp * tp}")
    if f.cp_comm_type != "a2a":
        return
    heads = f.num_attention_heads
    if (heads // tp) % cp:
        raise ConfigError(f"--cp-comm-type a2a splits each TP rank's heads over "
                          f"--context-parallel-size {cp}: --num-attention-heads {heads} / TP "
                          f"{tp} must be divisible by {cp}; use --cp-comm-type p2p or "
                          f"all_gather")
    if f.group_query_attention:  # the key/value heads split the same way
        given = f.num_query_groups
        groups = 1 if given is None else given  # (Megatron's default, filled in later)
        default = "" if given is not None else " (the default with --group-query-attention)"
        if groups >= 1 and (groups // tp) % cp:  # (below 1: validate_architecture says)
            raise ConfigError(f"--cp-comm-type a2a splits each TP rank's key/value heads over "
                              f"--context-parallel-size {cp}: --num-query-groups {groups}"
                              f"{default} / TP {tp} must be divisible by {cp}; give "
                              f"--num-query-groups a multiple of {cp * tp}, or use "
                              f"--cp-comm-type p2p or all_gather")


def check_model(f: Flags) -> None:
    tp = f.tensor_model_parallel_size
    # with --kv-channels the heads have their own width (its bound, >= 1, is the field's
    # own check): the hidden size then need not split into whole heads
    if f.kv_channels is None and f.hidden_size % f.num_attention_heads:
        raise ConfigError(f"--hidden-size {f.hidden_size} is not divisible by "
                          f"--num-attention-heads {f.num_attention_heads}: give the head "
                          f"width with --kv-channels, or change one of them")
    if f.num_attention_heads % tp:
        raise ConfigError(
            f"--num-attention-heads {f.num_attention_heads} is not divisible by "
            f"--tensor-model-parallel-size {tp}: each TP rank needs whole heads")
    if f.ffn_hidden_size is not None and f.ffn_hidden_size % tp:
        raise ConfigError(f"--ffn-hidden-size {f.ffn_hidden_size} is not divisible by "
                          f"--tensor-model-parallel-size {tp}")
    if f.max_position_embeddings is None:
        f.max_position_embeddings = f.seq_length
    if f.seq_length > f.max_position_embeddings:
        raise ConfigError(f"--seq-length {f.seq_length} exceeds "
                          f"--max-position-embeddings {f.max_position_embeddings}")
    if f.use_flash_attn:
        if f.attention_backend not in ("auto", "flash"):
            raise ConfigError(f"--use-flash-attn means --attention-backend flash, but "
                              f"--attention-backend {f.attention_backend} is given: keep one")
        f.attention_backend = "flash"


def check_batch(f: Flags, dp: int) -> None:
    per_step = f.micro_batch_size * dp
    if f.global_batch_size is None:
        f.global_batch_size = per_step
    if f.global_batch_size % per_step:
        raise ConfigError(
            f"--global-batch-size {f.global_batch_size} is not a multiple of "
            f"--micro-batch-size {f.micro_batch_size} x data-parallel size {dp} "
            f"(= {per_step})")
    if f.rampup_batch_size is None:
        return
    if len(f.rampup_batch_size) != 3:
        raise ConfigError(f"--rampup-batch-size takes three numbers START INCR SAMPLES, got "
                          f"{' '.join(map(str, f.rampup_batch_size))}")
    start, incr, samples = f.rampup_batch_size
    if start < 1 or incr < 1 or samples < 0:
        raise ConfigError("--rampup-batch-size START INCR SAMPLES needs START >= 1, "
                          "INCR >= 1 and SAMPLES >= 0")
    for name, value in (("START", start), ("INCR", incr)):
        if value % per_step:
            raise ConfigError(
                f"--rampup-batch-size {name} {value} is not a multiple of --micro-batch-size "
                f"{f.micro_batch_size} x data-parallel size {dp} (= {per_step}): every "
                f"batch of the ramp must split evenly over the ranks")
    if start > f.global_batch_size or (f.global_batch_size - start) % incr:
        raise ConfigError(
            f"--rampup-batch-size: --global-batch-size {f.global_batch_size} must be START "
            f"{start} plus a whole number of INCR {incr}")


def stage_split(f: Flags) -> StageSplit:
    """The layers of every pipeline stage and chunk the flags ask for
    (:func:`hybrid.config.stage_split.split_layers`; its errors name the flags)."""
    return split_layers(
        f.num_layers, f.pipeline_model_parallel_size, f.virtual_pipeline_model_parallel_size,
        layers_per_virtual_stage=f.num_layers_per_virtual_pipeline_stage,
        first=f.decoder_first_pipeline_num_layers, last=f.decoder_last_pipeline_num_layers,
        account_for_embedding=f.account_for_embedding_in_pipeline_split,
        account_for_loss=f.account_for_loss_in_pipeline_split,
        layout=f.pipeline_model_parallel_layout)


def check_pipeline(f: Flags, dp: int) -> None:
    """The stage split (Megatron's flags; every layer on a stage, every stage with what
    Megatron requires), the virtual size it implies, the schedule, and the micro-batches an
    interleaved schedule can use. Fills the virtual size (1 without interleaving) and the
    schedule (interleaved 1F1B exactly when the virtual size is above 1)."""
    pp = f.pipeline_model_parallel_size
    if pp == 1:
        for name in ("decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers"):
            if getattr(f, name) is not None:
                raise ConfigError(f"{flag_name(name)} sets the layers of one pipeline stage: it "
                                  f"needs --pipeline-model-parallel-size > 1")
        if f.pipeline_reshard_after_micro_batch:
            raise ConfigError("--pipeline-reshard-after-micro-batch frees ZeRO-3's parameters "
                              "between a pipeline step's micro-batches: it needs "
                              "--pipeline-model-parallel-size > 1")
        if "pipeline_schedule" in f.explicit_flags:  # a plain run would ignore it, silently
            raise ConfigError(f"--pipeline-schedule {f.pipeline_schedule} orders the micro-"
                              f"batches of pipeline stages: it needs "
                              f"--pipeline-model-parallel-size > 1")
    split = stage_split(f)
    # the flag that made the chunks, for the messages below
    source = ("--pipeline-model-parallel-layout" if f.pipeline_model_parallel_layout
              else "--num-layers-per-virtual-pipeline-stage"
              if f.num_layers_per_virtual_pipeline_stage is not None
              else "--virtual-pipeline-model-parallel-size")
    if split.vpp > 1 and pp == 1:
        raise ConfigError(f"{source} makes {split.vpp} model chunks per pipeline rank, which "
                          f"interleave over the stages: it needs --pipeline-model-parallel-size "
                          f"> 1")
    f.virtual_pipeline_model_parallel_size = split.vpp
    schedule, given = f.pipeline_schedule, "pipeline_schedule" in f.explicit_flags
    if split.vpp > 1:
        if schedule != "interleaved_1f1b" and (schedule != "1f1b" or given):
            raise ConfigError(f"--pipeline-schedule {schedule} runs one model chunk per stage, "
                              f"but {source} makes {split.vpp}: use interleaved_1f1b (or "
                              f"leave --pipeline-schedule out)")
        f.pipeline_schedule = "interleaved_1f1b"
        _check_interleaved_micro_batches(f, dp, source)
    elif schedule == "interleaved_1f1b":
        raise ConfigError("--pipeline-schedule interleaved_1f1b needs more than one model "
                          "chunk per stage: set --virtual-pipeline-model-parallel-size, "
                          "--num-layers-per-virtual-pipeline-stage or a "
                          "--pipeline-model-parallel-layout with more stages than PP")


def _check_interleaved_micro_batches(f: Flags, dp: int, source: str) -> None:
    """Interleaved 1F1B takes the micro-batches in groups of PP (Megatron's default group
    size): a step's count, and every count of a batch ramp-up, is a multiple of PP."""
    pp, per_step = f.pipeline_model_parallel_size, f.micro_batch_size * dp
    assert f.global_batch_size is not None  # (check_batch filled it)
    counts = [("the", f.global_batch_size, "--global-batch-size")]
    if f.rampup_batch_size is not None:
        start, incr, _ = f.rampup_batch_size
        counts += [("--rampup-batch-size START's", start, "START"),
                   ("--rampup-batch-size INCR's", incr, "INCR")]
    for whose, batch, name in counts:
        if (batch // per_step) % pp:
            raise ConfigError(
                f"{source} (interleaved 1F1B) runs the micro-batches in groups of "
                f"--pipeline-model-parallel-size {pp}: {whose} {batch // per_step} "
                f"micro-batches per step ({name} {batch} / (--micro-batch-size "
                f"{f.micro_batch_size} x data-parallel size {dp})) must be a multiple of {pp}")


def check_schedule(f: Flags) -> None:
    """Resolve Megatron's iteration- or sample-based schedule (one of the two)."""
    iters_flags = [n for n in ("lr_decay_iters",) if getattr(f, n) is not None]
    iters_flags += ["lr_warmup_iters"] if f.lr_warmup_iters else []
    sample_flags = [n for n in ("lr_decay_samples",) if getattr(f, n) is not None]
    sample_flags += ["lr_warmup_samples"] if f.lr_warmup_samples else []
    if f.train_samples is not None:
        if f.train_iters is not None:
            raise ConfigError("--train-iters and --train-samples are exclusive: keep one")
        if iters_flags:
            raise ConfigError(f"{flag_name(iters_flags[0])} counts iterations, but the run "
                              f"is sample-based (--train-samples): use the -samples form")
    else:
        if sample_flags:
            raise ConfigError(f"{flag_name(sample_flags[0])} counts samples: it needs "
                              f"--train-samples (or use the -iters form)")
        if f.train_iters is None:
            f.train_iters = DEFAULT_TRAIN_ITERS
    if f.lr_warmup_fraction is not None and (f.lr_warmup_iters or f.lr_warmup_samples):
        raise ConfigError("--lr-warmup-fraction and --lr-warmup-iters/-samples are "
                          "exclusive: keep one")
    if f.min_lr > f.lr:
        raise ConfigError(f"need --min-lr ({f.min_lr}) <= --lr ({f.lr})")
    if f.lr_warmup_init > f.lr:
        raise ConfigError(f"need --lr-warmup-init ({f.lr_warmup_init}) <= --lr ({f.lr})")
    if f.train_samples is None and f.lr_decay_iters is None:
        f.lr_decay_iters = f.train_iters
    if f.train_samples is not None and f.lr_decay_samples is None:
        f.lr_decay_samples = f.train_samples
    unit = "samples" if f.train_samples is not None else "iters"
    warmup, decay = getattr(f, f"lr_warmup_{unit}"), getattr(f, f"lr_decay_{unit}")
    if warmup > decay:  # the rate would still be rising when the decay is over
        raise ConfigError(f"--lr-warmup-{unit} {warmup} exceeds --lr-decay-{unit} {decay} "
                          f"(the decay length; --train-{unit} by default): warm up for "
                          f"fewer, or decay over more")


def check_zero(f: Flags) -> None:
    if f.use_distributed_optimizer and f.zero_stage == 0:
        f.zero_stage = 1  # Megatron's distributed optimizer shards the optimizer states
    f.overlap_comm = f.overlap_comm or f.overlap_grad_reduce or f.overlap_param_gather
    if f.bf16 and f.fp16:
        raise ConfigError("--bf16 and --fp16 are exclusive: pick one")
    check_offload(f)
    if f.offload_delayed_update and not f.offload_optimizer:
        raise ConfigError("--offload-delayed-update delays the host optimizer step: it needs "
                          "--offload-optimizer")
    if f.offload_delayed_update_warmup and not f.offload_delayed_update:
        raise ConfigError("--offload-delayed-update-warmup needs --offload-delayed-update")
    if f.accumulate_allreduce_grads_in_fp32 is None:
        f.accumulate_allreduce_grads_in_fp32 = f.bf16


def check_offload(f: Flags) -> None:
    """The offload tiers (their spellings made canonical by :func:`canonical_offload`): what
    each needs, and constant-size staging that makes sense."""
    if f.offload_optimizer and f.zero_stage == 0:
        raise ConfigError("--offload-optimizer needs --zero-stage 1, 2 or 3")
    if f.offload_param and f.zero_stage != 3:
        raise ConfigError(f"--offload-param {f.offload_param} offloads stage 3's parameter "
                          f"shards: it needs --zero-stage 3 (got --zero-stage {f.zero_stage})")
    if f.offload_param and not f.offload_optimizer:
        # an offloaded unit's gradient goes to the host as its reduction finishes; the
        # optimizer step that reads it runs there too
        raise ConfigError(f"--offload-param {f.offload_param} needs --offload-optimizer (cpu "
                          f"or nvme): the gradients of offloaded parameters are kept on "
                          f"the host, where the optimizer step reads them")
    if f.offload_gds and f.offload_param != "nvme":
        raise ConfigError("--offload-gds reads stage 3 parameter shards from disk into device "
                          "memory: it needs --offload-param nvme (got "
                          f"{f.offload_param or 'none'})")
    if "nvme" in (f.offload_optimizer, f.offload_param) and not f.offload_nvme_path:
        raise ConfigError("the nvme offload tier needs --offload-nvme-path DIR (a directory "
                          "on a local disk; each rank uses its own subdirectory)")
    if f.offload_nvme_path and "nvme" not in (f.offload_optimizer, f.offload_param):
        raise ConfigError("--offload-nvme-path is only used with --offload-optimizer nvme or "
                          "--offload-param nvme")
    # [Note: what starts before the step] in hybrid/zero/offload/host_step.py: only the
    # nvme tier under a pipeline has read-ahead tiles to update, and the delayed update
    # reads its tiles during the next step (nothing before it to speculate on)
    applies = f.offload_optimizer == "nvme" and f.pipeline_model_parallel_size > 1
    if f.offload_speculative_step and f.offload_delayed_update:
        raise ConfigError("--offload-speculative-step updates the read-ahead tiles before "
                          "the step; --offload-delayed-update runs the step during the next "
                          "iteration: drop one")
    if f.offload_speculative_step and not applies:
        raise ConfigError("--offload-speculative-step needs --offload-optimizer nvme and "
                          "--pipeline-model-parallel-size > 1 (a stage's read-ahead tiles)")
    if f.offload_speculative_step is None:
        f.offload_speculative_step = applies and not f.offload_delayed_update
    if f.offload_buffer_size < 1024 or f.offload_buffer_size % 1024:
        raise ConfigError(f"--offload-buffer-size must be a positive multiple of 1024 "
                          f"elements (direct I/O moves 4096-byte blocks), got "
                          f"{f.offload_buffer_size}")


def check_recompute(f: Flags) -> None:
    """Resolve Megatron's recompute flags into granularity + method + layers."""
    g = f.recompute_granularity
    for name, implied in (("recompute_activations", "selective"),
                          ("checkpoint_activations", "full")):
        if getattr(f, name):
            if g not in (None, implied):
                raise ConfigError(f"{flag_name(name)} means --recompute-granularity {implied}, "
                                  f"but --recompute-granularity {g} is given: keep one")
            g = implied
    f.recompute_granularity = g
    if g != "full" and (f.recompute_method or f.recompute_num_layers is not None):
        raise ConfigError("--recompute-method and --recompute-num-layers need "
                          "--recompute-granularity full")
    if f.recompute_num_layers is not None and not 1 <= f.recompute_num_layers <= f.num_layers:
        raise ConfigError(f"--recompute-num-layers must be in [1, --num-layers "
                          f"{f.num_layers}], got {f.recompute_num_layers}")
    if g == "full" and f.recompute_method is None:
        f.recompute_method = "block" if f.recompute_num_layers else "uniform"
    for name in ("partition_activations", "cpu_checkpointing", "contiguous_checkpointing"):
        if getattr(f, name) and g != "full":
            raise ConfigError(f"{flag_name(name)} needs --recompute-granularity full (it "
                              f"handles whole-layer checkpoints)")


def check_data(f: Flags) -> None:
    """The tokenizer (Megatron's names or hybrid's older ones) and its files; where the
    data comes from (one kind of source)."""
    parts = f.split.replace("/", ",").split(",")
    try:
        weights = [float(x) for x in parts]
    except ValueError:
        weights = []
    if (len(weights) != 3 or not all(0 <= w < math.inf for w in weights)
            or sum(weights) <= 0):
        raise ConfigError(f"--split {f.split!r} must be three non-negative numbers "
                          f"train,valid,test (e.g. 949,50,1)")
    if f.tokenizer_type is None:  # Megatron scripts give GPT-2's files without a type
        f.tokenizer_type = "GPT2BPETokenizer" if f.vocab_file and f.merge_file else "byte"
    t = f.tokenizer_type
    kind = tokenizer_kind(t)  # (a name check_fields let through)
    if kind == "GPT2BPETokenizer" and not (f.vocab_file and f.merge_file):
        raise ConfigError(f"--tokenizer-type {t} needs --vocab-file and --merge-file")
    if kind == "HuggingFaceTokenizer" and not (f.tokenizer_model or f.tokenizer_file):
        raise ConfigError(f"--tokenizer-type {t} needs --tokenizer-model (a tokenizer "
                          f"directory or tokenizer.json)")
    if kind == "NullTokenizer" and f.vocab_size is None:
        raise ConfigError(f"--tokenizer-type {t} needs --vocab-size")
    per_split = [n for n in ("train_data_path", "valid_data_path", "test_data_path")
                 if getattr(f, n)]
    if per_split:
        given = " ".join(flag_name(n) for n in per_split)
        if f.data_path:
            raise ConfigError(f"{given} and --data-path are exclusive: give each split its "
                              f"files, or one --data-path cut by --split")
        if f.split != Flags.split:
            raise ConfigError(f"--split {f.split} cuts --data-path; with {given} each "
                              f"split has its own files: drop --split")
        if not f.train_data_path:
            raise ConfigError(f"{given} needs --train-data-path")
    if f.mock_data and (f.data_path or per_split):
        raise ConfigError("--mock-data trains on synthetic tokens and reads no files: drop "
                          + " ".join(["--data-path"] * bool(f.data_path)
                                     + [flag_name(n) for n in per_split]))


def check_checkpoint(f: Flags) -> None:
    if f.load and os.path.isfile(f.load):
        raise ConfigError(_load_is_a_file(f.load))
    if f.save_interval is not None and not f.save:
        raise ConfigError("--save-interval needs --save DIR")
    if f.no_save_optim and not f.save:
        raise ConfigError("--no-save-optim needs --save DIR")
    if f.overwrite_save and not f.save:
        raise ConfigError("--overwrite-save needs --save DIR")
    for name in ("no_load_optim", "no_load_rng", "finetune", "ckpt_step"):
        if getattr(f, name) not in (None, False) and not f.load:
            raise ConfigError(f"{flag_name(name)} needs --load DIR (the checkpoint to "
                              f"start from)")


def _load_is_a_file(path: str) -> str:
    """--load names a file: what it takes instead, and the directory the file belongs to
    when that is a run's checkpoints (a file of one ``iter_*`` checkpoint, or 'latest')."""
    parent = os.path.dirname(os.path.abspath(path))
    if os.path.isfile(os.path.join(parent, "metadata.json")):  # inside iter_NNNNNNN/
        parent = os.path.dirname(parent)
    looks = os.path.isfile(os.path.join(parent, "latest")) or any(
        os.path.isfile(os.path.join(parent, d, "metadata.json"))
        for d in _listdir(parent) if d.startswith("iter_"))
    hint = f"; did you mean --load {parent}?" if looks else ""
    return (f"--load {path} is a file; --load takes the directory a run saved into with "
            f"--save (it holds 'latest' and the iter_* checkpoints){hint}")


def _data_dir_message(flag: str, path: str) -> str:
    """A data flag naming a directory: what it takes, and the prefix of preprocessed data
    found in it, if any (one directory listing)."""
    prefixes = sorted({name[:-4] for name in _listdir(path) if name.endswith((".idx", ".bin"))})
    hint = (f"; did you mean {flag} {os.path.join(path, prefixes[0])}"
            + (f" (one of {len(prefixes)} there)" if len(prefixes) > 1 else "") + "?"
            if prefixes else "")
    return (f"{flag} {path} is a directory; give a text file, or the prefix of "
            f"preprocessed data (PREFIX for PREFIX.bin and PREFIX.idx){hint}")


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def check_data_paths(f: Flags) -> None:
    """A directory given where data files are wanted: said at the launcher's preflight,
    not by every worker once the process groups exist."""
    for name in ("data_path", "train_data_path", "valid_data_path", "test_data_path"):
        for item in getattr(f, name) or ():
            # (a prefix may share its name with a directory: data/ beside data.bin)
            if (os.path.isdir(item) and not os.path.isfile(item + ".idx")
                    and not os.path.isfile(item + ".bin")):
                raise ConfigError(_data_dir_message(flag_name(name), item))


# Flags naming a directory the run writes into (created when missing).
OUTPUT_DIRS = ("save", "tensorboard_dir", "data_cache_path", "collective_dump_dir",
               "kernel_cache_dir")


def check_output_dirs(f: Flags) -> None:
    """A directory flag naming an existing file: said now, not when the first write fails
    (for the dump directory, only once a collective has already failed)."""
    for name in OUTPUT_DIRS:
        path = getattr(f, name)
        if path and os.path.exists(path) and not os.path.isdir(path):
            raise ConfigError(f"{flag_name(name)} {path} is a file; give a directory")
