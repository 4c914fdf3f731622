"""A Megatron-LM launch script runs with only the entry point renamed: Megatron's
preprocessing command line, its GPT-3 example's flag arrays (ramp-up, warmup fraction,
fp16, TP, save/load, TensorBoard) under torchrun, and a resume from its own save; and the
175B script with its pipeline kept (TP 2 x PP 2), its flags run on pooled ranks, resuming
on the straight run's curve."""

import json
import os
import re
import shutil
import subprocess
import sys

from tests.helpers.launch import ROOT, env, free_port, pretrain, read_json_log, run_script

SCRIPT = os.path.join(ROOT, "examples", "megatron", "train_gpt3_shrunk.sh")
SCRIPT_PP2 = os.path.join(ROOT, "examples", "megatron", "train_gpt3_175b_pp2.sh")
TEXT = ("It was the best of times, it was the worst of times, it was the age of wisdom, "
        "it was the age of foolishness, it was the epoch of belief. ")



def _run(cmd, **kw):
    r = subprocess.run(cmd, capture_output=True, check=False, text=True, env=kw.pop("env", env()),
                       cwd=ROOT, **kw)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r


def _megatron_data(tmp_path, run=_run):
    """Megatron's data pipeline: GPT-2 BPE files, JSONL in, <prefix>_text_document out.
    Returns (vocab, merges, data prefix)."""
    (tmp_path / "corpus.txt").write_text(TEXT * 40)
    run([sys.executable, "scripts/train_tokenizer.py", "--input", str(tmp_path / "corpus.txt"),
         "--vocab-size", "300", "--output-dir", str(tmp_path / "tok")])
    with open(tmp_path / "docs.jsonl", "w") as f:
        for i in range(200):
            f.write(json.dumps({"text": f"{i} " + TEXT * (1 + i % 3)}) + "\n")
    vocab, merges = str(tmp_path / "tok" / "vocab.json"), str(tmp_path / "tok" / "merges.txt")
    run([sys.executable, "scripts/preprocess_data.py", "--input", str(tmp_path / "docs.jsonl"),
         "--output-prefix", str(tmp_path / "my-gpt3"), "--tokenizer-type", "GPT2BPETokenizer",
         "--vocab-file", vocab, "--merge-file", merges, "--append-eod", "--workers", "1"])
    data = str(tmp_path / "my-gpt3_text_document")
    assert os.path.isfile(data + ".bin") and os.path.isfile(data + ".idx")
    return vocab, merges, data


def _in_process(cmd):
    """A scripts/*.py command line run through the script's main() in this process."""
    r = run_script(os.path.basename(cmd[1])[: -len(".py")], cmd[2:])
    assert r.returncode == 0, (cmd, r.stderr[-3000:])


