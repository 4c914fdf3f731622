"""End to end through scripts/pretrain_gpt.py: its work on pooled ranks (launch.pretrain),
and under torchrun where the launcher's behaviour is the point."""

import json
import os
import re
import signal
import subprocess

import pytest

from tests.helpers.launch import ROOT, TINY, env, pretrain, read_json_log, torchrun

LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2)]  # (TP, DP)


@pytest.fixture(scope="module")
def curves(tmp_path_factory):
    """Each layout's log of a 10-step run: whole for TP1 x DP1 (the reference) and TP2 x
    DP2 (the loss falls over it; other tests' runs are held to it), the first 5 steps of
    it (--exit-interval) for TP2 x DP1 and TP1 x DP2."""
    out = {}
    tmp = tmp_path_factory.mktemp("curves")
    for tp, dp in LAYOUTS:
        path = str(tmp / f"tp{tp}dp{dp}.jsonl")
        stop = [] if tp == dp else ["--exit-interval", "5"]
        r = pretrain(tp * dp, TINY + ["--tensor-model-parallel-size", str(tp),
                                      "--global-batch-size", "8", "--train-iters", "10",
                                      "--log-json", path] + stop)
        assert r.returncode == 0, f"TP{tp}xDP{dp} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
        out[(tp, dp)] = read_json_log(path)
    return out


def test_loss_curves_agree_across_layouts(curves):
    ref = [m["loss"] for m in curves[(1, 1)]]
    assert len(ref) == 10
    for layout, log in curves.items():
        losses = [m["loss"] for m in log]
        assert [m["iteration"] for m in log] == list(range(1, 11 if layout[0] == layout[1] else 6))
        for it, (a, b) in enumerate(zip(losses, ref), 1):
            assert abs(a - b) <= 1e-4 * abs(b), f"TP{layout[0]}xDP{layout[1]} iter {it}: {a} vs {b}"


def test_loss_falls_and_json_has_required_keys(curves):
    log = curves[(2, 2)]
    for m in log:
        for key in ("iteration", "loss", "lr", "grad_norm", "step_time_s", "tokens_per_sec"):
            assert key in m
        assert m["tokens_per_sec"] > 0 and m["step_time_s"] > 0
    assert log[-1]["loss"] < log[0]["loss"] - 0.5
    # the first record only: launch (here, the trainer's start) to the first iteration
    assert 0 < log[0]["launch_to_first_iteration_s"] < 60
    assert all("launch_to_first_iteration_s" not in m for m in log[1:])


def test_gradient_accumulation_matches_one_big_micro_batch(tmp_path):
    """4 micro-batches of 2 per step == 1 micro-batch of 8 (same global batch)."""
    logs = {}
    for mbs in ("2", "8"):
        path = str(tmp_path / f"mbs{mbs}.jsonl")
        args = TINY + ["--global-batch-size", "8", "--train-iters", "4", "--log-json", path]
        args[args.index("--micro-batch-size") + 1] = mbs
        r = pretrain(1, args)
        assert r.returncode == 0, r.stderr[-3000:]
        logs[mbs] = [m["loss"] for m in read_json_log(path)]
    for a, b in zip(logs["2"], logs["8"]):
        assert abs(a - b) <= 1e-5 * abs(b)


BAD = [
    (["--tensor-model-parallel-size", "3"], "--tensor-model-parallel-size 3 does not divide"),
    (["--num-attention-heads", "3", "--hidden-size", "48", "--tensor-model-parallel-size", "2"],
     "--num-attention-heads 3 is not divisible by --tensor-model-parallel-size 2"),
    (["--hidden-size", "50"], "--hidden-size 50 is not divisible by --num-attention-heads 4"),
    (["--global-batch-size", "6"], "--global-batch-size 6 is not a multiple"),
    (["--seq-length", "64", "--max-position-embeddings", "32"], "--seq-length 64 exceeds"),
]


@pytest.mark.parametrize("args,message", BAD, ids=[m.split()[0] for _, m in BAD])
def test_bad_config_one_line_error_from_launcher(args, message):
    r = subprocess.run(["bash", os.path.join(ROOT, "scripts", "pretrain_gpt.sh"), *TINY, *args],
                       capture_output=True, check=False, text=True, timeout=60,
                       env=dict(env(), NPROC_PER_NODE="4"))
    assert r.returncode == 2
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and message in lines[0], r.stderr


