"""The training loop, and the one module that composes all the others.

One iteration, data flowing one way::

    this DP rank's micro-batches -> GPT (TP layers) -> loss / n_micro -> backward
    (ZeRO hooks reduce grads over DP in buckets) -> unscale, clip by the global
    norm -> AdamW on this rank's shard -> all-gather params -> metrics
"""

from __future__ import annotations

import contextlib
import resource
import time
from dataclasses import dataclass

import torch

from hybrid.checkpoint import save_checkpoint
from hybrid.checkpoint.resume import start_from_checkpoint
from hybrid.config import TrainConfig
from hybrid.config.architecture import ARCHITECTURE_FIELDS
from hybrid.config.sections import LoopConfig, RecomputeConfig
from hybrid.data.dataset import build_datasets, dp_micro_batches
from hybrid.data.tokenizer import build_tokenizer
from hybrid.errors import ConfigError, TrainingError
from hybrid.kernels.attention import check_attention_backend
from hybrid.kernels.dtypes import DTYPES
from hybrid.kernels.select import low_precision_warning
from hybrid.parallel.agree import agree_error, max_over_ranks
from hybrid.parallel.layout import padded_vocab_size
from hybrid.parallel.state import ParallelState
from hybrid.recompute.checkpointing import apply_activation_checkpointing
from hybrid.tensor_parallel import InitValues, TPRNGTracker, seed_all
from hybrid.train import nonfinite
from hybrid.train.activation_meter import SavedActivationMeter
from hybrid.train.batches import finished, global_batch_size_at, total_iterations
from hybrid.train.compile import compile_blocks
from hybrid.train.early_exit import EarlyExit
from hybrid.train.host_memory import return_freed_memory
from hybrid.train.lr_schedule import scheduled_lr
from hybrid.train.monitor import Monitor, log
from hybrid.train.replicas import ReplicaChecker
from hybrid.train.step_stats import IterationTimer, PendingSteps
from hybrid.train.stragglers import straggler_fields
from hybrid.zero import ZeroEngine, apply_zero
from models.gpt import GPT, GPTConfig


@dataclass
class TrainState:
    """Where a run is: everything the loop needs to continue besides the weights."""

    iteration: int = 0
    consumed_samples: int = 0


def gpt_config(cfg: TrainConfig, vocab_size: int) -> GPTConfig:
    m, p = cfg.model, cfg.parallel
    return GPTConfig(
        vocab_size=vocab_size,
        padded_vocab_size=padded_vocab_size(vocab_size, m.make_vocab_size_divisible_by,
                                            p.tensor_model_parallel_size),
        num_layers=m.num_layers, hidden_size=m.hidden_size,
        num_attention_heads=m.num_attention_heads,
        max_position_embeddings=m.max_position_embeddings,
        ffn_hidden_size=m.ffn_hidden_size, hidden_dropout=m.hidden_dropout,
        attention_dropout=m.attention_dropout, init_std=m.init_method_std,
        sequence_parallel=p.sequence_parallel, attention_backend=m.attention_backend,
        **{k: getattr(m, k) for k in ARCHITECTURE_FIELDS})


def build_model(cfg: TrainConfig, ps: ParallelState, vocab_size: int,
                rng: TPRNGTracker, device: torch.device | str | None = None) -> GPT:
    """The GPT on ``device`` (default ``ps.device``), initialized from ``--seed``;
    on "meta" only its shapes (ZeRO materializes it: see :func:`build_engine`)."""
    return GPT(gpt_config(cfg, vocab_size), ps.tp_group, rng=rng, seed=cfg.seed,
               device=device or ps.device)


def recompute_targets(model: GPT, rc: RecomputeConfig) -> list[torch.nn.Module]:
    """The modules activation checkpointing wraps: whole blocks (full granularity;
    the first ``rc.num_layers`` with Megatron's block method) or every block's
    attention core (selective: only scores, softmax and dropout are rerun)."""
    if rc.granularity == "selective":
        return [block.attn.core for block in model.blocks]
    return list(model.blocks)[: rc.num_layers or len(model.blocks)]


