"""Checkpoints of pipeline runs: stage-sharded saves that load at any PP x TP x DP x CP x
ZeRO layout and continue the curve, each rank reading only the files of its stage's
pieces; the tools read them; a tied embedding's copy is saved once.

Through scripts/pretrain_gpt.py's work on pooled ranks (tests.helpers.launch.pretrain),
a 4-layer tiny Llama-shaped GPT, 8 samples a step: a run saves at iteration 2 of 4, and a resume
in another layout logs iterations 3-4, compared with the uninterrupted run's. (Two steps after
a resume: the first on the loaded optimizer state, the second on what it updated; a save at 3
of 6 checked nothing more, for half again the steps of every run.)
"""

import json
import os
import shutil

import pytest

from tests.helpers.launch import TINY, pretrain, read_json_log, run_script
from tests.helpers.opened import opened_by_rank, own_files, recording_rank

BASE = TINY + ["--num-layers", "4", "--global-batch-size", "8", "--train-iters", "4",
               "--eval-iters", "0", "--zero-param-persistence-threshold", "0"]
# Llama-shaped (untied, so Hugging Face's LlamaForCausalLM exports it; SwiGLU's fused
# weight reshards across TP and stages too)
UNTIED = BASE + ["--untie-embeddings-and-output-weights", "--normalization", "RMSNorm",
                 "--swiglu", "--position-embedding-type", "rope", "--disable-bias-linear"]
PP2_TP2 = ["--pipeline-model-parallel-size", "2", "--tensor-model-parallel-size", "2",
           "--zero-stage", "1"]
PP4 = ["--pipeline-model-parallel-size", "4", "--zero-stage", "0"]


def _ok(r):
    assert r.returncode == 0, f"{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
    return r


def _losses(path):
    return [m["loss"] for m in read_json_log(path)]


def _saved_at_2(tmp, name, world, layout, base=UNTIED):
    """(checkpoint directory holding iteration 2 only, the uninterrupted run's losses)."""
    save, log = str(tmp / name), str(tmp / f"{name}.jsonl")
    _ok(pretrain(world, base + layout + ["--save", save, "--save-interval", "2",
                                         "--log-json", log]))
    os.remove(os.path.join(save, "latest"))  # resume from iteration 2, not the final save
    shutil.rmtree(os.path.join(save, "iter_0000004"))
    return save, _losses(log)


@pytest.fixture(scope="module")
def pp2_tp2(tmp_path_factory):
    return _saved_at_2(tmp_path_factory.mktemp("pp2_tp2"), "ckpt", 4, PP2_TP2)


def _resume(tmp_path, save, world, layout, base=UNTIED):
    log = str(tmp_path / f"resumed_{len(os.listdir(tmp_path))}.jsonl")  # (logs append)
    r = _ok(pretrain(world, base + layout + ["--load", save, "--log-json", log],
                     rank_fn=recording_rank))
    return _losses(log), opened_by_rank(r.stdout)


@pytest.mark.parametrize("name,world,layout", [
    ("pp1_tp1", 1, []),
    ("pp1_dp2_zero2", 2, ["--zero-stage", "2"]),
    ("pp1_cp2_zero3", 2, ["--context-parallel-size", "2", "--zero-stage", "3"]),
    ("pp4_zero0", 4, PP4),
])
def test_pp2_tp2_checkpoint_continues_the_curve_in_another_layout(pp2_tp2, tmp_path, name,
                                                                   world, layout):
    """Saved at PP 2 x TP 2 (ZeRO 1) after 2 steps, resumed at PP 1 x TP 1 (one rank), PP 1
    x DP 2 (ZeRO 2), PP 1 x CP 2 (ZeRO 3) and PP 4 (ZeRO 0): losses 3-4 equal the
    uninterrupted PP 2 x TP 2 run's within 1e-5 (relative). At PP 4 each stage holds
    one old stage's layers and opens only that stage's two files (both TP ranks: the TP
    1 parameters are cut from both halves) with their headers."""
    save, full = pp2_tp2
    got, opened = _resume(tmp_path, save, world, layout)
    assert len(got) == 2, name
    for a, b in zip(got, full[2:], strict=True):
        assert abs(a - b) <= 1e-5 * abs(b), (name, got, full[2:])
    if name == "pp4_zero0":  # new stage s: layer s, in old stage s // 2 (old ranks 2s', 2s'+1)
        for rank, files in opened.items():
            old = rank // 2
            data = {f for f in files if f.endswith((".bin", ".pt"))}
            assert data == own_files(2 * old, 2) | own_files(2 * old + 1, 2), (rank, files)


