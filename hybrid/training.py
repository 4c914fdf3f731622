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

from hybrid.activation_checkpointing import apply_activation_checkpointing
from hybrid.activation_meter import SavedActivationMeter
from hybrid.checkpoint import load_checkpoint, save_checkpoint
from hybrid.config import TrainConfig, padded_vocab_size
from hybrid.config_sections import RecomputeConfig
from hybrid.data.dataset import build_datasets, dp_micro_batches
from hybrid.data.tokenizer import build_tokenizer
from hybrid.errors import TrainingError
from hybrid.host_memory import return_freed_memory
from hybrid.kernels.cpu_features import low_precision_warning
from hybrid.lr_schedule import learning_rate
from hybrid.monitor import Monitor, log
from hybrid.parallel_state import ParallelState
from hybrid.tensor_parallel import InitValues, TPRNGTracker, seed_all
from hybrid.zero import ZeroEngine, apply_zero
from models.gpt import GPT, GPTConfig


@dataclass
class TrainState:
    """Where a run is: everything the loop needs to continue besides the weights."""

    iteration: int = 0
    consumed_samples: int = 0


def gpt_config(cfg: TrainConfig, vocab_size: int) -> GPTConfig:
    return GPTConfig(
        vocab_size=vocab_size,
        padded_vocab_size=padded_vocab_size(vocab_size, cfg.make_vocab_size_divisible_by,
                                            cfg.tensor_model_parallel_size),
        num_layers=cfg.num_layers, hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        ffn_hidden_size=cfg.ffn_hidden_size, hidden_dropout=cfg.hidden_dropout,
        attention_dropout=cfg.attention_dropout, init_std=cfg.init_method_std,
        sequence_parallel=cfg.sequence_parallel)


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
    model = build_model(cfg, ps, vocab_size, rng, device="meta")
    model.train()
    rc = cfg.recompute
    ac = (apply_activation_checkpointing(model, ps, rng, rc, blocks=recompute_targets(model, rc))
          if rc.granularity else None)
    engine = apply_zero(model, ps, cfg.zero, values=InitValues(cfg.seed, model.init_of),
                        recompute=ac.phase if ac is not None else None)
    return model, ac, engine


# [Note: host memory on CPU runs] glibc keeps freed activation blocks once its mmap
# threshold has grown: ~0.6 GB per rank for a 302M GPT (hybrid/host_memory.py).
# A fixed 1 MiB threshold returns them, at the price of a page fault per large
# allocation: a few percent of a step at that size, but 2.7x the step of the
# 4-layer x 256 default (sys time 17 s against 3 s over 50 steps). So only
# models of this many parameters per TP rank and up get it.
HOST_TRIM_MIN_PARAMS = 100_000_000


def _sync(ps: ParallelState) -> None:
    if ps.device.type == "cuda":
        torch.cuda.synchronize(ps.device)


def train_step(model: GPT, engine: ZeroEngine, micro_batches, lr: float,
               meter: SavedActivationMeter | None = None):
    """One optimizer step over this rank's micro-batches; returns (local loss, StepResult).

    Each micro-batch loss is a mean over its tokens; dividing by the number of
    micro-batches makes the accumulated gradient that of the mean over this
    rank's share, and the DP average makes it the global batch's. ``meter``
    measures the first micro-batch's forward and backward.
    """
    engine.zero_grad()
    n = len(micro_batches)
    total = None
    for i, (tokens, labels) in enumerate(micro_batches):
        with meter if (meter is not None and i == 0) else contextlib.nullcontext():
            loss = model(tokens, labels) / n
            engine.backward(loss, sync=(i == n - 1))
        total = loss.detach().float() if total is None else total + loss.detach().float()
    return total, engine.step(lr)


def _nan_guard(result, scaler, streak: int, cfg, iteration: int) -> int:
    """Count consecutive steps skipped for non-finite gradients; stop past the limit.

    fp16 overflows while the dynamic scale is still coming down are normal and
    do not count; at the minimum scale (or without fp16) they do.
    """
    if not result.skipped:
        return 0
    if scaler.dynamic and scaler.scale > scaler.min_scale:
        return streak
    streak += 1
    if streak >= cfg.exit_on_nan_iterations:
        raise TrainingError(
            f"loss or gradients were not finite for {streak} consecutive iterations (up to "
            f"{iteration}); stopping without saving. Lower --lr, raise --clip-grad's "
            f"strictness, or check the data (--exit-on-nan-iterations sets the patience)")
    return streak


@torch.no_grad()
def evaluate(model: GPT, samples, cfg: TrainConfig, ps: ParallelState) -> float:
    """Mean loss over ``--eval-iters`` global batches from the start of ``samples``
    (the same batches every time, so evaluations compare), averaged over DP."""
    model.eval()
    total = torch.zeros((), device=ps.device)
    count = 0
    for k in range(cfg.eval_iters):
        for tokens, labels in dp_micro_batches(samples, k * cfg.global_batch_size,
                                               cfg.global_batch_size, cfg.micro_batch_size,
                                               ps.dp_rank, ps.dp_size, ps.device):
            total += model(tokens, labels).float()
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


def _max_over_ranks(ps: ParallelState, values: list[int]) -> list[int]:
    t = torch.tensor(values, dtype=torch.float64, device=ps.device)
    ps.world_group.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return [int(v) for v in t.tolist()]