def test_bad_config_under_torchrun_exits_without_hanging():
    r = torchrun(2, TINY + ["--num-attention-heads", "3", "--hidden-size", "48",
                            "--tensor-model-parallel-size", "2"], timeout=120)
    assert r.returncode != 0
    assert "--num-attention-heads 3 is not divisible" in r.stderr


def test_missing_data_path_is_named(tmp_path):
    missing = str(tmp_path / "nope.txt")
    r = pretrain(2, TINY + ["--data-path", missing, "--train-iters", "2"])  # (pooled ranks)
    assert r.returncode != 0
    assert f"--data-path {missing}: no such file" in r.stderr


# The runs compared with curves[(2, 2)]: its 10-step schedule (the learning rate's decay
# is over --train-iters), stopped after step 3 (--exit-interval): the second step is the
# first on Adam's moments and the sharded update's result (at stage 3, gathered again), the
# third the first on moments updated twice; each of their flags changes nothing a later
# step would show that these do not.
FIRST_3_OF_TP2DP2 = TINY + ["--tensor-model-parallel-size", "2", "--global-batch-size", "8",
                            "--train-iters", "10", "--exit-interval", "3"]


@pytest.mark.parametrize("stage", [2, 3])
def test_zero_stages_through_the_script_follow_the_stage0_curve(curves, tmp_path, stage):
    """TP2 x DP2 with --zero-stage 2/3 (overlapped, small buckets) == stage 0 over the
    first 3 steps of its 10-step schedule. (Stage 1 against one process, TP2 x DP2:
    tests/zero/test_zero.py.)"""
    path = str(tmp_path / "zero.jsonl")
    r = pretrain(4, FIRST_3_OF_TP2DP2 + ["--log-json", path, "--zero-stage",
                                         str(stage), "--overlap-comm", "--reduce-bucket-size",
                                         "4000", "--allgather-bucket-size", "4000",
                                         "--zero-param-persistence-threshold", "0"])
    assert r.returncode == 0, r.stderr[-3000:]
    log = read_json_log(path)
    assert [m["iteration"] for m in log] == list(range(1, 4))
    for a, b in zip(log, curves[(2, 2)]):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(b["loss"]), (a["iteration"], a, b)
    states = log[-1]["model_state_bytes"]
    ref = curves[(2, 2)][-1]["model_state_bytes"]
    assert states["optimizer"] < ref["optimizer"]  # sharded over the 2 DP ranks
    assert (states["params"] < ref["params"]) == (stage == 3)
    assert log[-1]["comm_bytes"]["reduce_scatter"] > 0


def test_offload_optimizer_through_the_script_follows_the_stage0_curve(curves, tmp_path):
    """TP2 x DP2, ZeRO-3 with --offload-optimizer (the fused CPU step) == stage 0 (the
    first 3 steps of its 10-step schedule)."""
    path = str(tmp_path / "offload.jsonl")
    r = pretrain(4, FIRST_3_OF_TP2DP2 + ["--log-json", path, "--zero-stage", "3",
                                         "--offload-optimizer",
                                         "--zero-param-persistence-threshold", "0"])
    assert r.returncode == 0, r.stderr[-3000:]
    log = read_json_log(path)
    assert [m["iteration"] for m in log] == list(range(1, 4))
    for a, b in zip(log, curves[(2, 2)]):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(b["loss"]), (a["iteration"], a, b)


# (--partition-activations alone, and with --cpu-checkpointing --contiguous-checkpointing
# under ZeRO-3: tests/recompute/test_checkpointing.py::test_pretrain_script_loss_curve_unchanged,
# with dropout on, checks the same curves and checkpoint bytes)
@pytest.mark.parametrize("flags", [
    ["--distribute-saved-activations", "--recompute-granularity", "full", "--zero-stage", "1"],
    ["--recompute-granularity", "full", "--cpu-checkpointing", "--zero-stage", "2",
     "--overlap-comm"]], ids=["partition+zero1", "cpu+zero2"])