def test_same_layout_resume_of_a_pipeline_run_is_exact_and_reads_only_itsown_files(
        pp2_tp2, tmp_path):
    """PP 2 x TP 2 resumed as it was saved: losses 3-4 equal the uninterrupted run's to
    the last bit, and each rank opens the metadata, its own header and its own data file,
    nothing else (so the RNG states come back too; 'latest' was removed to resume from
    iteration 2, the newest complete checkpoint left)."""
    save, full = pp2_tp2
    got, opened = _resume(tmp_path, save, 4, PP2_TP2)
    assert got == full[2:]
    for rank in range(4):
        assert sorted(opened[rank]) == sorted(["iter_0000002/metadata.json",
                                               *own_files(rank, 2)]), (rank, opened[rank])


def test_pp4_checkpoint_resumes_at_pp2_dp2_reading_only_the_stage_s_old_files(tmp_path):
    """Saved at PP 4 (one layer per stage, ZeRO 0), resumed at PP 2 x DP 2 (ZeRO 3): losses
    3-4 within 1e-5 of the uninterrupted PP 4 run's; a rank of new stage s (layers 2s,
    2s+1) opens the files of old stages 2s and 2s+1 only."""
    save, full = _saved_at_2(tmp_path, "pp4", 4, PP4)
    got, opened = _resume(tmp_path, save, 4, ["--pipeline-model-parallel-size", "2",
                                              "--zero-stage", "3"])
    assert len(got) == 2
    for a, b in zip(got, full[2:], strict=True):
        assert abs(a - b) <= 1e-5 * abs(b), (got, full[2:])
    for rank, files in opened.items():  # PP 2 x DP 2: ranks 0, 1 stage 0; 2, 3 stage 1
        s = rank // 2
        data = {f for f in files if f.endswith((".bin", ".pt"))}
        assert data == own_files(2 * s, 2) | own_files(2 * s + 1, 2), (rank, files)


def test_a_tied_pipeline_run_resumes_at_pp1_and_at_pp2_on_its_curve(tmp_path):
    """GPT-2 with tied embeddings at PP 2 x DP 2 (ZeRO 1), saved after 2 steps: the last
    stage's copy of wte.weight is not in the checkpoint, and resumes at PP 1 (one rank)
    and at PP 2 x TP 2 (the copy read from the first stage's files) give losses 3-4
    within 1e-5 of the uninterrupted run's."""
    tied = BASE + ["--zero-stage", "1"]
    save, full = _saved_at_2(tmp_path, "tied", 4, ["--pipeline-model-parallel-size", "2"],
                             base=tied)
    with open(os.path.join(save, "iter_0000002", "metadata.json")) as f:
        stages = json.load(f)["zero_layout"]["stages"]
    assert [st["unsaved"] for st in stages] == [[], ["wte.weight"]]
    for world, layout in ((1, []), (4, ["--pipeline-model-parallel-size", "2",
                                        "--tensor-model-parallel-size", "2"])):
        got, _ = _resume(tmp_path, save, world, layout, base=tied)
        assert len(got) == 2, layout
        for a, b in zip(got, full[2:], strict=True):
            assert abs(a - b) <= 1e-5 * abs(b), (layout, got, full[2:])


def test_a_pipeline_checkpoint_says_which_stage_holds_which_names(pp2_tp2):
    """metadata.json of a PP 2 x TP 2 save: version 4, the pipeline size, the whole
    model's names and shapes, and per stage its units: the embeddings and layers 0-1 on
    stage 0, layers 2-3 and the head on stage 1; every name in exactly one stage."""
    save, _ = pp2_tp2
    with open(os.path.join(save, "iter_0000002", "metadata.json")) as f:
        meta = json.load(f)
    assert meta["version"] == 4 and meta["pipeline_model_parallel_size"] == 2
    z = meta["zero_layout"]
    assert z["pp_size"] == 2 and "units" not in z
    names = [{n for unit in st["units"] for n, _ in unit} for st in z["stages"]]
    assert {"wte.weight", "blocks.0.attn.qkv.weight",
            "blocks.1.mlp.fc.weight"} <= names[0]
    assert {"blocks.2.attn.qkv.weight", "blocks.3.mlp.fc.weight", "ln_f.weight",
            "output_layer.weight"} <= names[1]
    assert not names[0] & names[1] and names[0] | names[1] == set(meta["model"])
    assert set(z["split_dims"]) == set(meta["model"])


