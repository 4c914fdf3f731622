"""How each DeepSpeedExamples script is run: its command line (the script's own flags),
the ds_config where the script reads one, the launcher, and what is compared.

A run launches 2 local ranks on 127.0.0.1 with DeepSpeed's launcher
(``python -m deepspeed.launcher.runner``) or hybrid's (``python -m hybrid.deepspeed``,
the ``hybrid-deepspeed`` command), the same arguments after the script. ``cpu_env/`` is
on PYTHONPATH for both (the package docstring); each rank writes its losses
(``rank<N>.json``: every ``engine.backward(loss)``'s loss and every ``train_batch()``'s)
and the launcher's output is kept. ``compare`` names the losses a run is judged by:
``backward`` for a script that calls it, ``train_batch`` for a pipeline (DeepSpeed's
pipeline engine runs its backward inside ``train_batch``), ``csv`` for a script that
calls ``loss.backward()`` and writes its own losses (rank 0's). ``printed`` are the lines of
the script's own output (or DeepSpeed's on its behalf) compared as text.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import pathlib
import re
import subprocess
import sys
from collections.abc import Callable

HERE = pathlib.Path(__file__).resolve().parent
UPSTREAM = HERE / "upstream"
RECORDED = HERE / "recorded"
ROOT = HERE.parents[2]

# The pipeline example's own ds_config.json asks 256 samples a step (32 micro-batches of
# AlexNet at 224 x 224 on one pipeline): this one, a step of 2 micro-batches, prints every
# step (the example prints nothing of its own; DeepSpeed's engine prints its loss line)
PIPELINE_CONFIG = {
    "train_batch_size": 16, "train_micro_batch_size_per_gpu": 8,
    "optimizer": {"type": "Adam", "params": {"lr": 0.001, "betas": [0.9, 0.999], "eps": 1e-8}},
    "steps_per_print": 1, "wall_clock_breakdown": False,
}


@dataclasses.dataclass(frozen=True)
class Run:
    script: str  # under upstream/
    args: tuple[str, ...]
    compare: str  # "backward" or "train_batch"
    printed: str  # a regex: the output lines compared as text
    cifar_size: int = 320  # synthetic CIFAR-10 training images (cpu_env/vision/torchvision)
    ds_config: dict | None = None  # written to ds_config.json in the run's directory
    # the losses a script writes itself (a CSV of step,loss on rank 0), when it calls
    # loss.backward() rather than engine.backward(loss): compare is then "csv"
    loss_csv: str | None = None
    bf16: bool = False  # the losses are bf16 numbers: compared within one bf16 ulp
    # what the run's directory needs before the script starts (its files), made by the
    # harness so both runs read the same
    setup: Callable[[pathlib.Path], None] | None = None
    # the stand-ins the script needs (cpu_env/<name>/ on PYTHONPATH): "vision" (torchvision),
    # "text" (datasets), "tracking" (wandb); only those, as transformers takes any
    # importable torchvision for the real one
    standins: tuple[str, ...] = ("vision",)
    # the run whose recording this one is held to, when DeepSpeed cannot run this one on a
    # CPU (its SuperOffload asserts a CUDA device) and documents the same numbers as that
    # one's; None: its own recording
    against: str | None = None

    def recording(self, name: str) -> pathlib.Path:
        return RECORDED / f"{self.against or name}.json"


def _cifar(stage: int) -> Run:
    # the script's own flags: its ZeRO stage, fp32 (a CPU has no fast fp16), one epoch of
    # the 320 synthetic images (20 steps of its 16-sample batch at DP 2), a line per 5 steps
    return Run("cifar/cifar10_deepspeed.py",
               ("--deepspeed", "--dtype", "fp32", "--stage", str(stage), "--epochs", "1",
                "--log-interval", "5"),
               compare="backward", printed=r"^\[ *1, +\d+\] loss: +[\d.]+$|^Accuracy.*")


def _cifar_moe(stage: int, residual: bool = False, against: str | None = None) -> Run:
    # run_ds_moe.sh's MoE flags (2 experts over EP 2, top-1, RSample noise, the experts'
    # own optimizer groups) or run_ds_prmoe.sh's (a residual MoE layer of 2 experts and
    # one of 4), on the stage's run above
    experts = ("2", "4") if residual else ("2",)
    mlp = ("--mlp-type", "residual") if residual else ()
    base = _cifar(stage)
    return dataclasses.replace(
        base, args=(*base.args, "--moe", "--ep-world-size", "2", "--num-experts", *experts,
                    "--top-k", "1", *mlp, "--noisy-gate-policy", "RSample",
                    "--moe-param-group"), against=against)


_BF16 = UPSTREAM / "bf16_master_weight"


def _words():
    """The datasets stand-in's words module, loaded by its path: importing it as
    ``datasets`` here would shadow the real package in this process."""
    spec = importlib.util.spec_from_file_location(
        "_example_words", HERE / "cpu_env" / "text" / "datasets" / "words.py")
    assert spec is not None and spec.loader is not None
    words = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(words)
    return words


def _save_word_tokenizer(folder: pathlib.Path, special: dict[str, str],
                         extra: tuple[str, ...] = ()) -> int:
    """A word-level tokenizer over the datasets stand-in's words (and ``extra``), with the
    ``special`` tokens (role -> token, e.g. ``{"eos_token": "</s>"}``), saved in
    ``folder`` as a Hugging Face tokenizer directory; returns its vocabulary size."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(dict.fromkeys([*special.values(), *extra,
                                                        *_words().WORDS]))}
    core = Tokenizer(models.WordLevel(vocab, unk_token=special["unk_token"]))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=core, **special).save_pretrained(str(folder))
    return len(vocab)


