"""TensorBoard and --log-json carry the metrics with the right steps."""

from tests.helpers.launch import TINY, pretrain, read_json_log


def test_tensorboard_scalars_and_json_records(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    tb, js = str(tmp_path / "tb"), str(tmp_path / "log.jsonl")
    r = pretrain(2, TINY + ["--train-iters", "6", "--log-interval", "2", "--eval-interval", "3",
                            "--eval-iters", "1", "--global-batch-size", "4", "--zero-stage", "1",
                            "--tensorboard-dir", tb, "--log-json", js, "--log-throughput"])
    assert r.returncode == 0, r.stderr[-3000:]
    acc = EventAccumulator(tb)
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    for tag in ("train/loss", "train/lr", "train/grad_norm", "train/tokens_per_sec",
                "train/loss_scale", "train/tflops_per_rank", "train/model_state_bytes/total",
                "train/comm_bytes/reduce_scatter", "valid/loss", "valid/ppl", "test/loss",
                "train/step_time_max_s", "train/step_time_max_rank", "train/busy_time_min_s",
                "train/busy_time_min_rank"):
        assert tag in tags, (tag, sorted(tags))
    assert [e.step for e in acc.Scalars("train/loss")] == [2, 4, 6]
    assert [e.step for e in acc.Scalars("valid/loss")] == [3, 6]
    losses = [e.value for e in acc.Scalars("train/loss")]
    assert losses == [m["loss"] for m in read_json_log(js)]
    assert [m["iteration"] for m in read_json_log(js, "valid")] == [3, 6]
    assert "lm loss PPL" in r.stdout and "TFLOP/s per rank" in r.stdout  # --log-throughput
    assert "global batch size:     4" in r.stdout


def test_an_unwritable_log_is_one_error_from_every_rank_and_nothing_is_truncated(tmp_path):
    """Only rank 0 opens the logs; the others must hear of its failure (not wait in a
    collective for it). A --tensorboard-dir that fails leaves an existing --log-json as
    it was."""
    from hybrid.train.monitor import Monitor
    afile = tmp_path / "afile"
    afile.write_text("x")
    old = tmp_path / "old.jsonl"
    old.write_text('{"iteration": 1}\n')
    m = Monitor(0, log_json=str(old), tensorboard_dir=str(afile / "tb"))
    assert m.error.startswith(f"--tensorboard-dir {afile / 'tb'}: cannot write there")
    assert old.read_text() == '{"iteration": 1}\n'
    assert Monitor(1, log_json=str(tmp_path)).error is None  # rank 1 opens nothing
    r = pretrain(2, TINY + ["--train-iters", "2", "--global-batch-size", "4",
                            "--log-json", str(tmp_path)])  # a directory
    assert r.returncode == 2
    assert r.stderr == (f"pretrain_gpt.py: error: --log-json {tmp_path}: cannot open for "
                        f"writing ([Errno 21] Is a directory: '{tmp_path}')\n"), r.stderr