def build_engine(cfg: TrainConfig, ps: ParallelState, vocab_size: int, rng: TPRNGTracker):
    """(model, activation checkpointing handle or None, ZeRO engine).

    The model is built on the meta device and ZeRO draws only what this rank
    keeps from the block-seeded init: no rank ever holds the whole model.
    """
    m = cfg.model
    check_attention_backend(m.attention_backend, ps.device, DTYPES[cfg.precision.params_dtype],
                            m.hidden_size // m.num_attention_heads, m.attention_dropout)
    model = build_model(cfg, ps, vocab_size, rng, device="meta")
    model.train()
    rc = cfg.recompute
    ac = (apply_activation_checkpointing(model, ps, rng, rc, blocks=recompute_targets(model, rc))
          if rc.granularity else None)
    engine = apply_zero(model, ps, cfg.zero, adamw=cfg.adamw, precision=cfg.precision,
                        offload=cfg.offload, values=InitValues(cfg.seed, model.init_of),
                        recompute=ac.phase if ac is not None else None)
    if cfg.model.compile:
        compile_blocks(model.blocks)
    return model, ac, engine


# [Note: host memory on CPU runs] glibc keeps freed activation blocks once its mmap
# threshold has grown: ~0.6 GB per rank for a 302M GPT (hybrid/train/host_memory.py).
# A fixed 1 MiB threshold returns them, at the price of a page fault per large
# allocation: a few percent of a step at that size, but 2.7x the step of the
# 4-layer x 256 default (sys time 17 s against 3 s over 50 steps). So only
# models of this many parameters per TP rank and up get it.
HOST_TRIM_MIN_PARAMS = 100_000_000


def train_step(model: GPT, engine: ZeroEngine, micro_batches, lr: float,
               meter: SavedActivationMeter | None = None):
    """One optimizer step over this rank's micro-batches; returns (local loss, StepResult,
    the ``(n,)`` micro-batch losses).

    Each micro-batch loss is a mean over its tokens; dividing by the number of
    micro-batches makes the accumulated gradient that of the mean over this
    rank's share, and the DP average makes it the global batch's. ``meter``
    measures the first micro-batch's forward and backward. A non-finite loss
    skips the step even if the gradients are finite.
    """
    engine.zero_grad()
    n = len(micro_batches)
    total, losses = None, []
    for i, batch in enumerate(micro_batches):  # (tokens, labels[, loss mask])
        with meter if (meter is not None and i == 0) else contextlib.nullcontext():
            loss = model(*batch) / n
            engine.backward(loss, sync=(i == n - 1))
        losses.append(loss.detach().float())
        total = losses[-1] if total is None else total + losses[-1]
    return total, engine.step(lr, loss=total), torch.stack(losses)


def _nan_guard(skipped: bool, scaler, streak: int, limit: int, iteration: int,
               why: str = "") -> int:
    """Count consecutive steps skipped for a non-finite loss or gradients; stop past the
    limit (``why``: what the last one found, see :mod:`hybrid.train.nonfinite`).

    fp16 overflows while the dynamic scale is still coming down are normal and
    do not count; at the minimum scale (or without fp16) they do.
    """
    if not skipped:
        return 0
    if _scale_coming_down(scaler):
        return streak
    streak += 1
    if streak >= limit:
        raise TrainingError(
            f"loss or gradients were not finite for {streak} consecutive iterations (up to "
            f"{iteration}; at {iteration}: {why}); stopping without saving. Lower --lr, raise "
            f"--clip-grad's strictness, or check the data (--exit-on-nan-iterations sets the "
            f"patience)")
    return streak


def _scale_coming_down(scaler) -> bool:
    """An fp16 overflow with room left to lower the dynamic loss scale: routine."""
    return scaler.dynamic and scaler.scale > scaler.min_scale


@torch.no_grad()
def evaluate(model: GPT, samples, s: LoopConfig, ps: ParallelState,
             eod: int | None = None) -> float:
    """Mean loss over ``--eval-iters`` full global batches from the start of
    ``samples`` (the same batches every time, so evaluations compare), averaged
    over DP."""
    model.eval()
    total = torch.zeros((), device=ps.device)
    count = 0
    for k in range(s.eval_iters):
        for batch in dp_micro_batches(samples, k * s.global_batch_size, s.global_batch_size,
                                      s.micro_batch_size, ps.dp_rank, ps.dp_size, ps.device,
                                      eod):
            total += model(*batch).float()
            count += 1
    model.train()
    ps.dp_group.all_reduce(total)
    return float(total) / (count * ps.dp_size)


def _memory(ps: ParallelState) -> tuple[int, int]:
    """(bytes held now, peak so far): allocated device memory on CUDA, RSS on the CPU."""
    if ps.device.type == "cuda":
        return (torch.cuda.memory_allocated(ps.device),
                torch.cuda.max_memory_allocated(ps.device))
    with open("/proc/self/statm", encoding="ascii") as f:
        now = int(f.read().split()[1]) * resource.getpagesize()
    return now, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def pretrain(cfg: TrainConfig, ps: ParallelState) -> list[dict]:
    """Train until ``--train-iters`` or ``--train-samples`` (or an exit flag);
    return the logged metrics (rank 0's view)."""
    s, lg, ck = cfg.loop, cfg.logging, cfg.checkpoint
    started = time.monotonic()
    rng = seed_all(cfg.seed, ps.tp_rank, ps.dp_rank, ps.device)
    tokenizer = build_tokenizer(cfg.tokenizer)
    data = build_datasets(cfg.data, tokenizer, ps)
    psi = gpt_config(cfg, tokenizer.vocab_size).num_parameters(ps.tp_size)
    if ps.device.type == "cpu" and psi >= HOST_TRIM_MIN_PARAMS:
        return_freed_memory()  # the model lives in host memory: keep RSS to what is used
    before_model = _memory(ps)[0]  # the process without the model: runtime, data
    try:
        model, ac, engine = build_engine(cfg, ps, tokenizer.vocab_size, rng)
    except RuntimeError as e:  # torch.OutOfMemoryError is one too; CPU says "allocate"
        if not isinstance(e, torch.OutOfMemoryError) and "allocate" not in str(e):
            raise
        pv = padded_vocab_size(tokenizer.vocab_size, cfg.model.make_vocab_size_divisible_by,
                               ps.tp_size)
        raise TrainingError(f"the model ({psi:,} parameters on each TP rank, padded vocabulary "
                            f"{pv:,}) does not fit in memory: check --hidden-size, --num-layers, "
                            f"--make-vocab-size-divisible-by, --max-position-embeddings") from e
    diag = cfg.diagnostics
    ps.recorder.configure(diag.collective_dump_dir, diag.check_collectives)
    replicas = ReplicaChecker(model, engine, ps) if diag.check_replicas_interval else None

    state = TrainState()
    # --load with --no-load-optim / --no-load-rng / --finetune (hybrid/checkpoint/resume.py)
    start = start_from_checkpoint(ck, engine, ps, cfg, rng, tokenizer.vocab_size)
    if start is not None:
        state.iteration, state.consumed_samples = start.iteration, start.consumed_samples
    setup_peak = _memory(ps)[1]
    monitor = Monitor(ps.rank, lg.log_json, lg.tensorboard_dir, append=state.iteration > 0,
                      log_throughput=lg.log_throughput)
    error = agree_error(ps, monitor.error)  # rank 0 opened the logs: every rank hears
    if error:
        monitor.close()
        raise ConfigError(error)
    log.info("layout: %s", ps.describe())
    log.info("parameters: %d on each TP rank, %d in the model (TP %d, padded vocab %d); "
             "train samples per epoch: %d", model.cfg.num_parameters(ps.tp_size),
             model.cfg.num_parameters(), ps.tp_size, model.cfg.padded_vocab_size,
             len(data["train"]))
    log.info("config: %s", cfg.to_dict())
    if cfg.flags.ignored_megatron_flags:
        log.info("Megatron flags with no effect here (they pick Megatron's own kernels or "
                 "internals): %s", " ".join(cfg.flags.ignored_megatron_flags))
    slow = low_precision_warning(cfg.precision.params_dtype, ps.device)
    if slow and ps.rank == 0:  # one line for the job
        log.warning("warning: %s", slow)

    def save():
        path = save_checkpoint(ck.save, state.iteration, state.consumed_samples, engine, ps,
                               cfg, rng, ck.keep_last, tokenizer.vocab_size,
                               optimizer=not ck.no_save_optim,
                               finetune=start.finetune if start is not None else None)
        log.info("saved checkpoint %s", path)

    eod = tokenizer.eod if cfg.data.eod_mask_loss else None  # (hybrid/data/dataset.py)

    def run_eval(split):
        if data[split] is not None and s.eval_iters > 0:
            monitor.log_eval(state.iteration, split, evaluate(model, data[split], s, ps, eod))

    train_iters = total_iterations(s)
    flops_per_token = model.cfg.flops_per_token(cfg.model.seq_length)
    history, loss_acc, n_acc = [], torch.zeros((), device=ps.device), 0
    tokens_acc = 0
    waited = 0.0  # time blocked in collectives within iterations (stragglers.py: busy time)
    meter = SavedActivationMeter(extra=ac.stored_bytes if ac is not None else lambda: 0)
    skipped, nan_streak, saved_at = 0, 0, state.iteration
    # no host wait per iteration: see hybrid/train/step_stats.py, [Note: one wait per log interval]
    timer, pending = IterationTimer(ps.device), PendingSteps()

    held = {}  # iteration -> (micro-batch losses, first sample, global batch) until settled

    def settle(force: bool) -> None:
        nonlocal skipped, nan_streak
        for it, _, was_skipped in pending.settle(force):
            skipped += int(was_skipped)
            losses, first, size = held.pop(it)
            why = ""
            # Say why a step was skipped -- only steps already known non-finite pay for
            # it, and not fp16's routine overflows while the dynamic scale comes down.
            # The gradients are still those of the newest step only.
            if was_skipped and not _scale_coming_down(engine.scaler):
                why = nonfinite.explain(model, engine, ps, losses, first, size,
                                        s.micro_batch_size, grads_held=it == state.iteration)
                if ps.rank == 0:
                    log.warning("iteration %d skipped (loss scale now %.1f): %s", it,
                                engine.scaler.scale, why)
            nan_streak = _nan_guard(was_skipped, engine.scaler, nan_streak,
                                    s.exit_on_nan_iterations, it, why)
        if force:
            engine.poll_warnings()

    early = EarlyExit(s, ps, started)  # --exit-interval / -duration-in-mins / -signal-handler
    try:
        while not finished(s, state.iteration, state.consumed_samples):
            timer.start()
            waited_from = ps.comm_stats.wait_s
            batch = global_batch_size_at(s, state.consumed_samples)
            lr = scheduled_lr(cfg.lr_schedule, state.iteration + 1,
                              state.consumed_samples + batch)
            batches = dp_micro_batches(data["train"], state.consumed_samples, batch,
                                       s.micro_batch_size, ps.dp_rank, ps.dp_size, ps.device,
                                       eod)
            comm_before = ps.comm_stats.snapshot()
            last = finished(s, state.iteration + 1, state.consumed_samples + batch)
            logs = (state.iteration + 1) % lg.log_interval == 0 or last
            loss, result, losses = train_step(model, engine, batches, lr,
                                              meter if logs else None)
            comm = {k: v - comm_before[k] for k, v in ps.comm_stats.snapshot().items()}
            state.iteration += 1
            state.consumed_samples += batch
            timer.stop()
            waited += ps.comm_stats.wait_s - waited_from
            pending.add(state.iteration, result)
            held[state.iteration] = (losses, state.consumed_samples - batch, batch)
            save_due = bool(ck.save and ck.save_interval
                            and state.iteration % ck.save_interval == 0)
            settle(force=logs or save_due)
            loss_acc += loss
            n_acc += 1
            tokens_acc += batch * cfg.model.seq_length
            if logs:
                ps.dp_group.all_reduce(loss_acc)  # mean over DP replicas, once per log line
                time_acc = timer.elapsed_s()
                step_time = time_acc / n_acc
                m = {"iteration": state.iteration, "train_iters": train_iters,
                     "consumed_samples": state.consumed_samples, "global_batch_size": batch,
                     "loss": float(loss_acc) / (n_acc * ps.dp_size), "lr": lr,
                     "grad_norm": float(result.grad_norm), "loss_scale": result.loss_scale,
                     "skipped_iterations": skipped, "step_time_s": step_time,
                     "tokens_per_sec": tokens_acc / time_acc,
                     "tflops_per_rank": flops_per_token * tokens_acc / time_acc
                     / ps.world_size / 1e12,
                     # memory: the largest rank's (one tiny all-reduce per log line)
                     **dict(zip(("peak_memory_bytes", "setup_peak_memory_bytes",
                                 "memory_before_model_bytes"),
                                map(int, max_over_ranks(ps, [_memory(ps)[1], setup_peak,
                                                             before_model])))),
                     "model_state_bytes": engine.model_state_bytes(), "comm_bytes": comm,
                     # saved for backward by this rank's first micro-batch, measured
                     "activation_bytes": meter.peak,
                     # slowest / fastest rank (one tiny all-gather per log line)
                     **straggler_fields(ps, step_time, (time_acc - waited) / n_acc)}
                if ac is not None:
                    m["activation_checkpoint_bytes"] = ac.peak_bytes()
                    ac.reset_peak()
                monitor.log_iteration(m)
                history.append(m)
                loss_acc.zero_()
                n_acc, tokens_acc, waited = 0, 0, 0.0
            if replicas is not None and state.iteration % diag.check_replicas_interval == 0:
                replicas.check(state.iteration)
            if s.eval_interval and state.iteration % s.eval_interval == 0:
                run_eval("valid")
            clean = nan_streak == 0  # never save a step that went non-finite
            if save_due and clean:
                save()
                saved_at = state.iteration
            why = early.reason(state.iteration)
            if why:
                log.info("exiting at iteration %d: %s", state.iteration, why)
                break
        settle(force=True)
        if ck.save and saved_at != state.iteration:
            save()
        if finished(s, state.iteration, state.consumed_samples):
            run_eval("test")
    finally:
        early.close()
        monitor.close()
    return history
