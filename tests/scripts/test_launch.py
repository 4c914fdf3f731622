"""pretrain_gpt.sh as a multi-node launcher: two "nodes" on one machine."""

import os
import socket
import subprocess

from launch import ROOT, TINY, env, pretrain, read_json_log


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_nodes_train_the_same_curve_as_one_node(tmp_path):
    args = TINY + ["--train-iters", "5", "--global-batch-size", "4", "--zero-stage", "2"]
    one = str(tmp_path / "one.jsonl")
    r = pretrain(2, args + ["--log-json", one])
    assert r.returncode == 0, r.stderr[-3000:]
    two = str(tmp_path / "two.jsonl")
    port = str(_free_port())
    procs = []
    for node in range(2):
        e = dict(env(), NNODES="2", NODE_RANK=str(node), NPROC_PER_NODE="1",
                 MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RDZV_ID=f"test{port}")
        out = open(tmp_path / f"node{node}.log", "w")
        procs.append((subprocess.Popen(["bash", os.path.join(ROOT, "scripts", "pretrain_gpt.sh"),
                                        *args, "--log-json", two], env=e, stdout=out,
                                       stderr=subprocess.STDOUT, cwd=ROOT), out))
    for p, out in procs:
        try:
            assert p.wait(timeout=180) == 0, (tmp_path / "node0.log").read_text()[-3000:]
        finally:
            if p.poll() is None:
                p.kill()
            out.close()
    assert [m["loss"] for m in read_json_log(two)] == [m["loss"] for m in read_json_log(one)]
    assert "world 2 = TP 1 x DP 2" in (tmp_path / "node0.log").read_text() + \
        (tmp_path / "node1.log").read_text()


def test_sigterm_to_the_launcher_saves_the_iteration_in_progress(tmp_path):
    """As scancel or a preemption does it: SIGTERM to pretrain_gpt.sh's launcher, which
    passes it to the workers; with --exit-signal-handler they save and stop together."""
    import re
    import signal
    import time
    save, log = str(tmp_path / "ckpt"), tmp_path / "out.log"
    args = TINY + ["--train-iters", "100000", "--log-interval", "1", "--exit-signal-handler",
                   "--save", save]
    launched = time.time()
    with open(log, "w") as out:
        p = subprocess.Popen(["bash", os.path.join(ROOT, "scripts", "pretrain_gpt.sh"), *args],
                             env=dict(env(), NPROC_PER_NODE="2"), stdout=out,
                             stderr=subprocess.STDOUT, cwd=ROOT)
    try:
        deadline = time.time() + 120
        while " iteration        3/" not in log.read_text() and time.time() < deadline:
            assert p.poll() is None, log.read_text()[-3000:]
            time.sleep(0.1)
        seen = time.time() - launched
        p.send_signal(signal.SIGTERM)  # bash exec'd the launcher: this is its pid
        p.wait(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    text = log.read_text()
    # timed from the script's own start (HYBRID_LAUNCHED_AT), launcher included
    first = re.search(r"first iteration done (\d+\.\d+) s after launch", text)
    assert first and 0 < float(first.group(1)) < seen, text[-3000:]
    m = re.search(r"exiting at iteration (\d+): --exit-signal-handler: SIGTERM received", text)
    assert m, text[-3000:]
    it = int(m.group(1))
    assert it >= 3 and f"saved checkpoint {save}/iter_{it:07d}" in text, text[-3000:]
    assert sorted(os.listdir(save)) == [f"iter_{it:07d}", "latest"]
