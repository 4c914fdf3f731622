"""What each pipeline stage reads, and what the logs say, through scripts/pretrain_gpt.py
(its work on pooled ranks): at PP 3 the first stage reads the inputs of each sample, the
last its labels (with --eod-mask-loss the input before them too, for the mask), the
middle stage nothing, for training and evaluation alike; the samples are those PP 1
reads, and --log-json and TensorBoard carry PP 1's losses."""

import json

from tests.helpers.launch import TINY, pretrain, pretrain_rank_with, read_json_log


def _count_reads(ps, cfg):
    """_pretrain_rank, with every sample window the rank reads recorded (sample, first
    token, tokens) and written beside the --log-json file."""
    from hybrid.data.dataset import GPTSamples
    orig = GPTSamples.window
    seen = []

    def window(self, i, part):
        out = orig(self, i, part)
        seen.append((int(i), part.indices(self.seq_length + 1)[0], len(out)))
        return out

    return pretrain_rank_with(ps, cfg, GPTSamples, "window", window, "reads", lambda: seen)


def test_each_stage_reads_its_share_and_the_logs_follow_one_stage(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    seq = 32  # TINY's
    runs = {"pp1": 1, "pp3": 3}
    logs, reads = {}, {}
    for name, n in runs.items():
        path, tb = str(tmp_path / f"{name}.jsonl"), str(tmp_path / f"{name}_tb")
        r = pretrain(n, TINY + ["--num-layers", "3", "--pipeline-model-parallel-size", str(n),
                                "--eod-mask-loss", "--global-batch-size", "4",
                                "--train-iters", "3", "--eval-interval", "3",
                                "--eval-iters", "1", "--log-json", path,
                                "--tensorboard-dir", tb], rank_fn=_count_reads)
        assert r.returncode == 0, f"{name}:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
        logs[name] = (read_json_log(path), read_json_log(path, "valid"))
        reads[name] = []
        for rank in range(n):
            with open(f"{path}.reads{rank}") as f:
                reads[name].append([tuple(x) for x in json.load(f)])
        acc = EventAccumulator(tb)
        acc.Reload()
        assert [e.value for e in acc.Scalars("train/loss")] == \
            [m["loss"] for m in logs[name][0]], name
        assert [e.value for e in acc.Scalars("valid/loss")] == \
            [m["loss"] for m in logs[name][1]], name
    (one,), (first, middle, last) = reads["pp1"], reads["pp3"]
    # 3 training batches of 4 samples, then one validation batch (test: one more)
    assert len(one) >= 16 and all(k == 0 and t == seq + 1 for _, k, t in one)
    assert middle == []
    assert [i for i, _, _ in first] == [i for i, _, _ in one]  # the same samples, in order
    assert [i for i, _, _ in last] == [i for i, _, _ in one]
    assert all(k == 0 and t == seq for _, k, t in first)  # the inputs only
    assert all(k == 0 and t == seq + 1 for _, k, t in last)  # labels, and inputs for the mask
    (ref, ref_valid), (log, valid) = logs["pp1"], logs["pp3"]
    assert [m["iteration"] for m in log] == [1, 2, 3] and len(valid) == len(ref_valid) == 1
    for a, b in zip(log + valid, ref + ref_valid):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(b["loss"]), (a, b)
    # the last stage's share without the mask: the labels alone
    path = str(tmp_path / "nomask.jsonl")
    r = pretrain(3, TINY + ["--num-layers", "3", "--pipeline-model-parallel-size", "3",
                            "--global-batch-size", "4", "--train-iters", "1",
                            "--log-json", path], rank_fn=_count_reads)
    assert r.returncode == 0, r.stderr[-3000:]
    with open(f"{path}.reads2") as f:
        got = [tuple(x) for x in json.load(f)]
    assert len(got) >= 4 and all(k == 1 and t == seq for _, k, t in got), got
