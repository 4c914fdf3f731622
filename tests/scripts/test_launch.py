"""pretrain_gpt.sh as a launcher: two "nodes" on one machine, and the signals a job gets
(SIGTERM to save and stop, kill -9 of the launcher, Ctrl-C)."""

import os
import re
import signal
import subprocess
import time

import pytest

from tests.helpers.launch import (
    ROOT,
    TINY,
    alive,
    child_pids,
    env,
    free_port,
    pretrain,
    read_json_log,
)


def _real_two_hosts_run() -> str | None:
    """Why tests/scripts/test_multinode.py's two-host run proves this test's claim on this
    machine (its namespaces can be made here: root, ``ip`` and ``unshare``), or None where
    that test skips and this one must run. Probed as that test does: its ``two_hosts``
    helper, set up and torn down."""
    import tempfile
    from pathlib import Path

    from tests.scripts.test_multinode import _Unavailable, two_hosts
    try:
        with tempfile.TemporaryDirectory() as tmp, two_hosts(Path(tmp)):
            pass
    except _Unavailable:
        return None
    return ("covered by tests/scripts/test_multinode.py, which runs here: two real hosts "
            "(network namespaces, each its own launcher over its own interface) train the "
            "one-node curve bit for bit")


def test_two_nodes_train_the_same_curve_as_one_node(tmp_path):
    """Two launchers (NNODES 2, a node each) over 127.0.0.1 train the one-node curve at
    DP 2, ZeRO 2. Where network namespaces can be made, test_multinode.py's real two-host
    launch (a stronger form of the same claim) runs on this machine, and this one skips."""
    covered = _real_two_hosts_run()
    if covered:
        pytest.skip(covered)
    args = TINY + ["--train-iters", "5", "--global-batch-size", "4", "--zero-stage", "2"]
    one = str(tmp_path / "one.jsonl")
    r = pretrain(2, args + ["--log-json", one])
    assert r.returncode == 0, r.stderr[-3000:]
    two = str(tmp_path / "two.jsonl")
    port = str(free_port())
    procs = []
    for node in range(2):
        e = dict(env(), NNODES="2", NODE_RANK=str(node), NPROC_PER_NODE="1",
                 MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RDZV_ID=f"test{port}")
        # (the launcher keeps its own copy of the log's descriptor)
        with open(tmp_path / f"node{node}.log", "w") as out:
            procs.append(subprocess.Popen(["bash", os.path.join(ROOT, "scripts", "pretrain_gpt.sh"),
                                           *args, "--log-json", two], env=e, stdout=out,
                                          stderr=subprocess.STDOUT, cwd=ROOT))
    for p in procs:
        try:
            assert p.wait(timeout=180) == 0, (tmp_path / "node0.log").read_text()[-3000:]
        finally:
            if p.poll() is None:
                p.kill()
    assert [m["loss"] for m in read_json_log(two)] == [m["loss"] for m in read_json_log(one)]
    assert "world 2 = TP 1 x DP 2" in (tmp_path / "node0.log").read_text() + \
        (tmp_path / "node1.log").read_text()


def _launch(tmp_path, args):
    """pretrain_gpt.sh on 2 ranks in its own session (a terminal's foreground job), its
    output in files: (process, stdout path, stderr path)."""
    out, err = tmp_path / "stdout", tmp_path / "stderr"
    with open(out, "w") as o, open(err, "w") as e:
        p = subprocess.Popen(["bash", os.path.join(ROOT, "scripts", "pretrain_gpt.sh"), *args],
                             env=dict(env(), NPROC_PER_NODE="2"), stdout=o, stderr=e,
                             cwd=ROOT, start_new_session=True)
    return p, out, err


def _wait_for(p, out, err, text, timeout=120):
    deadline = time.time() + timeout
    while text not in out.read_text():
        assert p.poll() is None and time.time() < deadline, err.read_text()[-3000:]
        time.sleep(0.1)