def pretrain(cfg: TrainConfig, ps: ParallelState) -> list[dict]:
    """Train for ``cfg.train_iters`` iterations; return the logged metrics (rank 0's view)."""
    rng = seed_all(cfg.seed, ps.tp_rank, ps.dp_rank, ps.device)
    tokenizer = build_tokenizer(cfg)
    data = build_datasets(cfg, tokenizer)
    psi = gpt_config(cfg, tokenizer.vocab_size).num_parameters(ps.tp_size)
    if ps.device.type == "cpu" and psi >= HOST_TRIM_MIN_PARAMS:
        return_freed_memory()  # the model lives in host memory: keep RSS to what is used
    before_model = _memory(ps)[0]  # the process without the model: runtime, data
    model, ac, engine = build_engine(cfg, ps, tokenizer.vocab_size, rng)

    state = TrainState()
    if cfg.load:
        loaded = load_checkpoint(cfg.load, engine, ps, cfg, rng, tokenizer.vocab_size,
                                 allow_empty=cfg.load == cfg.save)
        if loaded is not None:
            state.iteration, state.consumed_samples = loaded
            log.info("resumed from %s at iteration %d (%d samples consumed)", cfg.load,
                     state.iteration, state.consumed_samples)
    setup_peak = _memory(ps)[1]
    monitor = Monitor(ps.rank, cfg.log_json, cfg.tensorboard_dir, append=state.iteration > 0)
    log.info("layout: %s", ps.describe())
    log.info("parameters: %d on each TP rank, %d in the model (TP %d, padded vocab %d); "
             "train samples per epoch: %d", model.cfg.num_parameters(ps.tp_size),
             model.cfg.num_parameters(), ps.tp_size, model.cfg.padded_vocab_size,
             len(data["train"]))
    log.info("config: %s", cfg.to_dict())
    slow = low_precision_warning(cfg.zero.params_dtype, ps.device)
    if slow and ps.rank == 0:  # one line for the job
        log.warning("warning: %s", slow)

    def save():
        path = save_checkpoint(cfg.save, state.iteration, state.consumed_samples, engine, ps,
                               cfg, rng, cfg.keep_last, tokenizer.vocab_size)
        log.info("saved checkpoint %s", path)

    def run_eval(split):
        if data[split] is not None and cfg.eval_iters > 0:
            monitor.log_eval(state.iteration, split, evaluate(model, data[split], cfg, ps))

    tokens_per_iter = cfg.global_batch_size * cfg.seq_length
    flops_per_iter = model.cfg.flops_per_token(cfg.seq_length) * tokens_per_iter
    history, loss_acc, time_acc, n_acc = [], torch.zeros((), device=ps.device), 0.0, 0
    meter = SavedActivationMeter(extra=ac.stored_bytes if ac is not None else lambda: 0)
    skipped, nan_streak, saved_at = 0, 0, state.iteration
    try:
        while state.iteration < cfg.train_iters:
            _sync(ps)
            t0 = time.perf_counter()
            lr = learning_rate(state.iteration + 1, cfg.lr, cfg.min_lr, cfg.lr_warmup_iters,
                               cfg.lr_decay_iters, cfg.lr_decay_style)
            batches = dp_micro_batches(data["train"], state.consumed_samples,
                                       cfg.global_batch_size, cfg.micro_batch_size,
                                       ps.dp_rank, ps.dp_size, ps.device)
            comm_before = ps.comm_stats.snapshot()
            logs = ((state.iteration + 1) % cfg.log_interval == 0
                    or state.iteration + 1 == cfg.train_iters)
            loss, result = train_step(model, engine, batches, lr, meter if logs else None)
            comm = {k: v - comm_before[k] for k, v in ps.comm_stats.snapshot().items()}
            skipped += int(result.skipped)
            state.iteration += 1
            state.consumed_samples += cfg.global_batch_size
            nan_streak = _nan_guard(result, engine.scaler, nan_streak, cfg, state.iteration)
            _sync(ps)
            time_acc += time.perf_counter() - t0
            loss_acc += loss
            n_acc += 1
            if state.iteration % cfg.log_interval == 0 or state.iteration == cfg.train_iters:
                ps.dp_group.all_reduce(loss_acc)  # mean over DP replicas, once per log line
                step_time = time_acc / n_acc
                m = {"iteration": state.iteration, "train_iters": cfg.train_iters,
                     "consumed_samples": state.consumed_samples,
                     "loss": float(loss_acc) / (n_acc * ps.dp_size), "lr": lr,
                     "grad_norm": result.grad_norm, "loss_scale": result.loss_scale,
                     "skipped_iterations": skipped, "step_time_s": step_time,
                     "tokens_per_sec": tokens_per_iter / step_time,
                     "tflops_per_rank": flops_per_iter / step_time / ps.world_size / 1e12,
                     # memory: the largest rank's (one tiny all-reduce per log line)
                     **dict(zip(("peak_memory_bytes", "setup_peak_memory_bytes",
                                 "memory_before_model_bytes"),
                                _max_over_ranks(ps, [_memory(ps)[1], setup_peak, before_model]))),
                     "model_state_bytes": engine.model_state_bytes(), "comm_bytes": comm,
                     # saved for backward by this rank's first micro-batch, measured
                     "activation_bytes": meter.peak}
                if ac is not None:
                    m["activation_checkpoint_bytes"] = ac.peak_bytes()
                    ac.reset_peak()
                monitor.log_iteration(m)
                history.append(m)
                loss_acc.zero_()
                time_acc, n_acc = 0.0, 0
            if cfg.eval_interval and state.iteration % cfg.eval_interval == 0:
                run_eval("valid")
            if (cfg.save and cfg.save_interval and state.iteration % cfg.save_interval == 0
                    and nan_streak == 0):  # never save a step that went non-finite
                save()
                saved_at = state.iteration
        if cfg.save and saved_at != state.iteration:
            save()
        run_eval("test")
    finally:
        monitor.close()
    return history