def test_a_pipeline_checkpoint_of_another_model_is_refused_on_every_stage(pp2_tp2):
    """The 4-layer checkpoint loaded at PP 2 into 2 layers: every name of each stage is
    in the checkpoint, so only the whole model's names (gathered over the stages) show
    what differs; one error naming it and the flag."""
    save, _ = pp2_tp2
    r = pretrain(2, UNTIED + ["--num-layers", "2", "--pipeline-model-parallel-size", "2",
                              "--load", save])
    assert r.returncode == 2 and "checkpoint is for a different model" in r.stderr, r.stderr
    assert "blocks.2" in r.stderr and "--num-layers" in r.stderr


def _resave_at_pp1(ps, ckpt, out, args):
    """Load checkpoint ``ckpt`` into a PP 1 engine of the run ``args`` describe and save
    it in ``out``: a PP 1 checkpoint of the same weights."""
    from hybrid.checkpoint import load_checkpoint, read_metadata, save_checkpoint
    from hybrid.config import build_config, parse_args
    from hybrid.tensor_parallel import seed_all
    from hybrid.train.setup import build_engine
    cfg = build_config(parse_args(args), ps.world_size)
    vocab = read_metadata(os.path.join(ckpt, "iter_0000002"))["vocab_size"]
    rng = seed_all(cfg.seed, ps.tp_rank, ps.dp_rank, ps.device)
    _, _, engine = build_engine(cfg, ps, vocab, rng)
    load_checkpoint(ckpt, engine, ps, cfg.seed, rng, vocab)
    save_checkpoint(out, 2, 16, engine, ps, cfg.to_dict(), rng, vocab_size=vocab)


def test_tools_read_a_pipeline_checkpoint(pp2_tp2, tmp_path):
    """export_hf.py of the PP 2 x TP 2 checkpoint equals, to the bit, export_hf.py of a
    PP 1 checkpoint of the same weights (loaded at PP 1 and saved); convert_checkpoint.py
    merges it into the whole model's tensors and verifies its 9 files."""
    import torch
    from safetensors.torch import load_file

    from tests.helpers.harness import run_ranks
    save, _ = pp2_tp2
    pp1 = str(tmp_path / "pp1")
    run_ranks(_resave_at_pp1, world_size=1, args=(save, pp1, UNTIED))
    exported = {}
    for name, ckpt in (("pp2", save), ("pp1", pp1)):
        out = str(tmp_path / f"hf_{name}")
        assert run_script("export_hf", [ckpt, out]).returncode == 0
        with open(os.path.join(out, "config.json")) as f:
            exported[name] = (json.load(f), load_file(os.path.join(out, "model.safetensors")))
    (cfg2, w2), (cfg1, w1) = exported["pp2"], exported["pp1"]
    assert cfg2 == cfg1 and cfg2["num_hidden_layers"] == 4
    assert set(w2) == set(w1) and any(".layers.3." in n for n in w2) and "lm_head.weight" in w2
    for n in w1:
        assert torch.equal(w2[n], w1[n]), n
    merged = str(tmp_path / "merged.pt")
    r = run_script("convert_checkpoint", [save, merged])
    assert r.returncode == 0 and "PP 2" in r.stdout, r.stdout + r.stderr
    model = torch.load(merged)["model"]
    with open(os.path.join(save, "iter_0000002", "metadata.json")) as f:
        shapes = json.load(f)["model"]
    assert {n: list(t.shape) for n, t in model.items()} == shapes
    r = run_script("convert_checkpoint", ["verify", save])
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["files"] == 1 + 2 * 4 and report["damaged"] == 0



# -- a tied embedding's copy on the last stage: saved once, by the first stage ----------

VOCAB = 257