def _sigterm(tmp_path, target):
    """SIGTERM to the launcher, or to one worker, of a job that saves on it, once it is
    past iteration 3: what the job wrote and how it ended."""
    save = str(tmp_path / "ckpt")
    args = TINY + ["--train-iters", "100000", "--log-interval", "1", "--exit-signal-handler",
                   "--save", save]
    launched = time.time()
    p, out, err = _launch(tmp_path, args)
    try:
        _wait_for(p, out, err, " iteration        3/")
        seen = time.time() - launched
        # bash exec'd the launcher: p.pid is its pid
        os.kill(p.pid if target == "launcher" else child_pids(p.pid)[-1], signal.SIGTERM)
        p.wait(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    return {"save": save, "seen": seen, "out": out.read_text(), "err": err.read_text(),
            "rc": p.returncode}


def _kill_9(tmp_path):
    """SIGKILL to the launcher of a job that saves every iteration, once it is past
    iteration 3: the workers it had, and which of them outlived it by 10 s."""
    save = str(tmp_path / "ckpt")
    p, out, err = _launch(tmp_path, TINY + ["--train-iters", "100000", "--save", save,
                                            "--save-interval", "1"])
    workers = []
    try:
        _wait_for(p, out, err, " iteration        3/")
        workers = child_pids(p.pid)
        p.kill()
        p.wait()
        deadline = time.time() + 10
        while any(map(alive, workers)) and time.time() < deadline:
            time.sleep(0.05)
        outlived = list(filter(alive, workers))
    finally:
        for pid in filter(alive, workers):
            os.kill(pid, signal.SIGKILL)
        if p.poll() is None:
            p.kill()
    return {"save": save, "workers": workers, "outlived": outlived}


def _ctrl_c(tmp_path):
    """SIGINT to the job's process group once it is past iteration 2: its stderr and exit
    code."""
    p, out, err = _launch(tmp_path, TINY + ["--train-iters", "100000"])
    try:
        _wait_for(p, out, err, " iteration        2/")
        os.killpg(p.pid, signal.SIGINT)
        p.wait(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    return {"err": err.read_text(), "rc": p.returncode}


_JOBS = {"sigterm[launcher]": lambda tmp: _sigterm(tmp, "launcher"),
         "sigterm[one worker]": lambda tmp: _sigterm(tmp, "one worker"),
         "kill_9": _kill_9, "ctrl_c": _ctrl_c}


def _job_of(item) -> str | None:
    name = item.originalname
    if name.startswith("test_sigterm"):
        return f"sigterm[{item.callspec.params['target']}]"
    return "kill_9" if name.startswith("test_kill_9") else \
        "ctrl_c" if name.startswith("test_ctrl_c") else None


@pytest.fixture(scope="module")
def jobs(request, tmp_path_factory):
    """The launches of this module's signal tests, each in its own session and directory,
    run at once (each on its own thread, driven as its test describes) and their outcomes
    kept for the tests: a launch is a few seconds of torch imports, one of them the
    launcher's alone with a core idle, so side by side they take well under their sum.
    Only the launches of the tests selected run. A launch that failed raises in its test."""
    from concurrent.futures import ThreadPoolExecutor
    wanted = sorted({j for item in request.session.items if item.module is request.module
                     for j in [_job_of(item)] if j})
    with ThreadPoolExecutor(len(wanted)) as pool:  # (its exit waits for every launch)
        return {j: pool.submit(_JOBS[j], tmp_path_factory.mktemp("job")) for j in wanted}


@pytest.mark.parametrize("target", ["launcher", "one worker"])
def test_sigterm_saves_the_iteration_in_progress_and_exits_with_its_code(jobs, target):
    """As scancel or a preemption does it: SIGTERM to pretrain_gpt.sh's launcher, which
    passes it to the workers, or to one worker alone; with --exit-signal-handler they save
    and stop together, and the job exits 128 + 15 either way."""
    job = jobs[f"sigterm[{target}]"].result()
    save, text = job["save"], job["out"]
    # timed from the script's own start (HYBRID_LAUNCHED_AT), launcher included
    first = re.search(r"first iteration done (\d+\.\d+) s after launch", text)
    assert first and 0 < float(first.group(1)) < job["seen"], text[-3000:]
    m = re.search(r"exiting at iteration (\d+): --exit-signal-handler: SIGTERM received", text)
    assert m, text[-3000:]
    it = int(m.group(1))
    assert it >= 3 and f"saved checkpoint {save}/iter_{it:07d}" in text, text[-3000:]
    names = os.listdir(save)
    assert [n for n in names if "iter_" in n] == [f"iter_{it:07d}"] and "latest" in names
    assert job["rc"] == 128 + signal.SIGTERM, job["err"][-3000:]


def test_kill_9_of_the_launcher_ends_every_worker_and_the_last_checkpoint_loads(jobs):
    """As the OOM killer or a scheduler's hard kill does it: SIGKILL to pretrain_gpt.sh's
    launcher while the job saves every iteration. The kernel ends each worker with it
    (hybrid/train/orphans.py), within 10 s, and the newest checkpoint left behind loads."""
    from hybrid.checkpoint import find_checkpoint
    job = jobs["kill_9"].result()
    assert len(job["workers"]) == 2
    assert not job["outlived"], "workers outlived their launcher by 10 s"
    save = job["save"]
    last = find_checkpoint(save)
    it = int(os.path.basename(last).removeprefix("iter_"))
    r = pretrain(2, TINY + ["--load", save, "--train-iters", str(it + 1)])
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"resumed from {last} at iteration {it}" in r.stdout


def test_ctrl_c_is_one_line(jobs):
    """Ctrl-C (SIGINT to the terminal's foreground job) mid-run: the launcher passes it
    on; the job's whole report is one line, no traceback from any rank, and exit 130."""
    job = jobs["ctrl_c"].result()
    assert job["err"] == "pretrain_gpt.sh: stopped by SIGINT\n"
    assert job["rc"] == 128 + signal.SIGINT
