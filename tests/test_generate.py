"""scripts/generate.py samples from a sharded checkpoint with the run's tokenizer."""

import os
import subprocess
import sys

from launch import ROOT, TINY, env, pretrain


def test_generate_from_a_tp2_checkpoint(tmp_path):
    save = str(tmp_path / "ckpt")
    r = pretrain(2, TINY + ["--tensor-model-parallel-size", "2", "--train-iters", "30",
                            "--global-batch-size", "4", "--lr", "3e-3", "--save", save])
    assert r.returncode == 0, r.stderr[-3000:]
    cmd = [sys.executable, os.path.join(ROOT, "scripts", "generate.py"), "--load", save,
           "--prompt", "The ", "--max-new-tokens", "24", "--temperature", "0"]
    a = subprocess.run(cmd, capture_output=True, text=True, env=env())
    b = subprocess.run(cmd, capture_output=True, text=True, env=env())
    assert a.returncode == 0, a.stderr
    assert a.stdout == b.stdout and a.stdout.startswith("The ")  # greedy is deterministic
    assert len(a.stdout.encode()) >= len("The ") + 1
    bad = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "generate.py"),
                          "--load", str(tmp_path / "none")], capture_output=True, text=True,
                         env=env())
    assert bad.returncode == 2 and "no such directory" in bad.stderr
