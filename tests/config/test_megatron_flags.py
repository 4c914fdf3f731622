"""A Megatron-LM launch script runs with only the entry point renamed: Megatron's
preprocessing command line, its GPT-3 example's flag arrays (ramp-up, warmup fraction,
fp16, TP, save/load, TensorBoard) under torchrun, and a resume from its own save."""

import json
import os
import re
import socket
import subprocess
import sys

from tests.helpers.launch import ROOT, env

SCRIPT = os.path.join(ROOT, "examples", "megatron", "train_gpt3_shrunk.sh")
TEXT = ("It was the best of times, it was the worst of times, it was the age of wisdom, "
        "it was the age of foolishness, it was the epoch of belief. ")


def _free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def _run(cmd, **kw):
    r = subprocess.run(cmd, capture_output=True, text=True, env=kw.pop("env", env()),
                       cwd=ROOT, **kw)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r


def test_megatron_gpt3_example_runs_renamed_and_resumes(tmp_path):
    # Megatron's data pipeline: GPT-2 BPE files, JSONL in, <prefix>_text_document out.
    (tmp_path / "corpus.txt").write_text(TEXT * 40)
    _run([sys.executable, "scripts/train_tokenizer.py", "--input", str(tmp_path / "corpus.txt"),
          "--vocab-size", "300", "--output-dir", str(tmp_path / "tok")])
    with open(tmp_path / "docs.jsonl", "w") as f:
        for i in range(200):
            f.write(json.dumps({"text": f"{i} " + TEXT * (1 + i % 3)}) + "\n")
    vocab, merges = str(tmp_path / "tok" / "vocab.json"), str(tmp_path / "tok" / "merges.txt")
    _run([sys.executable, "scripts/preprocess_data.py", "--input", str(tmp_path / "docs.jsonl"),
          "--output-prefix", str(tmp_path / "my-gpt3"), "--tokenizer-type", "GPT2BPETokenizer",
          "--vocab-file", vocab, "--merge-file", merges, "--append-eod", "--workers", "1"])
    data = str(tmp_path / "my-gpt3_text_document")
    assert os.path.isfile(data + ".bin") and os.path.isfile(data + ".idx")

    ckpt, tb = str(tmp_path / "ckpt"), str(tmp_path / "tb")
    e = dict(env(), GPUS_PER_NODE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=_free_port())
    r = _run(["bash", SCRIPT, ckpt, tb, vocab, merges, data], env=e, timeout=300)
    log = r.stdout
    batches = [int(b) for b in re.findall(r"global batch size:\s+(\d+)", log)]
    assert batches == [4, 4, 4, 4, 8, 8, 8, 8]  # --rampup-batch-size 4 4 16 to 8
    assert "consumed samples:         48" in log and "loss scale:" in log  # fp16
    assert "world 2 = TP 2 x DP 1" in log
    assert sorted(os.listdir(ckpt)) == [".lock", "iter_0000004", "iter_0000008", "latest",
                                        "owner.json"]
    assert any(n.startswith("events.out.tfevents") for n in os.listdir(tb))

    # The same script with more iterations resumes from its own --save (== --load).
    e["MASTER_PORT"], e["TRAIN_ITERS"] = _free_port(), "10"
    r = _run(["bash", SCRIPT, ckpt, tb, vocab, merges, data], env=e, timeout=300)
    assert "at iteration 8 (48 samples consumed)" in r.stdout
    assert re.findall(r"iteration\s+(\d+)/\s*10 ", r.stdout) == ["9", "10"]
