"""scripts/generate.py samples from a sharded checkpoint with the run's tokenizer."""

import os
import subprocess
import sys

import pytest
import torch

from tests.helpers.launch import ROOT, TINY, env, pretrain, script_module


def test_generate_from_a_tp2_checkpoint(tmp_path, capsys):
    """The script as a user runs it once; its main() in this process for the rest (the
    same code, without a torch import per call)."""
    save = str(tmp_path / "ckpt")
    r = pretrain(2, TINY + ["--tensor-model-parallel-size", "2", "--train-iters", "6",
                            "--global-batch-size", "4", "--lr", "3e-3", "--save", save])
    assert r.returncode == 0, r.stderr[-3000:]
    flags = ["--load", save, "--prompt", "The ", "--max-new-tokens", "24", "--temperature", "0"]
    a = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "generate.py"), *flags],
                       capture_output=True, check=False, text=True, env=env())
    assert a.returncode == 0, a.stderr
    main = script_module("generate").main
    capsys.readouterr()
    assert main(flags) == 0
    assert capsys.readouterr().out == a.stdout  # greedy is deterministic
    assert a.stdout.startswith("The ") and len(a.stdout.encode()) >= len("The ") + 1
    assert main(["--load", str(tmp_path / "none")]) == 2
    assert "no such directory" in capsys.readouterr().err
    assert main(flags + ["--tokenizer-type", "NullTokenizer", "--vocab-size", "300"]) == 2
    assert capsys.readouterr().err == (
        f"generate.py: error: --load {save}: the checkpoint was trained on a vocabulary of "
        f"257 tokens, this tokenizer has 301: drop the tokenizer flags to use the "
        f"checkpoint's own, or give that one\n")


@pytest.mark.parametrize("flags,message", [
    (["--max-new-tokens", "-1"], "--max-new-tokens must be >= 0, got -1"),
    (["--temperature", "-1"], "--temperature must be a finite number >= 0 (0: greedy), got -1.0"),
    (["--temperature", "nan"], "--temperature must be a finite number >= 0 (0: greedy), got nan"),
    (["--top-k", "-3"], "--top-k must be >= 0 (0: the whole vocabulary), got -3"),
    (["--device", "cuda:7"] if not torch.cuda.is_available() else ["--top-k", "-1"],
     "--device cuda:7: this torch sees no CUDA device" if not torch.cuda.is_available()
     else "--top-k must be >= 0"),
])
def test_bad_sampling_flags_are_named_before_loading(flags, message, tmp_path, capsys):
    main = script_module("generate").main
    assert main(["--load", str(tmp_path / "none"), *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"generate.py: error: {message}") and err.count("\n") == 1, err
