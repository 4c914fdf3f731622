"""Megatron's checkpoint flags end to end: --no-save-optim, --no-load-optim, --finetune.

One chain of short pretrain_gpt.py runs (pooled ranks, the TINY model) is
checked against a one-process plain-torch reference that starts from the saved
weights with a fresh torch.optim.AdamW -- what "weights only, fresh optimizer"
must mean. (Bytes read per rank for these loads: tests/checkpoint/test_checkpoint_io.py.)
"""

import json
import os
import re

import pytest

from hybrid.checkpoint.files import find_checkpoint, read_metadata
from hybrid.errors import CheckpointError
from tests.helpers.foreign_checkpoints import FOREIGN, write_foreign
from tests.helpers.launch import TINY, pretrain, read_json_log, script_module

# Adam eps 1e-4: the attention key bias has an exactly-zero true gradient, whose
# rounding noise a tiny eps would turn into full-size steps (see tests/zero/test_zero.py).
BASE = TINY + ["--global-batch-size", "8", "--adam-eps", "1e-4"]


def _args(tp, stage, *extra):
    return BASE + ["--tensor-model-parallel-size", str(tp), "--zero-stage", str(stage),
                   "--zero-param-persistence-threshold", "0", *extra]


def _ok(r):
    assert r.returncode == 0, f"{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
    return r


def _fails_naming(r, *needles):
    assert r.returncode != 0, r.stdout[-2000:]
    for n in needles:
        assert n in r.stderr, r.stderr[-3000:]


def _meta(ckpt):
    with open(os.path.join(ckpt, "metadata.json")) as f:
        return json.load(f)


def _reference(ckpt, consumed, iteration, steps):
    """One process, plain torch: the TP-1 GPT holding ``ckpt``'s master weights, a fresh
    torch.optim.AdamW (decay on matrices only), clip_grad_norm_, the global batches
    from sample ``consumed`` on, the LR of iterations ``iteration + 1`` on. Returns
    the loss of each step (the first: the saved model's loss on that batch)."""
    import torch

    from hybrid.checkpoint import merged_state
    from hybrid.config import build_config, parse_args
    from hybrid.config.lr_schedule import scheduled_lr
    from hybrid.data.dataset import build_datasets, dp_micro_batches
    from hybrid.data.tokenizer import build_tokenizer
    from hybrid.parallel.state import ParallelState
    from hybrid.tensor_parallel import seed_all
    from hybrid.train.setup import build_model
    cfg = build_config(parse_args(_args(1, 0)), 1)
    ps = ParallelState.single()
    tokenizer = build_tokenizer(cfg.tokenizer)
    samples = build_datasets(cfg.data, tokenizer)["train"]
    model = build_model(cfg, ps, tokenizer.vocab_size, seed_all(cfg.seed, 0, 0, ps.device))
    _, state = merged_state(ckpt)
    with torch.no_grad():
        for name, p in model.named_parameters():
            w = state[name]["master"]
            n = min(w.shape[0], p.shape[0])  # the padded vocabulary depends on the TP size
            p.zero_()
            p[:n].copy_(w[:n])
    params = list(model.parameters())
    z, s = cfg.adamw, cfg.loop
    gbs = s.global_batch_size
    opt = torch.optim.AdamW([{"params": [p for p in params if p.ndim >= 2],
                              "weight_decay": z.weight_decay},
                             {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}],
                            lr=cfg.lr_schedule.lr, betas=(z.beta1, z.beta2), eps=z.eps)
    losses = []
    for k in range(steps):
        for group in opt.param_groups:
            group["lr"] = scheduled_lr(cfg.lr_schedule, iteration + k + 1, 0)
        opt.zero_grad()
        batches = dp_micro_batches(samples, consumed + k * gbs, gbs, s.micro_batch_size, 0, 1,
                                   ps.device)
        total = 0.0
        for x, y in batches:
            loss = model(x, y) / len(batches)
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(params, z.clip_grad)
        opt.step()
        losses.append(total)
    return losses