def test_megatron_gpt3_example_runs_renamed_and_resumes(tmp_path):
    """examples/megatron/train_gpt3_shrunk.sh under torchrun as Megatron runs it (the data
    prepared by the scripts' own command lines, in this process); then its flags with
    more iterations, as it hands them to torchrun, resume from its own --save (== --load)
    on pooled ranks."""
    vocab, merges, data = _megatron_data(tmp_path, _in_process)

    ckpt, tb = str(tmp_path / "ckpt"), str(tmp_path / "tb")
    e = dict(env(), GPUS_PER_NODE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
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
    launch, args = _script_argv(tmp_path, SCRIPT, ckpt, tb, vocab, merges, data,
                                GPUS_PER_NODE="2", TRAIN_ITERS="10")
    assert launch[:2] == ["--nproc_per_node", "2"], launch
    r = pretrain(2, args)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "at iteration 8 (48 samples consumed)" in r.stdout, r.stdout[-3000:]
    assert re.findall(r"iteration\s+(\d+)/\s*10 ", r.stdout) == ["9", "10"], r.stdout[-3000:]


def _script_argv(tmp_path, script, *positional, **environ):
    """What ``script`` hands torchrun: run it with a ``torchrun`` on PATH that only writes
    down its argv. Returns (torchrun's arguments, pretrain_gpt.py's)."""
    stub = tmp_path / "bin" / "torchrun"
    stub.parent.mkdir(exist_ok=True)
    stub.write_text(f'#!/bin/sh\n"{sys.executable}" -c "import json, sys; '
                    f'print(json.dumps(sys.argv[1:]))" "$@" > "$ARGV_OUT"\n')
    stub.chmod(0o755)
    out = tmp_path / "argv.json"
    e = dict(env(), PATH=f"{stub.parent}{os.pathsep}{os.environ['PATH']}", ARGV_OUT=str(out),
             **environ)
    _run(["bash", script, *positional], env=e, timeout=60)
    argv = json.loads(out.read_text())
    at = next(i for i, a in enumerate(argv) if a.endswith("scripts/pretrain_gpt.py"))
    return argv[:at], argv[at + 1:]


def test_megatron_gpt3_175b_script_at_pp2_runs_and_resumes(tmp_path):
    """examples/megatron/train_gpt3_175b_pp2.sh: Megatron's GPT-3 175B script with its
    sizes shrunk and PP kept (TP 2 x PP 2, embeddings tied across the stages, fp16, the
    batch ramp-up, save and load in one directory). Its flags, as it hands them to
    torchrun, run on 4 pooled ranks: 8 steps straight (saving at 4 and 8 by the script's
    --save-interval), then 4 more resumed from its step-4 save, which follow the straight
    run's steps 5-8 within 1e-5."""
    vocab, merges, data = _megatron_data(tmp_path, _in_process)
    logs = {}
    ckpt = tmp_path / "ck"
    for name in ("straight", "resumed"):
        if name == "resumed":  # from the step-4 save: without the pointer and the last save
            os.remove(ckpt / "latest")
            shutil.rmtree(ckpt / "iter_0000008")
        launch, args = _script_argv(tmp_path, SCRIPT_PP2, str(ckpt), str(tmp_path / "tb"),
                                    vocab, merges, data, TRAIN_ITERS="8")
        assert launch[:2] == ["--nproc_per_node", "4"], launch
        assert args[args.index("--pipeline-model-parallel-size") + 1] == "2"
        path = str(tmp_path / f"{name}.jsonl")
        r = pretrain(4, args + ["--log-json", path])
        assert r.returncode == 0, f"{name}:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
        assert "world 4 = TP 2 x DP 1 x PP 2" in r.stdout, r.stdout[:3000]
        logs[name] = read_json_log(path)
    straight, resumed = logs["straight"], logs["resumed"]
    assert [m["iteration"] for m in straight] == list(range(1, 9))
    assert [m["iteration"] for m in resumed] == [5, 6, 7, 8]
    for a, b in zip(resumed, straight[4:]):
        for key in ("loss", "grad_norm"):
            assert abs(a[key] - b[key]) <= 1e-5 * abs(b[key]), (key, a, b)
    assert sorted(os.listdir(tmp_path / "ck")) == [".lock", "iter_0000004", "iter_0000008",
                                                   "latest", "owner.json"]


SCRIPT_MIXTRAL = os.path.join(ROOT, "examples", "megatron", "train_mixtral_shrunk.sh")


def _hf_tokenizer_data(tmp_path, run=_run):
    """A word-level Hugging Face tokenizer.json over TEXT's words, and Megatron data made
    with it by preprocess_data.py's own command line. Returns (tokenizer.json, prefix)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    words = sorted({w for w in TEXT.replace(",", " ").replace(".", " ").split()})
    vocab = {w: i for i, w in enumerate(["<unk>", "</s>", *words, *map(str, range(200))])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    path = str(tmp_path / "tokenizer.json")
    tok.save(path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    with open(tmp_path / "docs.jsonl", "w") as f:
        for i in range(200):
            f.write(json.dumps({"text": f"{i} " + TEXT * (1 + i % 3)}) + "\n")
    run([sys.executable, "scripts/preprocess_data.py", "--input", str(tmp_path / "docs.jsonl"),
         "--output-prefix", str(tmp_path / "mixtral"), "--tokenizer-type",
         "HuggingFaceTokenizer", "--tokenizer-model", path, "--append-eod", "--workers", "1"])
    return path, str(tmp_path / "mixtral_text_document")


def test_megatron_mixtral_script_runs_with_pp_and_ep_and_resumes(tmp_path):
    """examples/megatron/train_mixtral_shrunk.sh: Megatron's Mixtral 8x7B script with its
    sizes shrunk and its parallelism kept (PP 4 x EP 2 of 8 ranks, 8 experts, top 2, the
    alltoall dispatcher, --sequence-parallel at TP 1 dropped as Megatron drops it,
    --no-position-embedding beside RoPE, Llama2Tokenizer from the model's tokenizer.json),
    its flags run on 8 pooled ranks: 4 steps with the MoE layers' numbers in every line,
    saved at 4; then one more step from its own save, as its --no-load-optim --no-load-rng
    say."""
    tok, data = _hf_tokenizer_data(tmp_path, _in_process)
    ckpt = str(tmp_path / "ckpt")
    for iters in ("4", "5"):
        launch, args = _script_argv(tmp_path, SCRIPT_MIXTRAL, ckpt, tok, data,
                                    TRAIN_ITERS=iters)
        assert launch[:2] == ["--nproc_per_node", "8"], launch
        path = str(tmp_path / f"run{iters}.jsonl")
        r = pretrain(8, args + ["--log-json", path])
        assert r.returncode == 0, f"{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
        assert "world 8 = TP 1 x DP 2 x PP 4" in r.stdout and "EP groups" in r.stdout
        log = read_json_log(path)
        assert all(sorted(m["moe"]) == [f"layer_{i}" for i in range(4)] for m in log)
        assert "moe layer 3: aux loss" in r.stdout
    first, second = read_json_log(str(tmp_path / "run4.jsonl")), log
    assert [m["iteration"] for m in first] == list(range(1, 5))
    assert [m["iteration"] for m in second] == [5]
    assert first[-1]["loss"] < first[0]["loss"]
    assert sorted(os.listdir(ckpt))[:3] == [".lock", "iter_0000004", "iter_0000005"]