def _tied_engine(ps, seed):
    from hybrid.config import Flags, build_config
    from hybrid.tensor_parallel import seed_all
    from hybrid.train.setup import build_engine
    # plan_only: the config of a tied pipeline run, whatever check_pipeline_runs says of
    # it. ZeRO 3: the root module's unit holds the embedding's copy and the final norm,
    # cut between the DP ranks inside the copy, so the rows after it move up by its size
    cfg = build_config(Flags(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=8,
                             pipeline_model_parallel_size=ps.pp_size, seed=seed, zero_stage=3,
                             zero_param_persistence_threshold=0, hidden_dropout=0.0,
                             attention_dropout=0.0), ps.world_size, plan_only=True)
    rng = seed_all(seed, ps.tp_rank, ps.dp_rank, ps.device)
    model, _, engine = build_engine(cfg, ps, VOCAB, rng)
    return cfg, rng, model, engine


def _pieces(engine):
    """This rank's pieces [(name, lo, hi)] and their fp32 masters, one tensor each."""
    from hybrid.zero.state import iter_piece_values, shard_state
    pieces = shard_state(engine)["pieces"]
    return pieces, [v[:, 0].clone() for v in iter_piece_values(engine)]


def _tied_save(ps, root):
    """A tied PP 2 engine whose last stage's copy of wte is set apart from the first
    stage's (1 added to its master), saved; its pieces and masters as saved."""
    from hybrid.checkpoint import save_checkpoint
    from hybrid.zero.state import iter_piece_values, load_shard_state, shard_state
    cfg, rng, _, engine = _tied_engine(ps, seed=3)
    values = {pc: v.t() for pc, v in zip(shard_state(engine)["pieces"],
                                         iter_piece_values(engine), strict=True)}

    def fetch(name, lo, hi):
        v = values[(name, lo, hi)].clone()
        if name == "wte.weight" and ps.pp_rank == 1:
            v[0] += 1.0
        return v

    load_shard_state(engine, fetch, engine.optimizer.columns, 0, None)
    save_checkpoint(os.path.join(root, "tied"), 1, 8, engine, ps, cfg.to_dict(), rng,
                    vocab_size=VOCAB)
    return _pieces(engine)


def _tied_load(ps, root):
    """A fresh engine (another seed) loaded from the tied save: its pieces and masters,
    and the files it opened (RangeReader opens the data files with os.open)."""
    from hybrid.checkpoint import load_checkpoint
    cfg, rng, _, engine = _tied_engine(ps, seed=99)
    save = os.path.join(root, "tied")
    opened, real_os_open = [], os.open

    def os_open(path, *a, **k):
        opened.append(os.path.relpath(os.path.abspath(os.fspath(path)), save))
        return real_os_open(path, *a, **k)

    os.open = os_open
    try:
        load_checkpoint(save, engine, ps, cfg.seed, rng, VOCAB)
    finally:
        os.open = real_os_open
    return (*_pieces(engine), opened)


def test_a_tied_embedding_s_copy_is_saved_once_and_loads_as_the_first_stage_s(tmp_path):
    """PP 2 x DP 2 (ZeRO 3) with tied embeddings, the last stage's copy of wte.weight made
    unequal to the first stage's: the save writes the first stage's only (the last
    stage's data files hold rows of its other parameters alone, and metadata names the
    copy as that stage's unsaved one). Loaded at PP 2 x DP 2, PP 2 x DP 1 and PP 1,
    every piece of every rank is the saved value, and every wte piece the first stage's,
    the last stage reading it from the first stage's files; a rank opens only the files
    of the old stages that saved its parameters."""
    import torch

    from hybrid.checkpoint.layout import SavedLayout
    from tests.helpers.harness import run_ranks
    root = str(tmp_path)
    saved = run_ranks(_tied_save, world_size=4, pp=2, args=(root,))
    full: dict[str, dict[int, float]] = {}  # name -> {element: saved master}
    copy = []  # the last stage's own (unsaved) wte pieces
    for rank, (pieces, values) in enumerate(saved):
        for (name, lo, hi), v in zip(pieces, values, strict=True):
            if name == "wte.weight" and rank >= 2:
                copy.append((lo, v))
                continue
            full.setdefault(name, {}).update(zip(range(lo, hi), v.tolist()))
    expect = {n: torch.tensor([d[i] for i in range(len(d))]) for n, d in full.items()}
    assert copy and all(not torch.equal(v, expect["wte.weight"][lo: lo + len(v)])
                        for lo, v in copy)  # the copy was set apart
    ckpt = os.path.join(root, "tied", "iter_0000001")
    with open(os.path.join(ckpt, "metadata.json")) as f:
        meta = json.load(f)
    stages = meta["zero_layout"]["stages"]
    assert stages[0]["unsaved"] == [] and stages[1]["unsaved"] == ["wte.weight"]
    assert any(n == "wte.weight" for unit in stages[1]["units"] for n, _ in unit)
    for rank in (2, 3):  # 3 fp32 columns of the last stage's other parameters' rows
        rows = sum(hi - lo for name, lo, hi in saved[rank][0] if name != "wte.weight")
        assert os.path.getsize(os.path.join(ckpt, f"rank_{rank:05d}.bin")) == 12 * rows
    layout = SavedLayout(meta, ckpt)
    assert layout.names().count("wte.weight") == 1 and layout.stage_of("wte.weight") == 0
    for world, pp in ((4, 2), (2, 2), (1, 1)):
        for rank, (pieces, values, opened) in enumerate(
                run_ranks(_tied_load, world_size=world, pp=pp, args=(root,))):
            for (name, lo, hi), v in zip(pieces, values, strict=True):
                assert torch.equal(v, expect[name][lo:hi]), (world, rank, name, lo, hi)
            old_stages = {layout.stage_of(n) for n, _, _ in pieces}
            allowed = {f"iter_0000001/rank_{r:05d}.bin" for r in range(4)
                       if layout.coords(r)[0] in old_stages}
            assert set(opened) <= allowed, (world, rank, opened)
            if (world, pp) == (2, 2):
                assert old_stages == ({0} if rank == 0 else {0, 1})