def _close(got, want):
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert abs(a - b) <= 1e-5 * abs(b), (got, want)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Pretraining saved weights-only at 3 (``pre``, TP1 x DP2 ZeRO-1); from it
    --no-load-optim to 5 at TP2 ZeRO-3; --finetune into ``ft`` to 2 (TP1 x DP2
    ZeRO-2), the same command again to 4 (a restart), then --load ft --save ft
    --finetune to 5; last --no-load-optim from that full checkpoint to 7 at TP2 ZeRO-1."""
    tmp = tmp_path_factory.mktemp("flags")
    pre, ft = str(tmp / "pre"), str(tmp / "ft")
    logs = {k: str(tmp / f"{k}.jsonl")
            for k in ("pre", "noopt", "ft", "restart", "again", "noopt_full")}
    out = {"pre": pre, "ft": ft, "stdout": {}}
    _ok(pretrain(2, _args(1, 1, "--train-iters", "3", "--save", pre, "--no-save-optim",
                          "--log-json", logs["pre"])))
    _ok(pretrain(2, _args(2, 3, "--load", pre, "--no-load-optim", "--train-iters", "5",
                          "--log-json", logs["noopt"])))
    finetune = _args(1, 2, "--load", pre, "--finetune", "--save", ft)
    out["stdout"]["ft"] = _ok(pretrain(2, finetune + ["--train-iters", "2", "--log-json",
                                                      logs["ft"]])).stdout
    out["ft_meta_at_2"] = _meta(os.path.join(ft, "iter_0000002"))
    out["stdout"]["restart"] = _ok(pretrain(2, finetune + ["--train-iters", "4", "--log-json",
                                                           logs["restart"]])).stdout
    again = _args(1, 2, "--load", ft, "--save", ft, "--finetune", "--train-iters", "5",
                  "--log-json", logs["again"])
    out["stdout"]["again"] = _ok(pretrain(2, again)).stdout
    _ok(pretrain(2, _args(2, 1, "--load", ft, "--no-load-optim", "--train-iters", "7",
                          "--log-json", logs["noopt_full"])))
    out["logs"] = {k: read_json_log(v) for k, v in logs.items()}
    return out


def test_no_save_optim_is_a_third_of_the_bytes(runs):
    """The weights-only checkpoint's data files hold exactly a third of the full one's
    bytes (the same model and TP size, so the same elements: 4 bytes each, not 12),
    and the whole checkpoint is about a third."""
    pre, ft = (os.path.join(runs[k], n) for k, n in (("pre", "iter_0000003"),
                                                     ("ft", "iter_0000004")))

    def size(ckpt, ext=""):
        return sum(os.path.getsize(os.path.join(ckpt, f)) for f in os.listdir(ckpt)
                   if f.endswith(ext))
    assert _meta(pre)["zero_layout"]["columns"] == ["master"]
    assert _meta(ft)["zero_layout"]["columns"] == ["master", "exp_avg", "exp_avg_sq"]
    assert 3 * size(pre, ".bin") == size(ft, ".bin") > 0
    assert 0.33 < size(pre) / size(ft) < 0.36, (size(pre), size(ft))


def test_no_load_optim_keeps_the_position_and_restarts_adam(runs):
    """--no-load-optim from the weights-only checkpoint, resharded to TP2 ZeRO-3:
    iterations 4-5 at samples 32, 40; the losses are the reference's from the saved
    weights with a fresh AdamW on the batches from sample 24 -- the first one the
    saved model's own loss on batch 4."""
    log = runs["logs"]["noopt"]
    assert [(m["iteration"], m["consumed_samples"]) for m in log] == [(4, 32), (5, 40)]
    _close([m["loss"] for m in log], _reference(os.path.join(runs["pre"], "iter_0000003"),
                                                24, 3, 2))


def test_no_load_optim_from_a_full_checkpoint_zeroes_the_moments(runs):
    """--no-load-optim from a checkpoint that has Adam moments (the finetune run's at 5):
    iterations 6-7 follow the reference that restarts AdamW on its weights -- the
    second step would differ with the saved moments."""
    log = runs["logs"]["noopt_full"]
    assert [(m["iteration"], m["consumed_samples"]) for m in log] == [(6, 48), (7, 56)]
    _close([m["loss"] for m in log], _reference(os.path.join(runs["ft"], "iter_0000005"),
                                                40, 5, 2))


