"""Hugging Face Llama round trip: a tiny ``LlamaForCausalLM`` made and saved by
transformers itself (GQA, tied and untied) imports into hybrid with the same logits
and the same 32 greedy tokens, exports back bit for bit, and a Llama-shaped model
trained by hybrid at TP 2 exports to a directory transformers loads and generates
from exactly as hybrid does."""


import json

import pytest
import torch

from tests.helpers.harness import run_ranks
from tests.helpers.launch import TINY, pretrain, script_module

transformers = pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors.torch")

VOCAB, NEW = 300, 32
PROMPT = [[5, 17, 200, 3, 99, 42, 7, 250]]


def _tokens(vocab):
    return torch.randint(0, vocab, (2, 24), generator=torch.Generator().manual_seed(9))


def _hf_greedy(hf, vocab=VOCAB):
    with torch.no_grad():
        out = hf.generate(torch.tensor(PROMPT), max_new_tokens=NEW, do_sample=False,
                          pad_token_id=vocab - 1)
    return out[0].tolist()


def _hybrid(ckpt_dir):
    """A checkpoint's model on one process, as scripts/generate.py builds it."""
    from hybrid.checkpoint import resolve_checkpoint
    return script_module("generate").load_model(resolve_checkpoint(ckpt_dir), "cpu")[0]


def refused_on_import(hc: dict, field: str, tmp_path, capsys) -> None:
    """``import_hf`` of a directory holding ``config.json`` ``hc`` alone: refused before any
    weight is read, one line naming ``field``, exit 2, nothing written."""
    hf_dir, save = tmp_path / "hf", tmp_path / "save"
    hf_dir.mkdir()
    (hf_dir / "config.json").write_text(json.dumps(hc))
    capsys.readouterr()
    assert script_module("import_hf").main([str(hf_dir), str(save)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"import_hf.py: error: config.json: {field} "), err
    assert not save.exists()


def exported_exactly(hf, save: str, out: str, kind: str, capsys):
    """``export_hf`` of ``save`` into ``out``: the class transformers loads back is ``kind``
    (its printed name too), and every tensor of ``hf`` comes back bit for bit (the round
    trip moves no number). Returns the loaded model."""
    assert script_module("export_hf").main([save, out]) == 0
    assert f"({kind}, " in capsys.readouterr().out
    back = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(back).__name__ == f"{kind}ForCausalLM"
    mine, theirs = dict(back.state_dict()), hf.state_dict()
    assert set(mine) == set(theirs)
    for name, t in theirs.items():
        assert torch.equal(mine[name], t), name
    return back


def refused_on_export(extra: dict, said: str, tmp_path, capsys) -> None:
    """``export_hf`` of a Llama-shaped MoE checkpoint (4 experts) with the saved flags
    ``extra`` on top: refused, exit 2, the error holding ``said``."""
    from hybrid.checkpoint.single_rank import write_unsharded_checkpoint
    odd = str(tmp_path / "odd")
    write_unsharded_checkpoint(odd, {}, {"num_layers": 2, "hidden_size": 8,
                                         "num_attention_heads": 1, "swiglu": True,
                                         "normalization": "RMSNorm",
                                         "position_embedding_type": "rope",
                                         "disable_bias_linear": True, "num_experts": 4,
                                         **extra}, 257)
    capsys.readouterr()
    assert script_module("export_hf").main([odd, str(tmp_path / "odd_hf")]) == 2
    assert said in capsys.readouterr().err


def saved_tiny(model_class, config, folder: str):
    """``model_class(config)`` drawn from seed 1, in eval mode, saved by transformers in
    ``folder``: (the model, ``folder``)."""
    torch.manual_seed(1)
    hf = model_class(config).eval()
    hf.save_pretrained(folder)
    return hf, folder


def trains_from_import(printed: str, save: str) -> None:
    """The flags ``import_hf`` printed train from its save: 2 steps at DP 2 under ZeRO 2 on
    mock data (the null tokenizer's vocabulary one short of :data:`VOCAB`)."""
    flags = printed.split("--load " + save + " ", 1)[1].split()
    args = [*TINY, "--global-batch-size", "8", "--train-iters", "2", "--zero-stage", "2",
            "--seq-length", "32", "--mock-data", "--tokenizer-type", "null", "--vocab-size",
            str(VOCAB - 1),  # (the null tokenizer adds its end-of-document id)
            "--load", save, "--finetune", *flags]
    r = pretrain(2, args)
    assert r.returncode == 0, r.stderr[-3000:]


def _assert_same_model(hf, model, vocab):
    x = _tokens(vocab)
    with torch.no_grad():
        theirs, ours = hf(x).logits, model(x)[..., :vocab]
    rel = float((theirs - ours).abs().max() / theirs.abs().max())
    assert rel <= 1e-5, rel
    sample = script_module("generate").sample
    ours = sample(model, PROMPT[0], NEW, temperature=0.0, top_k=0, seed=0)
    theirs = _hf_greedy(hf, vocab)
    assert len(ours) == len(PROMPT[0]) + NEW and ours == theirs
    return ours


def _tiny_llama(tmp_path, tie, scaling=None):
    """``scaling``: (rope_type, factor), "llama3" (Llama-3.1's frequency scaling) or
    "linear" (position interpolation). At rope_theta 50000 and head size 16 the 8
    frequencies cover all three regimes of llama3's: kept (wavelength under 2048
    tokens), divided by the factor (over 8192), and blended between."""
    rope = {"rope_type": "default", "rope_theta": 50000.0}
    if scaling is not None:
        rope.update(rope_type=scaling[0], factor=scaling[1])
    if scaling is not None and scaling[0] == "llama3":
        rope.update(low_freq_factor=1.0, high_freq_factor=4.0,
                    original_max_position_embeddings=8192)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        rope_parameters=rope, rms_norm_eps=1e-5, tie_word_embeddings=tie,
        initializer_range=0.3, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(1)
    hf = transformers.LlamaForCausalLM(config).eval()
    hf_dir = str(tmp_path / f"llama_tie{tie}")
    hf.save_pretrained(hf_dir)
    return hf, hf_dir


def _load_imported_tp2(ps, save, flags):
    """The imported checkpoint loaded at TP 2 x DP 1, ZeRO-3: this rank's logits."""
    from hybrid.checkpoint import load_checkpoint
    from hybrid.config import Flags, build_config
    from hybrid.tensor_parallel import seed_all
    from hybrid.train.setup import build_engine
    cfg = build_config(Flags(tensor_model_parallel_size=2, seq_length=32, zero_stage=3,
                      hidden_dropout=0.0, attention_dropout=0.0, **flags), ps.world_size)
    rng = seed_all(0, ps.tp_rank, ps.dp_rank, ps.device)
    model, _, engine = build_engine(cfg, ps, VOCAB, rng)
    assert load_checkpoint(save, engine, ps, cfg.seed, rng, VOCAB) == (0, 0)
    model.eval()
    with torch.no_grad():
        return model(_tokens(VOCAB))


def assert_same_at_tp2(hf, save, flags):
    """The imported checkpoint ``save`` loaded at TP 2, ZeRO-3 gives ``hf``'s logits."""
    res = run_ranks(_load_imported_tp2, world_size=2, tp=2, args=(save, flags))
    ours = torch.cat(res, dim=-1)[..., :VOCAB]
    with torch.no_grad():
        torch.testing.assert_close(ours, hf(_tokens(VOCAB)).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tie, scaling", [(False, None), (True, None), (False, ("llama3", 32.0)),
                                          (False, ("linear", 4.0))],
                         ids=["untied", "tied", "llama3", "linear"])