def test_rows_after_an_unsaved_copy_inside_a_unit_move_up_by_what_each_shard_skips():
    """SavedLayout alone (no files): stage 1 of PP 2 x DP 2 has one unit [a 10, wte 20,
    b 10] whose wte is unsaved, each DP shard 20 elements: shard 0 saves a (10 rows),
    shard 1 saves b (10 rows), and b's rows start at 0 of stage 1's DP-rank-1 file
    (global rank (1 * 2 + 1) * 1 + 0 = 3), each column 10 rows apart; stage 0's wte
    lives in its first unit, read from stage 0's files."""
    from hybrid.checkpoint.layout import SavedLayout
    meta = {"version": 4, "model": {"wte.weight": [20], "a": [10], "b": [10], "c": [6]},
            "zero_layout": {"tp_size": 1, "dp_size": 2, "pp_size": 2,
                            "columns": ["master", "exp_avg", "exp_avg_sq"],
                            "split_dims": {"wte.weight": None, "a": None, "b": None,
                                           "c": None},
                            "stages": [{"owns_all": False, "unsaved": [],
                                        "units": [[["wte.weight", 20]], [["c", 6]]]},
                                       {"owns_all": False, "unsaved": ["wte.weight"],
                                        "units": [[["a", 10], ["wte.weight", 20],
                                                   ["b", 10]]]}]}}
    lay = SavedLayout(meta, "/ck")
    assert lay.names() == ["wte.weight", "c", "a", "b"] and lay.stage_of("b") == 1
    assert (lay.rows(0, 1), lay.rows(1, 1)) == (10, 10)  # the hole holds no row
    assert (lay.rows(0, 0), lay.rows(1, 0)) == (10 + 3, 10 + 3)
    got = [(os.path.basename(r.path), r.size, r.offset, r.numel)
           for r in lay.reads("b", 0, 2, 7, [0, 2])]
    assert got == [("rank_00003.bin", 120, 4 * 2, 5), ("rank_00003.bin", 120, 4 * (20 + 2), 5)]
    got = [(os.path.basename(r.path), r.offset, r.numel) for r in lay.reads("a", 0, 0, 10, [0])]
    assert got == [("rank_00002.bin", 0, 10)]
    # stage 0: wte [0, 10) on DP rank 0 (rank 0), [10, 20) on DP rank 1 (rank 1); c after it
    got = [(os.path.basename(r.path), r.offset, r.numel)
           for r in lay.reads("wte.weight", 0, 5, 15, [0])]
    assert got == [("rank_00000.bin", 4 * 5, 5), ("rank_00001.bin", 0, 5)]
    assert [r.offset for r in lay.reads("c", 0, 3, 6, [0])] == [4 * 10]  # DP rank 1, row 10
    assert lay.coords(3) == (1, 1, 0)
