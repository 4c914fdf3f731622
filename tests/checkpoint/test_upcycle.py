"""scripts/upcycle_checkpoint.py: a dense checkpoint (Llama-shaped, SwiGLU, no biases)
trained 2 steps at DP 2 becomes an MoE one of 4 experts, top 2: the upcycled model's
logits equal the dense model's (every expert is the dense MLP and the gates sum to 1),
on MoE layers every other layer too; training from it runs with the flags it prints.
A dense model with biases, an MoE checkpoint, a pattern that does not fit: one error
each, exit 2, nothing written. A dense checkpoint loaded into an MoE run names the
script."""

import pytest
import torch

from tests.helpers.launch import TINY, pretrain, script_module
from tests.hf.test_hf_llama import _hybrid

LLAMA = [*TINY, "--normalization", "RMSNorm", "--swiglu", "--position-embedding-type",
         "rope", "--global-batch-size", "8", "--mock-data", "--tokenizer-type", "null",
         "--vocab-size", "256"]


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    root = tmp_path_factory.mktemp("dense")
    saves = {}
    for name, extra in (("plain", ["--disable-bias-linear"]), ("biased", [])):
        saves[name] = str(root / name)
        r = pretrain(2, [*LLAMA, *extra, "--train-iters", "2", "--save", saves[name]])
        assert r.returncode == 0, r.stderr[-3000:]
    return saves


@pytest.mark.parametrize("freq", ["1", "[0,1]"])
def test_the_upcycled_model_computes_the_dense_one(dense, tmp_path, capsys, freq):
    out = str(tmp_path / "moe")
    assert script_module("upcycle_checkpoint").main(
        [dense["plain"], out, "--num-experts", "4", "--moe-layer-freq", freq]) == 0
    printed = capsys.readouterr().out
    assert f"--num-experts 4 --moe-router-topk 2 --moe-layer-freq {freq}" in printed, printed
    before, after = _hybrid(dense["plain"]), _hybrid(out)
    moe_layers = list(after.moe_layers())
    assert moe_layers == ([0, 1] if freq == "1" else [1])
    w = after.blocks[1].mlp.experts.fc  # each expert [gate; up] of the dense MLP
    dense_fc = before.blocks[1].mlp.fc.weight.reshape(-1, 64)
    assert tuple(w.shape) == (4, *dense_fc.shape)
    assert all(torch.equal(w[e], dense_fc) for e in range(4))
    x = torch.randint(0, 256, (2, 32))
    with torch.no_grad():  # (the vocabulary's 257 ids: the padding rows are -inf)
        a, b = before(x)[..., :257], after(x)[..., :257]
    assert (a - b).abs().max() <= 1e-5 * a.abs().max()
    # the router draws differ by layer; the function does not depend on them
    r = pretrain(2, [*LLAMA, "--disable-bias-linear", "--train-iters", "1", "--load", out,
                     "--finetune", *printed.split(" plus ", 1)[1].split()])
    assert r.returncode == 0, r.stderr[-3000:]


def test_what_cannot_be_upcycled_is_one_error(dense, tmp_path, capsys):
    main = script_module("upcycle_checkpoint").main
    cases = [([dense["biased"]], "the dense model's MLPs have biases and experts have none; "
                                 "upcycle a model trained with --disable-bias-linear"),
             ([dense["plain"], "--moe-layer-freq", "[1]"], "--moe-layer-freq '[1]' names 1 "
                                                          "layers")]
    for i, (args, said) in enumerate(cases):
        out = tmp_path / f"out{i}"
        capsys.readouterr()
        assert main([args[0], str(out), "--num-experts", "4", *args[1:]]) == 2
        err = capsys.readouterr().err
        assert err.startswith("upcycle_checkpoint.py: error: ") and said in err, err
        assert not out.exists() or not any(out.iterdir())
    moe = str(tmp_path / "moe")
    assert main([dense["plain"], moe, "--num-experts", "4"]) == 0
    capsys.readouterr()
    assert main([moe, str(tmp_path / "again"), "--num-experts", "4"]) == 2
    assert "already has MoE layers" in capsys.readouterr().err


def test_a_dense_checkpoint_into_an_moe_run_names_the_script(dense):
    r = pretrain(1, [*LLAMA, "--disable-bias-linear", "--train-iters", "1", "--num-experts",
                     "4", "--load", dense["plain"]])
    assert r.returncode == 2 and "scripts/upcycle_checkpoint.py" in r.stderr, r.stderr[-2000:]