def _word_tokenizer(workdir: pathlib.Path) -> None:
    """``workdir/tokenizer``: the word-level tokenizer with RoBERTa's special tokens (what
    HelloDeepSpeed's ``--tokenizer`` loads with ``AutoTokenizer``; its default,
    roberta-base, is a download)."""
    _save_word_tokenizer(workdir / "tokenizer", {
        "bos_token": "<s>", "pad_token": "<pad>", "eos_token": "</s>", "unk_token": "<unk>",
        "mask_token": "<mask>"})


def _tiny_llama(workdir: pathlib.Path) -> None:
    """``workdir/model``: a Llama of 2 layers, hidden 64, seeded, saved in fp32 with the
    word-level tokenizer beside it (Llama's special tokens, no pad token, and the words
    of the Alpaca template): what SuperOffload's ``--model_name`` loads with
    ``from_pretrained`` (its scripts name 8B-70B models, downloads)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = workdir / "model"
    vocab = _save_word_tokenizer(folder, {"bos_token": "<s>", "eos_token": "</s>",
                                          "unk_token": "<unk>"},
                                 extra=("###", "Instruction", "Input", "Response", ":"))
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=64, bos_token_id=0, eos_token_id=1)
    LlamaForCausalLM(config).save_pretrained(str(folder))


def _superoffload_config(mode: str, batch_size: int) -> dict:
    """The ds_config SuperOffload's ``finetune_llama-8b_1gpu.sh`` writes for ``mode``
    ("superoffload" or "zerooffload") and ``batch_size``, read from the script's own
    here-document."""
    script = (UPSTREAM / "DeepSpeed-SuperOffload" / "finetune_llama-8b_1gpu.sh").read_text()
    body = re.search(rf'"\$MODE" = "{mode}" \]; then\ncat > "\$DS_CONFIG_JSON" << EOF\n'
                     r"(.*?)\nEOF", script, re.S)
    assert body is not None, f"no {mode} config in finetune_llama-8b_1gpu.sh"
    return json.loads(body.group(1).replace("$BATCH_SIZE", str(batch_size)))


def _superoffload(mode: str, against: str | None = None) -> Run:
    # the script's own flags as its .sh passes them (activation checkpointing on, lr 1e-5
    # though the script's optimizer takes its own 1e-3), shrunk: 32 tokens, 6 steps; the
    # attention "eager" (flash-attention is a CUDA package); a step of 4 samples (its .sh's
    # BATCH_SIZE default), 2 a rank
    return Run("DeepSpeed-SuperOffload/finetune_zero3.py",
               ("--deepspeed_config=ds_config.json", "--model_name", "model",
                "--num_train_epochs", "1", "--lr", "1e-5", "--batch_size", "4",
                "--weight_decay", "0.01", "--output_dir", "out", "--seed", "42",
                "--max_length", "32", "--log_interval", "1",
                "--dataset_name", "tatsu-lab/alpaca", "--dataset_percentage", "25.0",
                "--bench_steps", "6", "--warmup_steps", "2", "--activation_checkpointing",
                "--attn_implementation", "eager"),
               # (rank 0's own handler's lines; the loss in them, 4 decimals of a bf16 run's
               # loss, is held by the recorded losses, within one bf16 ulp)
               compare="backward", printed=r"finetune_zero3 - INFO - Step +\d+ \| Loss: ",
               bf16=True,
               ds_config=_superoffload_config(mode, 4), setup=_tiny_llama,
               standins=("text", "tracking"), against=against)


RUNS: dict[str, Run] = {
    **{f"cifar_stage{s}": _cifar(s) for s in (0, 1, 2, 3)},
    # DeepSpeed's MoE layer, at ZeRO 1 and 2 against DeepSpeed; at ZeRO 3, which DeepSpeed
    # refuses with MoE ("not supported with ZeRO Stage 3"), held to ZeRO 2's recording
    # (the same arithmetic, sharded further)
    **{f"cifar_moe_stage{s}": _cifar_moe(s) for s in (1, 2)},
    "cifar_moe_stage3": _cifar_moe(3, against="cifar_moe_stage2"),
    "cifar_prmoe_stage2": _cifar_moe(2, residual=True),
    # the bf16 master-weight example's baseline config (bf16, ZeRO 3, torch_autocast off),
    # its model shrunk by its own flags; it calls loss.backward() and writes its losses
    "bf16_zero3": Run("bf16_master_weight/train.py",
                      ("--deepspeed_config", "ds_config.json",
                       "--hidden_dim", "64", "--num_layers", "2", "--num_heads", "4",
                       "--vocab_size", "512", "--seq_length", "32", "--batch_size", "4",
                       "--num_steps", "6", "--log_interval", "1",
                       "--loss_log_file", "losses.csv"),
                      compare="csv", printed=r"params=\d+", loss_csv="losses.csv",
                      bf16=True,
                      ds_config=json.loads((_BF16 / "configs" / "baseline.json").read_text())),
    # HelloDeepSpeed: a RoBERTa masked LM (its pooler built and never used), bf16, ZeRO 1
    # with the optimizer on the host, its model shrunk by its own flags
    "hello_bert": Run("HelloDeepSpeed/train_bert_ds.py",
                      ("--checkpoint_dir", "experiments", "--tokenizer", "tokenizer",
                       "--num_layers", "1", "--num_heads", "2", "--ff_dim", "64",
                       "--h_dim", "32", "--max_seq_length", "32", "--batch_size", "4",
                       "--num_iterations", "7", "--checkpoint_every", "100",
                       "--log_every", "1", "--dtype", "bf16"),
                      compare="backward", printed=r"Total number of model parameters: [\d,]+",
                      bf16=True, setup=_word_tokenizer, standins=("text",)),
    "pipeline_pp2": Run("pipeline_parallelism/train.py",
                        ("--deepspeed_config=ds_config.json", "-p", "2", "--steps=3",
                         "--backend", "gloo"),
                        compare="train_batch", printed=r"^steps: \d+ loss: [\d.]+",
                        cifar_size=64, ds_config=PIPELINE_CONFIG),
    # SuperOffload's fine-tuning script (an HF Llama, DeepSpeedCPUAdam as its optimizer,
    # bf16, ZeRO 3 with the optimizer on the host) with its .sh's "zerooffload" config
    "superoffload_zerooffload": _superoffload("zerooffload"),
    # its "superoffload" config (ratio 0.8, super_offload, cpuadam_cores_perc): schedules of
    # the same step, which DeepSpeed runs only on CUDA ("SuperOffload only supports NVIDIA
    # CUDA GPUs"): held to the zerooffload recording
    "superoffload_superoffload": _superoffload("superoffload",
                                               against="superoffload_zerooffload"),
}


def start(name: str, tool: str, workdir: pathlib.Path, python: str = sys.executable,
          port: int = 29500) -> subprocess.Popen:
    """Start ``name`` under ``tool`` ("deepspeed" or "hybrid") in ``workdir``; its output
    goes to ``workdir/output.txt``. :func:`finish` reads what it left."""
    run = RUNS[name]
    workdir.mkdir(parents=True, exist_ok=True)
    if run.setup is not None:
        run.setup(workdir)
    if run.ds_config is not None:
        (workdir / "ds_config.json").write_text(json.dumps(run.ds_config))
    env = {**os.environ, "EXAMPLE_RECORD": str(workdir), "OMP_NUM_THREADS": "1",
           "EXAMPLE_CIFAR_SIZE": str(run.cifar_size), "DS_ACCELERATOR": "cpu",
           "PYTHONPATH": os.pathsep.join([str(HERE / "cpu_env"),
                                          *(str(HERE / "cpu_env" / n) for n in run.standins),
                                          str(ROOT)])}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    launcher = (["-m", "deepspeed.launcher.runner"] if tool == "deepspeed"
                else ["-m", "hybrid.deepspeed"])
    cmd = [python, *launcher, "--num_gpus", "2", "--master_port", str(port),
           str(UPSTREAM / run.script), *run.args]
    with open(workdir / "output.txt", "w") as out:  # (the child keeps its own descriptor)
        return subprocess.Popen(cmd, cwd=workdir, env=env, stdout=out,
                                stderr=subprocess.STDOUT)


def finish(name: str, tool: str, workdir: pathlib.Path, proc: subprocess.Popen,
           timeout: float = 600) -> dict:
    """Wait for ``proc`` (:func:`start`); returns ``{"ranks": {rank: losses}, "printed":
    [lines]}``. Raises RuntimeError with the output's tail when the run failed."""
    run = RUNS[name]
    try:
        code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise RuntimeError(f"{name} under {tool} ran past {timeout:.0f} s") from None
    out = (workdir / "output.txt").read_text()
    if code != 0 and tool == "deepspeed" and _torn_down(out, workdir):
        code = 0  # (its result is whole: see _torn_down)
    if code != 0:
        raise RuntimeError(f"{name} under {tool} exited {code}:\n{out[-4000:]}")
    if run.loss_csv is not None:
        rows = (workdir / run.loss_csv).read_text().split()[1:]  # after "step,loss"
        ranks = {0: [float(row.split(",")[1]) for row in rows]}
    else:
        ranks = {r: json.loads((workdir / f"rank{r}.json").read_text())[run.compare]
                 for r in (0, 1)}
    printed = [m.group(0) for line in out.splitlines()
               if (m := re.search(run.printed, line.strip()))]
    return {"ranks": ranks, "printed": printed}


def _torn_down(out: str, workdir: pathlib.Path) -> bool:
    """Whether DeepSpeed's run finished and aborted only in its processes' teardown: every
    rank wrote its losses, and the launcher reports the C++ runtime's "terminate called
    without an active exception" (a background thread still alive at interpreter exit,
    seen once in the peer step with the residual MoE example's extra expert groups).
    The numbers compared are all written by then; any other failure still fails."""
    teardown = "terminate called without an active exception" in out
    return teardown and all((workdir / f"rank{r}.json").exists() for r in (0, 1))


def launch(name: str, tool: str, workdir: pathlib.Path, python: str = sys.executable,
           port: int = 29500, timeout: float = 600) -> dict:
    """:func:`start` and :func:`finish`: one run, to its end."""
    return finish(name, tool, workdir, start(name, tool, workdir, python, port), timeout)