def test_partitioned_recompute_follows_the_plain_curve(curves, tmp_path, flags):
    path = str(tmp_path / "ac.jsonl")
    r = pretrain(4, FIRST_3_OF_TP2DP2 + ["--log-json", path, *flags])
    assert r.returncode == 0, r.stderr[-3000:]
    log = read_json_log(path)
    assert [m["iteration"] for m in log] == list(range(1, 4))
    for a, b in zip(log, curves[(2, 2)]):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(b["loss"]), (a["iteration"], a, b)
    # 2 layers x (2 samples x 32 tokens x 64 hidden) fp32 inputs, split over TP 2
    split = 2 if {"--partition-activations", "--distribute-saved-activations"} & set(flags) else 1
    assert log[-1]["activation_checkpoint_bytes"] == 2 * 2 * 32 * 64 * 4 // split
    # measured activation bytes (checkpoints + one re-run block): far below the plain run's
    plain = curves[(2, 2)][-1]["activation_bytes"]
    assert 0 < log[-1]["activation_bytes"] < plain / 2, (log[-1]["activation_bytes"], plain)


def test_a_worker_error_is_the_launcher_s_whole_report(tmp_path):
    """A library error after the workers start (an empty data file), hit by both ranks:
    pretrain_gpt.sh ends with one line, the first failing rank's, and the worker's exit
    code 2 -- no torchrun traceback or table, and no second rank's copy of the line."""
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    r = subprocess.run(["bash", os.path.join(ROOT, "scripts", "pretrain_gpt.sh"), *TINY,
                        "--train-iters", "2", "--data-path", str(empty)],
                       capture_output=True, check=False, text=True, timeout=120,
                       env=dict(env(), NPROC_PER_NODE="2"))
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2, r.stderr[-3000:]
    assert len(lines) == 1 and re.match(r"pretrain_gpt\.py: error( \(rank 1\))?: --data-path",
                                        lines[0]), r.stderr[-3000:]