def test_llama_from_transformers_imports_and_exports_exactly(tmp_path, tie, scaling, capsys):
    hf, hf_dir = _tiny_llama(tmp_path, tie, scaling)
    save, out = str(tmp_path / "imported"), str(tmp_path / "exported")
    assert script_module("import_hf").main([hf_dir, save]) == 0
    printed = capsys.readouterr().out
    scaled = {None: "", "llama3": " --use-rope-scaling --rope-scaling-factor 32.0",
              "linear": " --rotary-seq-len-interpolation-factor 4.0"}[scaling and scaling[0]]
    assert ("--normalization RMSNorm --norm-epsilon 1e-05 --swiglu --position-embedding-type "
            f"rope --rotary-base 50000.0{scaled} --group-query-attention --num-query-groups 2"
            ) in printed, printed
    assert ("--untie-embeddings-and-output-weights" in printed) == (not tie)
    assert "--disable-bias-linear" in printed
    model = _hybrid(save)
    greedy = _assert_same_model(hf, model, VOCAB)
    assert len(set(greedy[len(PROMPT[0]):])) > 1, greedy  # not one token repeated
    if tie:  # the imported weights at TP 2, ZeRO-3: the same logits
        from hybrid.hf.llama import llama_flags
        flags = llama_flags(hf.config.to_dict())
        assert_same_at_tp2(hf, save, flags)
    back = exported_exactly(hf, save, out, "Llama", capsys)
    assert back.config.tie_word_embeddings == tie
    assert back.config.rope_parameters == hf.config.rope_parameters
    _assert_same_model(back, model, VOCAB)


LLAMA_FLAGS = ["--normalization", "RMSNorm", "--swiglu", "--position-embedding-type", "rope",
               "--rotary-base", "20000", "--group-query-attention", "--num-query-groups", "2",
               "--untie-embeddings-and-output-weights", "--disable-bias-linear",
               "--max-position-embeddings", "64"]


def test_hybrid_llama_exports_to_transformers(tmp_path, capsys):
    """Trained at TP 2 (ZeRO-3), exported: transformers' LlamaForCausalLM gives
    hybrid's logits and greedy tokens; a GPT-2-with-RMSNorm refuses to export as
    either architecture, naming the flags."""
    save, out = str(tmp_path / "ckpt"), str(tmp_path / "hf")
    r = pretrain(2, TINY + LLAMA_FLAGS + ["--tensor-model-parallel-size", "2", "--zero-stage",
                                          "3", "--train-iters", "3", "--lr", "3e-3",
                                          "--save", save])
    assert r.returncode == 0, r.stderr[-3000:]
    assert script_module("export_hf").main([save, out]) == 0
    hf = transformers.LlamaForCausalLM.from_pretrained(out).eval()
    assert hf.config.num_key_value_heads == 2 and not hf.config.tie_word_embeddings
    model = _hybrid(save)
    _assert_same_model(hf, model, 257)

    from hybrid.checkpoint.single_rank import write_unsharded_checkpoint
    odd = str(tmp_path / "odd")
    write_unsharded_checkpoint(odd, {}, {"num_layers": 0, "hidden_size": 8,
                                         "num_attention_heads": 1, "normalization": "RMSNorm"},
                               257)
    capsys.readouterr()
    assert script_module("export_hf").main([odd, str(tmp_path / "odd_hf")]) == 2
    assert ("neither GPT-2 nor Llama-shaped: a Hugging Face Llama needs --swiglu, "
            "--position-embedding-type rope") in capsys.readouterr().err