def test_finetune_starts_at_iteration_0_and_a_restart_resumes_its_own_series(runs):
    """--finetune: iteration 1 at sample 8, losses = the reference's from the loaded
    weights on the batches from sample 0 (not the pretraining run's: other weights);
    saves record where the run started. The same command again resumes the finetune
    series in --save (iterations 3-4, optimizer included: the same reference curve),
    and so does --load ft --save ft --finetune (iteration 5)."""
    ref = _reference(os.path.join(runs["pre"], "iter_0000003"), 0, 0, 5)
    logs = runs["logs"]
    got = {k: [(m["iteration"], m["consumed_samples"]) for m in logs[k]]
           for k in ("ft", "restart", "again")}
    assert got == {"ft": [(1, 8), (2, 16)], "restart": [(3, 24), (4, 32)], "again": [(5, 40)]}
    _close([m["loss"] for k in ("ft", "restart", "again") for m in logs[k]], ref)
    assert abs(logs["ft"][0]["loss"] - logs["pre"][0]["loss"]) > 1e-3
    assert "finetuning from" in runs["stdout"]["ft"]
    for k in ("restart", "again"):
        assert "resumes instead of starting over" in runs["stdout"][k]
    origin = {"load": runs["pre"], "checkpoint": os.path.join(runs["pre"], "iter_0000003"),
              "iteration": 3}
    assert runs["ft_meta_at_2"]["finetune"] == origin
    assert _meta(os.path.join(runs["ft"], "iter_0000005"))["finetune"] == origin
    # untouched
    assert sorted(os.listdir(runs["pre"])) == [".lock", "iter_0000003", "latest", "owner.json"]


def test_weights_only_checkpoint_refuses_an_exact_resume(runs):
    _fails_naming(pretrain(2, _args(1, 1, "--load", runs["pre"], "--train-iters", "4")),
                  "iter_0000003: saved with --no-save-optim", "--no-load-optim", "--finetune")


def test_finetune_refuses_a_save_directory_of_another_run(runs):
    """--finetune with --save equal to --load on a pretraining directory would write
    its iteration-N saves among (and over) the ones it started from."""
    _fails_naming(pretrain(2, _args(1, 1, "--load", runs["pre"], "--save", runs["pre"],
                                    "--finetune", "--train-iters", "3")),
                  f"--save {runs['pre']} already holds iter_0000003 of a run not started "
                  f"with --finetune (it is the --load directory)", "new directory")
    assert sorted(os.listdir(runs["pre"])) == [".lock", "iter_0000003", "latest", "owner.json"]


def test_tools_read_a_weights_only_checkpoint(runs, tmp_path, capsys):
    """convert_checkpoint.py and export_hf.py take a --no-save-optim checkpoint;
    --with-optimizer on it is an error naming the flag."""
    import torch

    from hybrid.checkpoint import merged_state
    _, state = merged_state(os.path.join(runs["pre"], "iter_0000003"))
    convert = script_module("convert_checkpoint")
    out = str(tmp_path / "merged.pt")
    assert convert.main([runs["pre"], out]) == 0
    merged = torch.load(out)["model"]
    assert set(merged) == set(state)
    assert all(torch.equal(merged[n], s["master"]) for n, s in state.items())
    assert convert.main([runs["pre"], str(tmp_path / "opt.pt"), "--with-optimizer"]) == 2
    assert "saved with --no-save-optim" in capsys.readouterr().err
    pytest.importorskip("safetensors")
    from safetensors.torch import load_file
    hf = str(tmp_path / "hf")
    assert script_module("export_hf").main([runs["pre"], hf]) == 0
    wte = load_file(os.path.join(hf, "model.safetensors"))["transformer.wte.weight"]
    assert torch.equal(wte, state["wte.weight"]["master"][: wte.shape[0]])


@pytest.mark.parametrize("fmt", FOREIGN)
def test_load_of_another_framework_s_save_directory_is_refused_by_name(tmp_path, fmt):
    """--load (and a --save directory resumed from) finds no hybrid checkpoint in another
    framework's directory: one error naming the format and a file that shows it, not a
    fresh start. An empty directory stays "nothing to load"."""
    assert find_checkpoint(str(tmp_path)) is None
    write_foreign(tmp_path, FOREIGN[fmt])
    name = re.escape(fmt.removesuffix(" torch_dist"))
    with pytest.raises(CheckpointError, match=rf"^{tmp_path}\S* holds a {name} checkpoint "
                                              rf"\({tmp_path}/\S+\), which hybrid does not read"):
        ckpt = find_checkpoint(str(tmp_path))
        read_metadata(ckpt) if ckpt else None
