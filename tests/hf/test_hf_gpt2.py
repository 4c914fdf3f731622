"""Hugging Face GPT-2 export and import give the same logits as hybrid."""

import json
import os

import pytest
import torch

from tests.helpers.harness import run_ranks
from tests.helpers.launch import TINY, pretrain, run_script

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

VOCAB = 257


def _tokens():
    return torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(9))


def _hybrid_logits_from_merged(ckpt):
    from dataclasses import replace

    from hybrid.checkpoint.full_model import saved_model_config
    from hybrid.checkpoint.reshard import merged_state
    from hybrid.parallel.state import ParallelState
    from models.gpt import GPT
    meta, state = merged_state(ckpt)
    assert meta["vocab_size"] == VOCAB
    cfg = replace(saved_model_config(meta), hidden_dropout=0, attention_dropout=0)
    model = GPT(cfg, ParallelState.single().tp_group).eval()
    rows = model.padded_vocab_size
    assert rows == 384  # 257 padded to a multiple of 128 at TP 1
    sd = {n: s["master"] for n, s in state.items()}
    sd["wte.weight"] = torch.nn.functional.pad(sd["wte.weight"][:VOCAB], (0, 0, 0, rows - VOCAB))
    model.load_state_dict(sd)
    with torch.no_grad():
        return model(_tokens())[..., :VOCAB]


def test_export_loads_in_transformers_with_the_same_logits(tmp_path):
    save, out = str(tmp_path / "ckpt"), str(tmp_path / "hf")
    r = pretrain(2, TINY + ["--tensor-model-parallel-size", "2", "--zero-stage", "1",
                            "--global-batch-size", "4", "--train-iters", "2", "--save", save])
    assert r.returncode == 0, r.stderr[-3000:]
    r = run_script("export_hf", [save, out])
    assert r.returncode == 0, r.stderr
    hf = transformers.GPT2LMHeadModel.from_pretrained(out).eval()
    with torch.no_grad():
        theirs = hf(_tokens()).logits
    ours = _hybrid_logits_from_merged(os.path.join(save, "iter_0000002"))
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)


def _load_imported(ps, save):
    from hybrid.checkpoint import load_checkpoint
    from hybrid.config import Flags, build_config
    from hybrid.errors import CheckpointError
    from hybrid.tensor_parallel import seed_all
    from hybrid.train.setup import build_model
    from tests.helpers.zero_reference import zero_engine
    flags = dict(tensor_model_parallel_size=ps.tp_size, num_layers=2, hidden_size=32,
                 num_attention_heads=4, seq_length=32, zero_stage=3, hidden_dropout=0.0,
                 attention_dropout=0.0, zero_param_persistence_threshold=0)
    rng = seed_all(0, ps.tp_rank, ps.dp_rank, ps.device)
    exact = build_config(Flags(**flags), ps.world_size)  # (gelu_new is --openai-gelu)
    model = build_model(exact, ps, VOCAB, rng)
    with pytest.raises(CheckpointError, match="trained with the tanh GELU.*add --openai-gelu"):
        load_checkpoint(save, zero_engine(model, ps, exact), ps, exact.seed, rng, VOCAB)
    cfg = build_config(Flags(**flags, openai_gelu=True), ps.world_size)
    model = build_model(cfg, ps, VOCAB, rng).eval()
    engine = zero_engine(model, ps, cfg)
    assert load_checkpoint(save, engine, ps, cfg.seed, rng, VOCAB) == (0, 0)
    with torch.no_grad():
        return model(_tokens())


def _import(tmp_path, activation):
    hf_dir, save = str(tmp_path / f"gpt2-{activation}"), str(tmp_path / f"imported-{activation}")
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2,
                                     n_head=4, activation_function=activation,
                                     initializer_range=0.3)  # GELU inputs where the two differ
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(config).eval()
    hf.save_pretrained(hf_dir)
    r = run_script("import_hf", [hf_dir, save])
    assert r.returncode == 0, r.stderr
    assert "--num-layers 2 --hidden-size 32" in r.stdout
    assert ("--openai-gelu" in r.stdout) == (activation == "gelu_new"), r.stdout
    with torch.no_grad():
        return save, hf(_tokens()).logits


def test_import_of_a_gpt2_on_disk_trains_from_it_in_any_layout(tmp_path):
    """gelu_new (GPT-2's tanh GELU) imports as --openai-gelu: loaded at TP2 x DP2 under
    ZeRO-3 with it, the logits are Hugging Face's; without it, the load is refused.
    activation_function "gelu" imports as the exact GELU (one process)."""
    save, theirs = _import(tmp_path, "gelu_new")
    res = run_ranks(_load_imported, world_size=4, tp=2, args=(save,))  # TP2 x DP2, ZeRO-3
    tanh = torch.cat([res[0], res[1]], dim=-1)[..., :VOCAB]
    torch.testing.assert_close(tanh, theirs, rtol=1e-5, atol=1e-5)
    save, theirs = _import(tmp_path, "gelu")  # the same weights (seed 0)
    ours = _hybrid_logits_from_merged(os.path.join(save, "iter_0000000"))
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    assert (ours - tanh).abs().max() > 1e-3  # 50x the tolerance: each check above can fail


def test_import_refuses_a_non_gpt2_config(tmp_path):
    d = tmp_path / "bert"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "bert"}))
    r = run_script("import_hf", [str(d), str(tmp_path / "out")])
    assert r.returncode == 2 and "expected gpt2" in r.stderr