def test_the_launcher_says_the_first_failing_rank_s_line_once(tmp_path, capsys):
    """Four workers that all wrote their error line before the launcher looked (a loaded
    machine): it prints one, the earliest second's lowest rank; a worker that wrote none
    (killed, or a traceback it printed) adds nothing."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from hybrid.train.error_report import LAUNCHER_REPORTS, report_error_line
    from tests.helpers.launch import script_module
    quiet = script_module("torchrun_quiet")
    failures = {}
    for rank, second in [(0, None), (1, 7), (2, 5), (3, 5)]:
        path = tmp_path / f"error{rank}.json"
        if second is not None:
            environ = {LAUNCHER_REPORTS: "1", "TORCHELASTIC_ERROR_FILE": str(path)}
            assert report_error_line(f"pretrain_gpt.py: error (rank {rank}): bad", environ)
            written = json.loads(path.read_text())  # as if written in second ``second``
            path.write_text(json.dumps(dict(written, timestamp=second)))
        failures[rank] = ProcessFailure(local_rank=rank, pid=100 + rank,
                                        exitcode=-int(signal.SIGTERM) if second is None else 2,
                                        error_file=str(path))
    rank, failure = quiet._root_failure(failures)
    assert rank == 2
    quiet._say_line(failure)
    quiet._say_line(failures[0])  # SIGTERMed before it wrote: no line
    assert capsys.readouterr().err == "pretrain_gpt.py: error (rank 2): bad\n"
    # not under this launcher: the worker prints its line itself
    assert not report_error_line("x", {"TORCHELASTIC_ERROR_FILE": str(tmp_path / "e.json")})


@pytest.mark.parametrize("var,value", [("NPROC_PER_NODE", "abc"), ("NNODES", "-1")])
def test_bad_launcher_variables_are_named(var, value):
    r = subprocess.run(["bash", os.path.join(ROOT, "scripts", "pretrain_gpt.sh"), *TINY],
                       capture_output=True, check=False, text=True, timeout=60,
                       env=dict(env(), **{"NPROC_PER_NODE": "2", var: value}))
    assert r.returncode == 2
    assert r.stderr == f"pretrain_gpt.sh: error: {var} must be a whole number, got '{value}'\n"


def test_the_root_failure_is_the_worker_that_said_why():
    """torchrun_quiet picks the rank whose exit explains the job: one that exited with its
    own error beats the survivors the launcher SIGTERMed, even when those come first."""
    from types import SimpleNamespace as F

    from tests.helpers.launch import script_module
    root = script_module("torchrun_quiet")._root_failure
    term, kill = -int(signal.SIGTERM), -int(signal.SIGKILL)
    assert root({0: F(exitcode=term, timestamp=1), 1: F(exitcode=2, timestamp=1)})[0] == 1
    assert root({0: F(exitcode=term, timestamp=1), 1: F(exitcode=kill, timestamp=2)})[0] == 1
    assert root({0: F(exitcode=term, timestamp=2), 1: F(exitcode=term, timestamp=1)})[0] == 1


def test_a_stop_that_lands_on_torchrun_s_metrics_wrapper_is_still_a_stop(monkeypatch, capsys):
    """SIGTERM raised on the first line of torch's metrics wrapper comes out as its
    finally's UnboundLocalError (seen under load: exit 1 and a traceback instead of
    128 + 15); the launcher finds the stop behind it and says it in one line."""
    import torch.distributed.run as torchrun_module
    from torch.distributed.elastic.multiprocessing.api import SignalException

    from tests.helpers.launch import script_module

    def run(args):
        try:
            raise SignalException("Process 1 got signal: 15", sigval=signal.SIGTERM)
        finally:
            raise UnboundLocalError("cannot access local variable 'start'")

    monkeypatch.setattr(torchrun_module, "run", run)
    quiet = script_module("torchrun_quiet")
    environ: dict[str, str] = {}
    assert quiet.main(["--nproc-per-node", "1", "x.py"], environ) == 128 + signal.SIGTERM
    assert capsys.readouterr().err == "pretrain_gpt.sh: stopped by SIGTERM\n"

    def fails(args):
        raise UnboundLocalError("not a stop")

    monkeypatch.setattr(torchrun_module, "run", fails)
    with pytest.raises(UnboundLocalError, match="not a stop"):
        quiet.main(["--nproc-per-node", "1", "x.py"], environ)


def test_a_model_too_big_for_memory_is_one_named_error():
    """A padded vocabulary of 10**12 rows: the allocation fails at once (no pages touched)."""
    r = pretrain(1, TINY + ["--train-iters", "1", "--make-vocab-size-divisible-by",
                            str(10**12)])
    assert r.returncode == 2
    assert r.stderr.startswith("pretrain_gpt.py: error: the model (") and \
        "padded vocabulary 1,000,000,000,000) does not fit in memory" in r.stderr, r.stderr


def test_eod_mask_loss_reaches_the_loss(tmp_path):
    """Same init and data: the curves part where a batch holds end-of-document inputs."""
    plain, masked = str(tmp_path / "plain.jsonl"), str(tmp_path / "masked.jsonl")
    for path, extra in ((plain, []), (masked, ["--eod-mask-loss"])):
        r = pretrain(2, TINY + ["--train-iters", "2", "--log-json", path] + extra)
        assert r.returncode == 0, r.stderr[-3000:]
    a, b = ([m["loss"] for m in read_json_log(p)] for p in (plain, masked))
    assert a[0] == b[0] and a[1] != b[1], (a, b)  # batch 1 holds no EOD input, batch 2 does


def test_pipeline_stages_through_the_script_follow_the_one_stage_curve(tmp_path):
    """PP 2 through scripts/pretrain_gpt.py: x DP 2 at ZeRO 1 under 1F1B, and x TP 2 with
    SP at ZeRO 3 under ZB-H1 (the backward split in halves), train and evaluate as PP 1
    at DP 2 (the same global batches): every step's loss, grad norm and validation loss
    within 1e-5; each stage holds half the layers and sends its activations p2p."""
    logs = {}
    runs = {"pp1": (2, []),
            "pp2_dp2": (4, ["--pipeline-model-parallel-size", "2", "--zero-stage", "1"]),
            "pp2_tp2": (4, ["--pipeline-model-parallel-size", "2", "--tensor-model-parallel-size",
                            "2", "--sequence-parallel", "--zero-stage", "3",
                            "--pipeline-schedule", "zb_h1"]),
            # ZB-H1 with recompute: the recompute's backward inside the input half's
            # torch.autograd.grad, its linears' weight gradients deferred to W
            "zb_full": (4, ["--pipeline-model-parallel-size", "2", "--tensor-model-parallel-size",
                            "2", "--sequence-parallel", "--zero-stage", "3",
                            "--pipeline-schedule", "zb_h1", "--recompute-granularity", "full",
                            "--partition-activations", "--cpu-checkpointing"]),
            "zb_selective": (4, ["--pipeline-model-parallel-size", "2", "--zero-stage", "1",
                                 "--pipeline-schedule", "zb_h1",
                                 "--recompute-granularity", "selective"])}
    for name, (n, extra) in runs.items():
        path = str(tmp_path / f"{name}.jsonl")
        r = pretrain(n, TINY + ["--untie-embeddings-and-output-weights", "--global-batch-size",
                                "8", "--train-iters", "4", "--eval-interval", "2",
                                "--eval-iters", "1", "--log-json", path] + extra)
        assert r.returncode == 0, f"{name}:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
        logs[name] = (read_json_log(path), read_json_log(path, "valid"), r.stdout)
    ref, ref_valid, _ = logs["pp1"]
    for name in ("pp2_dp2", "pp2_tp2", "zb_full", "zb_selective"):
        log, valid, out = logs[name]
        assert [m["iteration"] for m in log] == list(range(1, 5)), name
        for a, b in zip(log, ref):
            for key in ("loss", "grad_norm"):
                assert abs(a[key] - b[key]) <= 1e-5 * abs(b[key]), (name, key, a, b)
        assert len(valid) == len(ref_valid) == 2, name
        for a, b in zip(valid, ref_valid):
            assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(b["loss"]), (name, a, b)
        assert log[-1]["comm_bytes"]["p2p"] > 0, name
        assert "stage 0: embedding + 1 layer (0)" in out and "stage 1: 1 layer (1) + loss" in out


def test_interleaving_cp_and_offload_through_the_pipeline_follow_the_one_stage_curve(tmp_path):
    """PP 2 of a 4-layer GPT through scripts/pretrain_gpt.py with what the pipeline runs
    beside since issue 40's second slice, each against PP 1 at DP 2 (the same global
    batches): interleaved stages (x 2 chunks, x DP 2) at ZeRO 1 and 3, and at 3 with
    recompute in groups of 2 layers (kept within a one-layer chunk); x CP 2 at ZeRO 1
    (a stage after the first reads the previous stage's (B, T / cp, C)); x DP 2 with the
    optimizer on the host (ZeRO 2) and optimizer and parameters on NVMe (ZeRO 3); all at
    once (2 chunks x CP 2, ZeRO 3, optimizer and parameters on the host); and the
    delayed host update at ZeRO 2 against PP 1's own delayed run. Every step's loss and
    grad norm and the validation loss within 1e-5. A checkpoint the interleaved run saves
    after step 2 resumes at PP 1 with its steps 3-4."""
    nvme = tmp_path / "nvme"
    pp2 = ["--pipeline-model-parallel-size", "2"]
    vpp2 = pp2 + ["--virtual-pipeline-model-parallel-size", "2"]
    cpu2 = ["--zero-stage", "2", "--offload-optimizer", "cpu"]
    delayed = cpu2 + ["--offload-delayed-update"]
    # (the reference at ZeRO 1: ZeRO 0's one bucket takes the whole gradient's norm in one
    # fp32 kernel; and hidden size 32: the norm kernels' fp32 sums, over other ranges in
    # each layout, part by 9e-6 at 64 over 6 steps, by 2.6e-6 at 32)
    runs = {"pp1": (2, ["--zero-stage", "1"]), "pp1_delayed": (2, delayed),
            "vpp2_zero1": (4, vpp2 + ["--zero-stage", "1"]),
            "vpp2_zero3": (4, vpp2 + ["--zero-stage", "3"]),
            "vpp2_recompute": (4, vpp2 + ["--zero-stage", "3", "--recompute-granularity", "full",
                                          "--recompute-method", "uniform",
                                          "--recompute-num-layers", "2"]),
            "cp2": (4, pp2 + ["--context-parallel-size", "2", "--zero-stage", "1"]),
            "cpu": (4, pp2 + cpu2),
            # (tiles of 64Ki elements: at the default 8Mi each unit zeroes and writes a
            # 96 MiB staging buffer, seconds of a 2-core machine's time)
            "nvme": (4, pp2 + ["--zero-stage", "3", "--offload-optimizer", "nvme",
                               "--offload-param", "nvme", "--offload-nvme-path", str(nvme),
                               "--offload-buffer-size", "65536"]),
            "vpp2_cp2_cpu3": (4, vpp2 + ["--context-parallel-size", "2", "--zero-stage", "3",
                                         "--offload-optimizer", "cpu", "--offload-param",
                                         "cpu"]),
            "delayed": (4, pp2 + delayed)}
    logs = {}
    for name, (n, extra) in runs.items():
        path = str(tmp_path / f"{name}.jsonl")
        r = pretrain(n, TINY + ["--num-layers", "4", "--hidden-size", "32",
                                "--untie-embeddings-and-output-weights",
                                "--global-batch-size", "8", "--train-iters", "4",
                                "--eval-interval", "4", "--eval-iters", "1", "--log-json",
                                path] + extra)
        assert r.returncode == 0, f"{name}:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
        logs[name] = (read_json_log(path), read_json_log(path, "valid"), r.stdout)
    for name, (log, valid, out) in logs.items():
        if name.startswith("pp1"):
            continue
        ref, ref_valid, _ = logs["pp1_delayed" if name == "delayed" else "pp1"]
        assert [m["iteration"] for m in log] == list(range(1, 5)), name
        for a, b in zip(log, ref):
            for key in ("loss", "grad_norm"):
                assert abs(a[key] - b[key]) <= 1e-5 * abs(b[key]), (name, key, a, b)
        assert len(valid) == len(ref_valid) == 1, name
        assert abs(valid[0]["loss"] - ref_valid[0]["loss"]) <= 1e-5 * abs(ref_valid[0]["loss"])
        assert log[-1]["comm_bytes"]["p2p"] > 0, name
        if name.startswith("vpp2"):  # rank 0: stages 0 and 2, rank 1: stages 1 and 3
            assert ("stage 0: embedding + 1 layer (0) | 1 layer (2)" in out
                    and "stage 1: 1 layer (1) | 1 layer (3) + loss" in out), out[-2000:]
    # the steps ran off the device, the swap files are gone with the run
    assert logs["cpu"][0][-1]["model_state_bytes"]["host"] > 0
    assert logs["nvme"][0][-1]["model_state_bytes"]["disk"] > 0
    assert not [f for f in nvme.rglob("*") if f.is_file() and f.name != ".lock"]
    ck, resumed = str(tmp_path / "ck"), str(tmp_path / "resumed.jsonl")
    for n, extra in ((4, vpp2 + ["--zero-stage", "3", "--train-iters", "2", "--save", ck]),
                     (2, ["--zero-stage", "1", "--train-iters", "4", "--load", ck,
                          "--log-json", resumed])):
        r = pretrain(n, TINY + ["--num-layers", "4", "--hidden-size", "32",
                                "--untie-embeddings-and-output-weights",
                                "--global-batch-size", "8"] + extra)
        assert r.returncode == 0, f"{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
    after = read_json_log(resumed)
    assert [m["iteration"] for m in after] == [3, 4]
    for a, b in zip(after, logs["vpp2_zero3"][0][2:]):
        for key in ("loss", "grad_norm"):
            assert abs(a[key] - b[key]) <= 1e-5 * abs(b[key]), ("resumed", key, a, b)


def _compare_tied_copies(ps, cfg):
    """_pretrain_rank, with the first and last stage's copies of ``wte.weight`` compared to
    the bit after every step (gathered, then all-gathered over the embedding group): a
    difference stops the run naming the step; each rank writes how many steps it
    compared beside the --log-json file."""
    import torch

    from hybrid.errors import TrainingError
    from hybrid.train import trainer as training
    from tests.helpers.launch import pretrain_rank_with
    orig = training.train_step
    compared = [0]

    def step(model, engine, *args, **kwargs):
        out = orig(model, engine, *args, **kwargs)
        with engine.gathered():
            w = model.wte.weight.detach().reshape(-1).clone()
        both = torch.empty(2 * w.numel(), dtype=w.dtype)
        ps.embedding_group.all_gather(both, w)
        if not torch.equal(both[: w.numel()], both[w.numel():]):
            raise TrainingError(f"step {compared[0] + 1}: the copies of wte.weight differ")
        compared[0] += 1
        return out

    return pretrain_rank_with(ps, cfg, training, "train_step", step, "compared",
                              lambda: compared[0])


def test_tied_embeddings_across_stages_follow_the_one_stage_curve(tmp_path):
    """The default GPT-2 (embedding and head tied) at PP 2 x DP 2: the first stage's wte
    and the last stage's copy get their gradients summed over the embedding group and
    stay bit-identical after every step, at ZeRO 0 and 1 (1F1B), 2 (ZB-H1) and 3 (1F1B),
    and with the optimizer offloaded, the tied unit going down only after the step's sum:
    to the host at ZeRO 1 (the device shard copied down) and 2 (read in place), to NVMe
    at ZeRO 3 (landed, parked, landed again for the sum); every step's loss and grad
    norm (the embedding counted once) within 1e-5 of PP 1 at DP 2; at ZeRO 0 with
    --timing-breakdown, forward, backward, pipeline messages and the optimizer timed and
    the activations held for backward measured on every log line."""
    logs = {}
    pp2 = ["--pipeline-model-parallel-size", "2"]
    runs = {"pp1": (2, []),
            # (ZeRO 0 with --timing-breakdown: each phase of a pipeline step timed)
            **{f"pp2_zero{z}": (4, pp2 + ["--zero-stage", str(z), "--pipeline-schedule", sched]
                                + (["--timing-breakdown"] if z == 0 else []))
               for z, sched in ((0, "1f1b"), (1, "1f1b"), (2, "zb_h1"), (3, "1f1b"))},
            **{f"pp2_cpu{z}": (4, pp2 + ["--zero-stage", str(z), "--offload-optimizer", "cpu"])
               for z in (1, 2)},
            # (tiles of 64Ki elements: at the default 8Mi each unit zeroes and writes a
            # 96 MiB staging buffer, seconds of a 2-core machine's time)
            "pp2_nvme3": (4, pp2 + ["--zero-stage", "3", "--offload-optimizer", "nvme",
                                    "--offload-nvme-path", str(tmp_path / "nvme"),
                                    "--offload-buffer-size", "65536"])}
    for name, (n, extra) in runs.items():
        path = str(tmp_path / f"{name}.jsonl")
        r = pretrain(n, TINY + ["--global-batch-size", "8", "--train-iters", "3",
                                "--log-json", path] + extra,
                     rank_fn=_compare_tied_copies if n == 4 else None)
        assert r.returncode == 0, f"{name}:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
        logs[name] = read_json_log(path)
        if n == 4:
            for rank in range(4):
                with open(f"{path}.compared{rank}") as f:
                    assert f.read() == "3", (name, rank)
    ref = logs.pop("pp1")
    for m in logs["pp2_zero0"]:  # timed and metered at PP 2 too (both were empty there)
        assert set(m["time_breakdown_s"]) == {"forward", "backward", "pipeline", "optimizer"}
        assert all(v > 0 for v in m["time_breakdown_s"].values()), m
        assert m["activation_bytes"] > 0, m
    for name, log in logs.items():
        assert [m["iteration"] for m in log] == list(range(1, 4)), name
        for a, b in zip(log, ref):
            for key in ("loss", "grad_norm"):
                assert abs(a[key] - b[key]) <= 1e-5 * abs(b[key]), (name, key, a, b)


def _count_gathers(ps, cfg):
    """_pretrain_rank, with each step's all-gather bytes on this rank, the bytes one gather
    of every partitioned unit and one publication of the whole ones move, and the most
    parameter bytes held at once (``model_state_bytes()["params"]`` read before every
    free of a gathered unit), written as JSON beside the --log-json file."""

    from hybrid.train import trainer as training
    from tests.helpers.launch import pretrain_rank_with
    orig = training.train_step
    seen = {"steps": [], "peak": 0}

    def step(model, engine, *args, **kwargs):
        if not seen["steps"]:
            frac = (ps.dp_size - 1) / ps.dp_size  # (what the comm door counts of a gather)
            for key, part in (("unit", True), ("whole", False)):
                seen[key] = sum(u.padded * engine.dtype.itemsize * frac
                                for u in engine.units if u.partition_params is part)
            for u in engine.units:
                free = u.release

                def release(u=u, free=free):
                    if u.gathered:
                        seen["peak"] = max(seen["peak"], engine.model_state_bytes()["params"])
                    free()
                u.release = release
        before = ps.comm_stats.snapshot()["all_gather"]
        out = orig(model, engine, *args, **kwargs)
        seen["steps"].append(ps.comm_stats.snapshot()["all_gather"] - before)
        return out

    return pretrain_rank_with(ps, cfg, training, "train_step", step, "gathers",
                              lambda: seen)


def test_zero3_stages_gather_once_a_step_unless_told_to_reshard(tmp_path):
    """PP 2 x DP 2 at ZeRO 3 with m = 4 micro-batches a step: by default each stage gathers
    every partitioned unit once a step and holds it to its last backward (under 1F1B, ZB-H1
    and, per chunk, interleaved 1F1B); with
    --pipeline-reshard-after-micro-batch it frees them after each forward and backward,
    gathering each 2m times. Per rank and step the all-gather bytes are exactly the whole
    units' publication plus 1 (2m) times one gather of the partitioned ones; the default
    holds more parameter bytes at once; the losses and grad norms of the two are equal,
    and every run's within 1e-5 of PP 1 at DP 2, ZeRO 3."""
    import json
    m = 4  # --global-batch-size 16 / (--micro-batch-size 2 x DP 2)
    pp2 = ["--pipeline-model-parallel-size", "2"]
    runs = {"pp1": (2, []), "held": (4, pp2),
            "reshard": (4, pp2 + ["--pipeline-reshard-after-micro-batch"]),
            "zb_h1": (4, pp2 + ["--pipeline-schedule", "zb_h1"]),
            "vpp2": (4, pp2 + ["--virtual-pipeline-model-parallel-size", "2"])}
    logs, seen = {}, {}
    for name, (n, extra) in runs.items():
        path = str(tmp_path / f"{name}.jsonl")
        r = pretrain(n, TINY + ["--num-layers", "8", "--hidden-size", "32",
                                "--untie-embeddings-and-output-weights", "--zero-stage", "3",
                                "--zero-param-persistence-threshold", "0",
                                "--global-batch-size", "16", "--train-iters", "2",
                                "--log-json", path] + extra,
                     rank_fn=_count_gathers if n == 4 else None)
        assert r.returncode == 0, f"{name}:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
        logs[name] = read_json_log(path)
        if n == 4:
            for rank in range(4):
                with open(f"{path}.gathers{rank}") as f:
                    seen[name, rank] = json.load(f)
    for a, b in zip(logs["held"], logs["reshard"]):
        assert (a["loss"], a["grad_norm"]) == (b["loss"], b["grad_norm"]), (a, b)
    for name in ("held", "zb_h1", "vpp2"):
        assert len(logs[name]) == 2, name
        for a, b in zip(logs[name], logs["pp1"]):
            for key in ("loss", "grad_norm"):
                assert abs(a[key] - b[key]) <= 1e-5 * abs(b[key]), (name, key, a, b)
    for rank in range(4):
        held, reshard = seen["held", rank], seen["reshard", rank]
        assert held["unit"] > 0, held
        for name in ("held", "zb_h1", "vpp2"):  # (interleaved: each chunk's units once)
            got = seen[name, rank]
            assert got["steps"] == [got["whole"] + got["unit"]] * 2, (name, rank, got)
        assert reshard["steps"] == [held["whole"] + 2 * m * held["unit"]] * 2, (rank, reshard)
        assert held["peak"] > reshard["peak"], (rank, held, reshard)
    print({k: {f: v[f] for f in ("unit", "whole", "steps", "peak")} for k, v in seen.items()})



def test_the_speculative_host_step_under_a_pipeline_changes_no_bit(tmp_path):
    """PP 2 x DP 2, ZeRO 3 with optimizer and parameters on NVMe, tiles of 1024 elements
    (so the shard spans many and the read-ahead is 3 of them): the speculative update of
    the read-ahead tiles, made while the other stage drains and kept where the clip does
    not bind (--clip-grad 100), gives the curve of --no-offload-speculative-step bit for
    bit, and rank 0's log counts it used every step ([Note: what starts before the step]
    in hybrid/zero/offload/host_step.py)."""
    logs = {}
    for name, extra in (("on", []), ("off", ["--no-offload-speculative-step"])):
        path = str(tmp_path / f"{name}.jsonl")
        r = pretrain(4, TINY + ["--pipeline-model-parallel-size", "2", "--zero-stage", "3",
                                "--untie-embeddings-and-output-weights",
                                "--offload-optimizer", "nvme", "--offload-param", "nvme",
                                "--offload-nvme-path", str(tmp_path / name),
                                "--offload-buffer-size", "1024", "--clip-grad", "100",
                                "--global-batch-size", "8", "--train-iters", "3",
                                "--log-json", path] + extra)
        assert r.returncode == 0, f"{name}:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
        logs[name] = read_json_log(path)
    on, off = logs["on"], logs["off"]
    assert [m["iteration"] for m in on] == [m["iteration"] for m in off] == [1, 2, 3]
    for a, b in zip(on, off):
        assert (a["loss"], a["grad_norm"]) == (b["loss"], b["grad_norm"]), (a, b)
        assert a["grad_norm"] < 100  # (the clip does not bind: the speculation is kept)
        assert a["offload_speculation"] == {"speculated": 3, "used": 3, "discarded": 0}, a
        assert "offload_speculation" not in b, b
