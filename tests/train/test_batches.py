"""Batch ramp-up, run length and the LR schedule in iterations or samples, as Megatron
defines them."""

import os

import pytest

from hybrid.config import build_config, parse_args
from hybrid.config.lr_schedule import learning_rate, scheduled_lr
from hybrid.config.sections import LoopConfig
from hybrid.train.batches import finished, global_batch_size_at, total_iterations

BASE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--micro-batch-size", "2"]


def _megatron_rampup(start, incr, ramp_samples, global_batch, consumed):
    """Megatron's RampupBatchsizeNumMicroBatchesCalculator.update, restated."""
    if consumed > ramp_samples:
        return global_batch
    per_increment = ramp_samples / ((global_batch - start) // incr)
    return start + int(consumed / per_increment) * incr


@pytest.mark.parametrize("start,incr,ramp", [(16, 16, 5859), (4, 4, 100), (8, 24, 1000)])
def test_rampup_follows_megatron_sample_by_sample(start, incr, ramp):
    s = LoopConfig(micro_batch_size=4, global_batch_size=128 if incr != 24 else 80,
                       rampup=(start, incr, ramp), train_iters=10)
    for consumed in range(0, 2 * ramp):
        assert global_batch_size_at(s, consumed) == _megatron_rampup(
            start, incr, ramp, s.global_batch_size, consumed), consumed


def test_sample_based_run_walks_the_ramp_in_whole_batches():
    s = LoopConfig(micro_batch_size=2, global_batch_size=16, rampup=(4, 4, 40),
                       train_iters=None, train_samples=100)
    consumed, sizes = 0, []
    while not finished(s, len(sizes), consumed):
        sizes.append(global_batch_size_at(s, consumed))
        consumed += sizes[-1]
    # ramp intervals of 40 / 3 samples: 4 x4 (to 16), 8 x2 (to 32), 12 (to 44), then 16
    assert sizes == [4, 4, 4, 4, 8, 8, 12, 16, 16, 16]
    assert consumed == 92 and total_iterations(s) == len(sizes)  # 92 + 16 would pass 100
    constant = LoopConfig(global_batch_size=16, train_iters=None, train_samples=100)
    assert total_iterations(constant) == 6  # whole batches only, as Megatron


def test_lr_in_samples_equals_lr_in_iterations_at_a_constant_batch():
    gbs = 24
    it = build_config(parse_args(BASE + ["--global-batch-size", str(gbs), "--train-iters", "50",
                            "--lr-warmup-iters", "5", "--lr-decay-style", "cosine",
                            "--lr", "1e-3", "--min-lr", "1e-4"]), 1)
    sa = build_config(parse_args(BASE + ["--global-batch-size", str(gbs),
                            "--train-samples", str(50 * gbs),
                            "--lr-warmup-samples", str(5 * gbs), "--lr-decay-style", "cosine",
                            "--lr", "1e-3", "--min-lr", "1e-4"]), 1)
    assert (it.lr_schedule.unit, sa.lr_schedule.unit) == ("iterations", "samples")
    for i in range(1, 51):
        assert scheduled_lr(it.lr_schedule, i, (i - 1) * gbs) == scheduled_lr(
            sa.lr_schedule, i, (i - 1) * gbs)
    assert total_iterations(sa.loop) == 50


def test_warmup_fraction_is_a_fraction_of_the_decay_length():
    cfg = build_config(parse_args(BASE + ["--train-iters", "1000", "--lr-decay-iters", "800",
                             "--lr-warmup-fraction", "0.01"]), 1)
    assert (cfg.lr_schedule.warmup, cfg.lr_schedule.decay) == (8, 800)
    assert scheduled_lr(cfg.lr_schedule, 4, 0) == learning_rate(3, 1e-3, 0.0, 8, 800, "constant")


def test_iteration_based_rampup_takes_train_iters_steps():
    # Megatron refuses ramp-up with --train-iters; its own GPT-3 example passes both.
    cfg = build_config(parse_args(BASE + ["--global-batch-size", "16",
                                          "--rampup-batch-size", "4", "4", "40",
                                          "--train-iters", "7"]), 2)
    s = cfg.loop
    assert total_iterations(s) == 7 and not finished(s, 6, 10_000) and finished(s, 7, 0)
    assert global_batch_size_at(s, 0) == 4 and global_batch_size_at(s, 40) == 16


def test_rampup_run_logs_the_schedule_and_resumes_exactly_after_exit_interval(tmp_path):
    """A sample-based run with a batch ramp-up and warmup fraction at DP 2: the log
    follows the schedule's batch sizes and rates; stopped by --exit-interval (which
    saves) and resumed, it continues with the same losses to the last bit."""
    from tests.helpers.launch import TINY, pretrain, read_json_log
    args = TINY + ["--train-samples", "48", "--global-batch-size", "8",
                   "--rampup-batch-size", "4", "4", "16", "--lr-warmup-fraction", "0.25",
                   "--lr-decay-style", "cosine", "--eval-interval", "1000"]
    full, part, rest = (str(tmp_path / n) for n in ("full.jsonl", "part.jsonl", "rest.jsonl"))
    ckpt = str(tmp_path / "ckpt")
    r = pretrain(2, args + ["--log-json", full])
    assert r.returncode == 0, r.stderr[-3000:]
    log = read_json_log(full)
    cfg = build_config(parse_args(args), 2)
    consumed, expect = 0, []
    while not finished(cfg.loop, len(expect), consumed):
        batch = global_batch_size_at(cfg.loop, consumed)
        lr = scheduled_lr(cfg.lr_schedule, len(expect) + 1, consumed)  # (samples before)
        consumed += batch
        expect.append((batch, consumed, lr))
    assert [(m["global_batch_size"], m["consumed_samples"], m["lr"]) for m in log] == expect
    assert [b for b, _, _ in expect] == [4, 4, 4, 4, 8, 8, 8, 8] and expect[-1][1] == 48

    r = pretrain(2, args + ["--log-json", part, "--save", ckpt, "--exit-interval", "3"])
    assert r.returncode == 0 and "exiting at iteration 3: --exit-interval 3" in r.stdout
    assert len(read_json_log(part)) == 3
    r = pretrain(2, args + ["--log-json", rest, "--load", ckpt])
    assert r.returncode == 0, r.stderr[-3000:]
    resumed = read_json_log(part) + read_json_log(rest)
    assert [m["loss"] for m in resumed] == [m["loss"] for m in log]
    assert [m["iteration"] for m in resumed] == list(range(1, 9))


def test_exit_duration_saves_and_stops_and_no_effect_flags_are_logged_once(tmp_path):
    """Also: a validation split left empty (--split 100,0,0) while --eval-interval asks for
    validation is one warning at start, naming the flags."""
    from tests.helpers.launch import TINY, pretrain
    ckpt = str(tmp_path / "ckpt")
    r = pretrain(2, TINY + ["--train-iters", "50", "--exit-duration-in-mins", "1e-6",
                            "--save", ckpt, "--use-mcore-models", "--transformer-impl",
                            "transformer_engine", "--no-masked-softmax-fusion",
                            "--split", "100,0,0", "--eval-interval", "10"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert "exiting at iteration 1: --exit-duration-in-mins 1e-06" in r.stdout
    assert sorted(os.listdir(ckpt)) == [".lock", "iter_0000001", "latest", "owner.json"]
    line = ("Megatron flags with no effect here (they pick Megatron's own kernels or "
            "internals): --use-mcore-models --transformer-impl transformer_engine "
            "--no-masked-softmax-fusion")
    assert r.stdout.count(line) == 1
    empty = [x for x in r.stdout.splitlines() if "the validation split is empty" in x]
    assert empty == ["warning: --eval-interval 10: the validation split is empty (--split "
                     "100,0,0 leaves it no sample of --seq-length 32 + 1 tokens), so no "
                     "validation will run: give the split more weight or a --valid-data-path, "
                     "or --eval-iters 0 to say that none is wanted"], r.stdout[-3000:]


def _sigterm_rank1_at_step3(ps, cfg):
    """Rank 1 alone gets SIGTERM as iteration 3 starts (a scheduler that signals one node
    first); pooled workers are reused, so the patch is undone on the way out."""
    import signal

    from hybrid.train import trainer as training
    from tests.helpers.launch import _pretrain_rank
    orig, count = training.train_step, [0]

    def step(*args, **kwargs):
        count[0] += 1
        if count[0] == 3 and ps.rank == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        return orig(*args, **kwargs)

    training.train_step = step
    try:
        return _pretrain_rank(ps, cfg), signal.getsignal(signal.SIGTERM)
    finally:
        training.train_step = orig


def test_exit_signal_handler_saves_and_stops_every_rank_at_the_same_iteration(tmp_path):
    """--exit-signal-handler: a SIGTERM on rank 1 only stops both ranks after iteration 3
    (rank 0 logs it), with a checkpoint of iteration 3; SIGTERM's handler is given back."""
    import signal

    from tests.helpers.harness import run_ranks
    from tests.helpers.launch import TINY
    ckpt = str(tmp_path / "ckpt")
    cfg = build_config(parse_args(TINY + ["--train-iters", "50", "--exit-signal-handler", "--save",
                             ckpt]), 2)
    res = run_ranks(_sigterm_rank1_at_step3, world_size=2, args=(cfg,))
    (rank0, handler0), (rank1, handler1) = res
    assert rank0[0] == rank1[0] == 0, (rank0, rank1)
    assert "exiting at iteration 3: --exit-signal-handler: SIGTERM received" in rank0[1]
    assert sorted(os.listdir(ckpt)) == [".lock", "iter_0000003", "latest", "owner.json"]
    assert handler0 == handler1 == signal.SIG_DFL
