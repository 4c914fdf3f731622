"""The training loop, and the one module that composes all the others.

    trainer = Trainer(cfg, ps)     # setup: data, model on meta, recompute, ZeRO, resume
    history = trainer.train()      # step, log, evaluate, save until the run is over

Each iteration: this DP rank's micro-batches -> GPT -> backward (ZeRO reduces the
gradients) -> AdamW on the shard (:func:`hybrid.train.step.train_step`); the host
reads device values only at log lines, saves and the end (:mod:`.step_stats`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from hybrid.checkpoint.async_save import AsyncSaver
from hybrid.checkpoint.ownership import RunIdentity, claim_save_dir
from hybrid.checkpoint.resume import start_from_checkpoint
from hybrid.checkpoint.save import finish_save, prepare_save
from hybrid.checkpoint.snapshot import snapshot_for
from hybrid.config import TrainConfig
from hybrid.config.lr_schedule import scheduled_lr
from hybrid.data.dataset import build_datasets, dp_micro_batches
from hybrid.data.tokenizer import build_tokenizer
from hybrid.errors import ConfigError
from hybrid.kernels.dtypes import DTYPES
from hybrid.kernels.select import low_precision_warning
from hybrid.parallel.agree import agree_error
from hybrid.parallel.state import ParallelState
from hybrid.tensor_parallel import seed_all
from hybrid.train.activation_meter import SavedActivationMeter
from hybrid.train.batches import finished, global_batch_size_at, total_iterations
from hybrid.train.early_exit import EarlyExit
from hybrid.train.host_memory import return_freed_memory
from hybrid.train.metrics import IntervalMetrics, stage_flops_per_token
from hybrid.train.moe_stats import MoEWatch
from hybrid.train.monitor import Monitor
from hybrid.train.phase_clock import PhaseClock
from hybrid.train.replicas import ReplicaChecker
from hybrid.train.setup import HOST_TRIM_MIN_PARAMS, build_engine_or_explain, memory_bytes
from hybrid.train.skips import SkippedSteps
from hybrid.train.step import activation_shape, evaluate, stage_reads, train_step

log = logging.getLogger("hybrid")


@dataclass
class TrainState:
    """Where a run is: everything the loop needs to continue besides the weights."""

    iteration: int = 0
    consumed_samples: int = 0


class Trainer:
    """One training run of ``cfg`` on the ranks of ``ps``: set up in the constructor,
    then :meth:`train`. Every method is collective over the world (each rank calls
    it in the same order)."""

    def __init__(self, cfg: TrainConfig, ps: ParallelState, launched_at: float | None = None,
                 run: RunIdentity | None = None):
        """``launched_at``: when the job was launched (epoch seconds; default now), for
        the launch-to-first-iteration time the first log line reports. ``run``: who is
        running (:meth:`RunIdentity.of_launch`; default: a launch of its own), the
        owner ``--save`` records (:mod:`hybrid.checkpoint.ownership`)."""
        self.cfg, self.ps = cfg, ps
        self.started = time.monotonic()
        self.launched_at = time.time() if launched_at is None else launched_at
        # --save belongs to this run from here on (rank 0 holds it); refused: nothing ran
        self.claim = claim_save_dir(cfg.checkpoint, ps, run or RunIdentity.of_launch(),
                                    cfg.to_dict())
        try:
            self._set_up()
        except BaseException:
            # a run that fails to start leaves nothing behind: no swap files on the nvme
            # tier (if its engine was built), no claim on --save
            engine = getattr(self, "engine", None)
            if engine is not None:
                engine.close()
            if self.claim is not None:
                self.claim.release()
            raise

    def _set_up(self) -> None:
        cfg, ps = self.cfg, self.ps
        self.first_iteration_s: float | None = None  # launch to the end of the first one
        self._first_line: dict = {}
        self.rng = seed_all(cfg.seed, ps.tp_rank, ps.dp_rank, ps.device, ps.cp_rank, ps.tp_size)
        self.tokenizer = build_tokenizer(cfg.tokenizer)
        self.data = build_datasets(cfg.data, self.tokenizer, ps)
        vocab = self.tokenizer.vocab_size
        self.model_cfg = cfg.model.with_vocab_size(vocab)
        if (ps.device.type == "cpu"
                and self.model_cfg.num_parameters(ps.tp_size) >= HOST_TRIM_MIN_PARAMS):
            return_freed_memory()  # the model lives in host memory: keep RSS to what is used
        before_model = memory_bytes(ps)[0]  # the process without the model: runtime, data
        self.model, self.ac, self.engine = build_engine_or_explain(cfg, ps, vocab, self.rng)
        # the activations between pipeline stages (hybrid/train/step.py)
        self.pp_io = (activation_shape(cfg.loop.micro_batch_size, cfg.model.seq_length,
                                       cfg.model.hidden_size, ps, cfg.parallel.sequence_parallel),
                      DTYPES[cfg.precision.params_dtype])
        self.state = TrainState()
        # the MoE layers' routing: the expert bias's update and checkpoint, the log line
        self.moe = (MoEWatch(self.model, ps, cfg.model.moe) if cfg.model.moe is not None
                    else None)
        # --load with --no-load-optim / --no-load-rng / --finetune (checkpoint/resume.py)
        self.start = start_from_checkpoint(
            cfg.checkpoint, self.engine, ps, cfg.seed, self.rng, vocab, cfg.to_dict(),
            self.claim.record if self.claim is not None else None)
        if self.start is not None:
            self.state = TrainState(self.start.iteration, self.start.consumed_samples)
            if self.moe is not None:
                self.moe.load_buffers(self.start.buffers, self.start.checkpoint)
        setup_peak = memory_bytes(ps)[1]
        self.monitor = self._open_monitor()
        self._log_setup()
        self.eod = self.tokenizer.eod if cfg.data.eod_mask_loss else None  # data/dataset.py
        cp = self.model.cp  # context parallelism: the sequence positions this rank reads
        self.cp_keep = (None if cp is None else
                        cp.positions(cfg.model.seq_length // cp.size, ps.device))
        self.meter = SavedActivationMeter(
            extra=self.ac.stored_bytes if self.ac is not None else lambda: 0)
        self.metrics = IntervalMetrics(  # TFLOP/s: the work of this rank's stage only
            ps, stage_flops_per_token(self.model_cfg, ps.tp_size, cfg.pipeline.split, ps.pp_rank),
            before_model, setup_peak)
        self.skips = SkippedSteps(self.model, self.engine, ps, cfg.loop.micro_batch_size,
                                  cfg.loop.exit_on_nan_iterations)
        interval = cfg.diagnostics.check_replicas_interval
        self.replicas = ReplicaChecker(self.model, self.engine, ps) if interval else None
        self.lr = 0.0
        self._offload_prev: dict = {}  # engine.offload_seconds() at the last log line
        self._speculation_prev: dict = {}  # engine.offload_speculation() at the last one
        self.clock = PhaseClock(ps.device) if cfg.logging.timing_breakdown else None
        # --async-save: the save in flight, published from the loop (async_save.py)
        self.saver = (AsyncSaver(ps, snapshot_for(self.engine)) if cfg.checkpoint.async_save
                      else None)
        if self.saver is not None:  # the snapshot's memory, touched before the first save
            columns = 1 if cfg.checkpoint.no_save_optim else len(self.engine.optimizer.columns)
            self.saver.buffer.reserve(
                columns * sum(pc.hi - pc.lo for pc in self.engine.owned_pieces()))

    def train(self) -> list[dict]:
        """Train until ``--train-iters`` or ``--train-samples`` (or an exit flag); return
        the logged metrics (rank 0's view)."""
        cfg, st = self.cfg, self.state
        s, ck = cfg.loop, cfg.checkpoint
        history, saved_at = [], st.iteration
        early = EarlyExit(s, self.ps, self.started)  # its SIGTERM handler: until close()
        done = False
        try:
            while not finished(s, st.iteration, st.consumed_samples):
                batch, result, logs = self.step()
                if self.saver is not None:
                    self._published(self.saver.poll())
                if self.first_iteration_s is None:
                    self._first_iteration_done()
                save_due = bool(ck.save and ck.save_interval
                                and st.iteration % ck.save_interval == 0)
                self.skips.settle(force=logs or save_due)
                if logs:
                    history.append(self.log(batch, result))
                interval = cfg.diagnostics.check_replicas_interval
                if self.replicas is not None and st.iteration % interval == 0:
                    self.replicas.check(st.iteration)
                if s.eval_interval and st.iteration % s.eval_interval == 0:
                    self.evaluate("valid")
                if save_due and self.skips.clean:  # never save a step that went non-finite
                    self.save()
                    saved_at = st.iteration
                why = early.reason(st.iteration)
                if why:
                    log.info("exiting at iteration %d: %s", st.iteration, why)
                    break
            self.skips.settle(force=True)
            if ck.save and saved_at != st.iteration:
                self.save()
            if self.saver is not None:  # the end of the run waits for the save in flight
                self._published(self.saver.wait())
            done = True
            if finished(s, st.iteration, st.consumed_samples):
                self.evaluate("test")
        finally:
            if self.saver is not None and not done:  # an error: its files end, unpublished
                self.saver.abandon()
            early.close()
            self.monitor.close()
            self.engine.close()  # the nvme tier's swap files are scratch: deleted here
            if self.claim is not None:
                self.claim.release()
        return history

    def step(self):
        """One iteration: (its global batch size, the engine's StepResult, whether it is
        logged). The skip flag stays on the device (see :mod:`hybrid.train.skips`)."""
        s, st, ps = self.cfg.loop, self.state, self.ps
        batch = global_batch_size_at(s, st.consumed_samples)
        self.lr = scheduled_lr(self.cfg.lr_schedule, st.iteration + 1, st.consumed_samples)
        logs = ((st.iteration + 1) % self.cfg.logging.log_interval == 0
                or finished(s, st.iteration + 1, st.consumed_samples + batch))
        self.metrics.start()
        micro = dp_micro_batches(self.data["train"], st.consumed_samples, batch,
                                 s.micro_batch_size, ps.dp_rank, ps.dp_size, ps.device, self.eod,
                                 self.cp_keep, stage_reads(ps))  # a stage reads its share
        shape, dtype = self.pp_io
        loss, result, losses = train_step(
            self.model, self.engine, micro, self.lr, self.meter if logs else None, self.clock,
            schedule=self.cfg.pipeline.schedule, shape=shape, dtype=dtype,
            reshard_after_micro_batch=self.cfg.pipeline.reshard_after_micro_batch)
        self.metrics.stop(loss, batch * self.cfg.model.seq_length)
        if self.moe is not None:
            self.moe.step()
        self.skips.add(st.iteration + 1, result, losses, st.consumed_samples, batch)
        st.iteration += 1
        st.consumed_samples += batch
        return batch, result, logs

    def _first_iteration_done(self) -> None:
        """Say how long the job took from launch to its first finished iteration (the
        first log record carries it too, as ``launch_to_first_iteration_s``)."""
        self.first_iteration_s = time.time() - self.launched_at
        self._first_line = {"launch_to_first_iteration_s": self.first_iteration_s}
        log.info("first iteration done %.2f s after launch (%.2f s of it since the trainer "
                 "started: set-up and the iteration)",
                 self.first_iteration_s, time.monotonic() - self.started)

    def log(self, batch: int, result) -> dict:
        """The log line of the interval that ended at this iteration (console, JSON,
        TensorBoard on rank 0); returns its metrics."""
        n = self.metrics.iterations
        st, measured = self.state, self.metrics.line()
        m = {"iteration": st.iteration, "train_iters": total_iterations(self.cfg.loop),
             "consumed_samples": st.consumed_samples, "global_batch_size": batch,
             "loss": measured.pop("loss"), "lr": self.lr, "grad_norm": float(result.grad_norm),
             "loss_scale": result.loss_scale, "skipped_iterations": self.skips.total,
             **measured, "model_state_bytes": self.engine.model_state_bytes(),
             # saved for backward by this rank's first micro-batch, measured
             "activation_bytes": self.meter.peak}
        m.update(self._first_line)  # the first log record only
        self._first_line = {}
        phases = self.clock.take(n) if self.clock is not None else {}
        if phases:
            m["time_breakdown_s"] = phases
        split = self._offload_split(n)
        if split:
            m["offload_time_s"] = split
        spec = self.engine.offload_speculation()  # tiles over the interval's steps
        if spec:
            prev, self._speculation_prev = self._speculation_prev, spec
            m["offload_speculation"] = {k: v - prev.get(k, 0) for k, v in spec.items()}
        if self.ac is not None:
            m["activation_checkpoint_bytes"] = self.ac.peak_bytes()
            self.ac.reset_peak()
        if self.moe is not None:
            m["moe"] = self.moe.line()
        self.monitor.log_iteration(m)
        return m

    def _offload_split(self, n: int) -> dict:
        """This rank's seconds per step over the interval's ``n`` steps, in the offloaded
        optimizer step, the host Adam kernels and swap I/O waits (none: {})."""
        now = self.engine.offload_seconds()
        prev, self._offload_prev = self._offload_prev, now
        return {k: (v - prev.get(k, 0.0)) / max(n, 1) for k, v in now.items()}

    def evaluate(self, split: str) -> None:
        """Log the mean loss over ``--eval-iters`` batches of ``split`` (if it has data)."""
        if self.data[split] is not None and self.cfg.loop.eval_iters > 0:
            loss = evaluate(self.model, self.data[split], self.cfg.loop, self.ps, *self.pp_io,
                            self.eod, self.cp_keep)
            self.monitor.log_eval(self.state.iteration, split, loss)

    def save(self) -> None:
        """Checkpoint this iteration into ``--save`` (see :mod:`hybrid.checkpoint.save`)."""
        ck, st = self.cfg.checkpoint, self.state
        assert ck.save is not None  # (train() saves only with --save)
        # (save_checkpoint's phases, the middle one on a thread with --async-save, after
        # the save before it is published)
        if self.saver is not None:
            self._published(self.saver.wait())
        pending = prepare_save(ck.save, st.iteration, st.consumed_samples, self.engine,
                               self.ps, self.cfg.to_dict(), self.rng, ck.keep_last,
                               self.tokenizer.vocab_size, optimizer=not ck.no_save_optim,
                               finetune=self.start.finetune if self.start is not None else None,
                               owner=self.claim.record if self.claim is not None else None,
                               extra_meta=self._buffers(),
                               snapshot=self.saver.buffer if self.saver is not None else False)
        if self.saver is None:
            pending.write()
            log.info("saved checkpoint %s", finish_save(pending, self.ps))
            return
        self.saver.start(pending)
        log.info("saving checkpoint of iteration %d in the background", st.iteration)

    def _published(self, path: str | None) -> None:
        if path is not None:
            log.info("saved checkpoint %s (written in the background; published at "
                     "iteration %d)", path, self.state.iteration)

    def _buffers(self) -> dict | None:
        """The model's buffers a checkpoint keeps (the MoE routers' expert biases), as
        metadata.json's ``"buffers"``; None when it has none (collective over PP)."""
        buffers = self.moe.buffers() if self.moe is not None else {}
        return {"buffers": buffers} if buffers else None

    def _open_monitor(self) -> Monitor:
        lg = self.cfg.logging
        monitor = Monitor(self.ps.rank, lg.log_json, lg.tensorboard_dir,
                          append=self.state.iteration > 0, log_throughput=lg.log_throughput)
        error = agree_error(self.ps, monitor.error)  # rank 0 opened the logs: every rank hears
        if error:
            monitor.close()
            raise ConfigError(error)
        return monitor

    def _log_setup(self) -> None:
        cfg, ps, mc = self.cfg, self.ps, self.model_cfg
        log.info("layout: %s", ps.describe())
        if ps.pp_size > 1 and cfg.pipeline.split is not None:
            log.info("%s; schedule %s", cfg.pipeline.split.describe(), cfg.pipeline.schedule)
        log.info("parameters: %d on each TP rank, %d in the model (TP %d, padded vocab %d); "
                 "train samples per epoch: %d", mc.num_parameters(ps.tp_size),
                 mc.num_parameters(ps.tp_size, per_rank=False), ps.tp_size,
                 self.model.padded_vocab_size, len(self.data["train"]))
        log.info("config: %s", cfg.to_dict())
        if cfg.flags.ignored_megatron_flags:
            log.info("Megatron flags with no effect here (they pick Megatron's own kernels or "
                     "internals): %s", " ".join(cfg.flags.ignored_megatron_flags))
        if cfg.flags.ds_config_notes and ps.rank == 0:  # keys accepted without effect
            for note in cfg.flags.ds_config_notes:
                log.warning("warning: ds_config %s", note)
        slow = low_precision_warning(cfg.precision.params_dtype, ps.device)
        if slow and ps.rank == 0:  # one line for the job
            log.warning("warning: %s", slow)
        empty = self._empty_validation()
        if empty and ps.rank == 0:
            log.warning("warning: %s", empty)

    def _empty_validation(self) -> str | None:
        """Why no validation will run although --eval-interval asks for one, or None.

        A warning, not an error: Megatron's split (949,50,1) leaves a small corpus no
        validation samples, and a run may not need them; but silence would let a user
        wait for validation losses that never come."""
        s, data = self.cfg.loop, self.cfg.data
        if (not s.eval_interval or s.eval_iters <= 0 or self.data["valid"] is not None
                or total_iterations(s) // s.eval_interval
                <= self.state.iteration // s.eval_interval):  # no validation falls due
            return None
        where = ("--train-data-path without --valid-data-path" if data.train_data_path else
                 f"--split {data.split} leaves it no sample of --seq-length "
                 f"{self.cfg.model.seq_length} + 1 tokens")
        return (f"--eval-interval {s.eval_interval}: the validation split is empty ({where}), "
                f"so no validation will run: give the split more weight or a "
                f"--valid-data-path, or --eval-iters 0 to say that none is wanted")


def pretrain(cfg: TrainConfig, ps: ParallelState, launched_at: float | None = None,
             run: RunIdentity | None = None) -> list[dict]:
    """Set up and train (see :class:`Trainer`); return the logged metrics."""
    return Trainer(cfg, ps, launched_at, run).train()
