"""torch DCP checkpoints as torchtitan writes them (hybrid/checkpoint/peers/dcp.py).

The fixture (tests/fixtures/peers/dcp/, recorded by benchmarks/peers/record_dcp_checkpoint.py):
a torchtitan-style Llama (torchtitan's names, complex-pair RoPE, GQA, SwiGLU) trained 3
steps with FSDP2 on 2 gloo ranks and torch's AdamW, saved with DCP in the structure of
torchtitan's CheckpointManager, and the 10 losses the same run went on with. hybrid
imports it (weights, fp32 masters, both moments, step count, iteration) and trains the
same 10 batches: the losses equal the recorded ones within 2e-6, at the fixture's layout
(2 ranks, ZeRO 3, FSDP's counterpart). A second fixture (tests/fixtures/peers/dcp_fsdp_tp/)
is the same run on torchtitan's 2-D layout, FSDP2 x TP 2 on 4 ranks; it continues at TP 2.
The way back: a hybrid checkpoint written as DCP, loaded by the FSDP2 x TP model with
torch's dcp.load and set_*_state_dict, goes on with hybrid's losses.
"""

from __future__ import annotations

import json
import os
import tarfile

import pytest
import torch

from tests.helpers.harness import run_ranks
from tests.helpers.launch import ROOT

FIXTURE = os.path.join(ROOT, "tests", "fixtures", "peers", "dcp")
# the same run on a (dp 2, tp 2) mesh: FSDP2 over TP DTensors (strided shards), 4 ranks
FIXTURE_2D = os.path.join(ROOT, "tests", "fixtures", "peers", "dcp_fsdp_tp")
TOL = 2e-6


def _record(fixture: str = FIXTURE) -> dict:
    with open(os.path.join(fixture, "losses.json")) as f:
        return json.load(f)


def _unpack(tmp_path, fixture: str = FIXTURE) -> str:
    """The fixture's torchtitan checkpoint folder (``checkpoint/``, holding ``step-3/``),
    unpacked from its archive (kept compressed: DCP's per-entry pickles compress well)."""
    safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}  # Python >= 3.10.12
    with tarfile.open(os.path.join(fixture, "checkpoint.tar.xz")) as tar:
        tar.extractall(tmp_path, **safe)  # type: ignore[arg-type]
    return str(tmp_path / "checkpoint")


def _global_batch(rec: dict) -> int:
    return rec["micro_batch_per_rank"] * rec.get("data_parallel_size", rec["world_size"])


def _flags(rec: dict, tp: int, world: int, stage: int, **extra) -> dict:
    return dict(rec["hybrid_flags"], micro_batch_size=_global_batch(rec) * tp // world,
                global_batch_size=_global_batch(rec),
                tensor_model_parallel_size=tp, zero_stage=stage, seed=7, **extra)


def hybrid_continues(ps, rec: dict, load: str, save: str, stage: int, steps: int,
                     export_after: int | None = None) -> list[float]:
    """On every rank: hybrid's GPT built as training builds it, started from ``load`` (a
    DCP checkpoint, imported into ``save``) through the run's own resume, then ``steps``
    steps on the recorded run's batches; the global losses. ``export_after``: after that
    many steps, save a hybrid checkpoint into ``save`` (the way back's start)."""
    import torch.distributed as dist

    from benchmarks.peers import titan_llama as tl
    from hybrid.checkpoint import save_checkpoint
    from hybrid.checkpoint.resume import start_from_checkpoint
    from hybrid.config import Flags, build_config
    from hybrid.kernels import configure
    from hybrid.tensor_parallel import seed_all
    from hybrid.train.setup import build_engine
    from hybrid.train.step import train_step

    flags = _flags(rec, ps.tp_size, ps.world_size, stage, load=load, save=save)
    cfg = build_config(Flags(**flags), ps.world_size, environ=os.environ)
    configure(cfg.kernels)
    rng = seed_all(cfg.seed, ps.tp_rank, ps.dp_rank, ps.device, ps.cp_rank, ps.tp_size)
    vocab = rec["shape"]["vocab_size"]
    model, _, engine = build_engine(cfg, ps, vocab, rng)
    model.train()
    start = start_from_checkpoint(cfg.checkpoint, engine, ps, cfg.seed, rng, vocab,
                                  cfg.to_dict())
    assert start is not None and start.iteration == rec["save_step"]
    s = tl.shape(**rec["shape"])
    dp = ps.world_size // ps.tp_size
    gb = flags["global_batch_size"]
    rows = slice(ps.dp_rank * gb // dp, (ps.dp_rank + 1) * gb // dp)
    losses = []
    for step in range(start.iteration + 1, start.iteration + 1 + steps):
        x, y = tl.batch(rec["seed"], step, s, gb)
        loss, _, _ = train_step(model, engine, [(x[rows], y[rows])], flags["lr"])
        t = loss.detach().reshape(1).clone()
        dist.all_reduce(t)
        losses.append(float(t) / ps.world_size)
        if step == start.iteration + (export_after or 0):
            engine.wait_optimizer()
            save_checkpoint(save, step, gb * step, engine, ps, cfg.to_dict(), rng,
                            vocab_size=vocab)
    engine.wait_optimizer()
    return losses


def _max_diff(a, b) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def torch_continues(ps, rec: dict, load: str, steps: int) -> dict:
    """On every rank: the recorder's FSDP2 model (over TP ``rec["tensor_parallel"]``, as
    recorded) and AdamW, loaded from DCP checkpoint ``load`` as torchtitan loads one, then
    ``steps`` steps on the recorded run's batches."""
    from benchmarks.peers import titan_llama as tl
    s = tl.shape(**rec["shape"])
    tp = rec.get("tensor_parallel", 1)
    model = tl.build(s, rec["seed"], tp)
    opt, sched = tl.make_optimizer(model)
    start = tl.load(load, model, opt, sched)
    gb, dp, dp_rank = _global_batch(rec), ps.world_size // tp, ps.rank // tp
    rows = slice(dp_rank * gb // dp, (dp_rank + 1) * gb // dp)
    losses = []
    for step in range(start + 1, start + 1 + steps):
        x, y = tl.batch(rec["seed"], step, s, gb)
        losses.append(tl.train_step(model, opt, sched, x[rows], y[rows]))
    return {"step": start, "losses": losses}


def test_zero3_continues_the_recorded_run_and_its_export_holds_no_tensor_in_memory(tmp_path):
    """ZeRO 3 over 2 ranks (the fixture's FSDP2 layout): the 10 losses after the import
    equal the recorded run's within 2e-6. The hybrid save at iteration 6 (3 steps in),
    written as torchtitan's step-6/, hands ``dcp.save`` no tensor held in memory."""
    rec = _record()
    save = tmp_path / "save"
    hybrid = run_ranks(hybrid_continues, world_size=2, tp=1,
                       args=(rec, _unpack(tmp_path), str(save), 3, 10, 3))[0]
    assert _max_diff(hybrid, rec["losses_after_save"]) <= TOL, (hybrid, rec)
    _every_tensor_dcp_writes_is_a_mapped_file(str(save / "iter_0000006"), tmp_path / "again")


def _every_tensor_dcp_writes_is_a_mapped_file(ckpt: str, out) -> None:
    """The export's state dict holds no tensor in memory but the step counts: each
    weight and moment is a mapped scratch file (its storage names the file), so memory
    holds about one parameter whatever the model's size."""
    import torch.distributed.checkpoint as dcp

    from hybrid.checkpoint.peers import dcp_export as peer
    real, seen = dcp.save, {}

    def save(state, **kw):
        flat = {**{k: v for k, v in state.items() if isinstance(v, torch.Tensor)},
                **state["optimizer"]}
        seen.update({k: v.untyped_storage().filename for k, v in flat.items()
                     if isinstance(v, torch.Tensor) and v.ndim > 0})
        return real(state, **kw)
    dcp.save = save
    try:
        peer.write(ckpt, str(out))
    finally:
        dcp.save = real
    assert len(seen) > 20 and all(seen.values()), seen
    assert os.listdir(out) == ["step-6"]


def test_fsdp_x_tp_fixture_continues_at_tp2_and_the_way_back_loads_at_fsdp_x_tp(tmp_path):
    """The 2-D fixture (FSDP2 over 2 DP ranks of TP 2 DTensors, 4 ranks: each weight saved
    in chunks split by both owners, FSDP's strided ones inside TP's) imported at TP 2
    with ZeRO 1: the 10 losses equal the recorded run's within 2e-6. The way back: the
    hybrid save at iteration 6, written by ``convert_checkpoint.py export --to dcp`` as
    torchtitan's step-6/, is loaded by the same FSDP2 x TP model and torch's AdamW
    (dcp.load, set_model_state_dict, set_optimizer_state_dict; DCP reshards into its
    layout), whose next 3 losses equal hybrid's within 2e-6."""
    from tests.helpers.launch import run_script
    rec = _record(FIXTURE_2D)
    assert (rec["tensor_parallel"], rec["data_parallel_size"]) == (2, 2)
    save, out = tmp_path / "save", tmp_path / "titan"
    hybrid = run_ranks(hybrid_continues, world_size=2, tp=2,
                       args=(rec, _unpack(tmp_path, FIXTURE_2D), str(save), 1, 10, 3))[0]
    assert _max_diff(hybrid, rec["losses_after_save"]) <= TOL, (hybrid, rec)
    r = run_script("convert_checkpoint", ["export", "--to", "dcp",
                                          str(save / "iter_0000006"), str(out)])
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["step"] == 6
    got = run_ranks(torch_continues, world_size=4, args=(rec, str(out / "step-6"), 3))[0]
    assert got["step"] == 6
    assert _max_diff(got["losses"], hybrid[3:6]) <= TOL, (got["losses"], hybrid[3:6])
    assert os.listdir(out) == ["step-6"]  # (the scratch files gone)


PRETRAIN = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "255",
            "--log-interval", "1", "--eval-iters", "1", "--zero-stage", "3"]


def _cli(flags: dict) -> list[str]:
    out = []
    for k, v in flags.items():
        flag = "--" + k.replace("_", "-")
        if v is True:
            out.append(flag)
        elif v is not False:
            out += [flag, str(v)]
    return out


def test_pretrain_gpt_resumes_at_the_fixture_s_step(tmp_path):
    """``scripts/pretrain_gpt.py --load FIXTURE --save NEW`` (2 ranks, ZeRO 3, mock data
    with the fixture's 256-token vocabulary): the import publishes NEW/iter_0000003 holding
    the DCP checkpoint's tensors as the reader maps them, bit for bit, the run goes on
    at iteration 4 and saves iteration 5; the same command again resumes at 5 (--save's
    newest), not at the import."""
    import torch

    from hybrid.checkpoint import iter_full_params
    from hybrid.checkpoint.peers import open_peer
    from tests.helpers.launch import pretrain, read_json_log
    rec = _record()
    ckpt, save, log = _unpack(tmp_path), tmp_path / "new", str(tmp_path / "log.jsonl")
    flags = _flags(rec, 1, 2, 3)
    argv = _cli({k: v for k, v in flags.items() if k not in ("zero_stage", "seed")}) + \
        PRETRAIN + ["--train-iters", "5", "--load", ckpt, "--save", str(save),
                    "--log-json", log]
    r = pretrain(2, argv)
    assert r.returncode == 0, r.stderr[-3000:]
    assert [m["iteration"] for m in read_json_log(log) if "split" not in m] == [4, 5]
    assert sorted(n for n in os.listdir(save) if not n.startswith(".")) == [
        "imported_from.json", "iter_0000003", "iter_0000005", "latest", "owner.json"]
    peer = open_peer(ckpt)
    peer.configure(dict(flags))
    meta, params = iter_full_params(str(save / "iter_0000003"))
    assert meta["iteration"] == 3 and meta["step"] == 3
    assert meta["imported_from"]["format"] == peer.format
    for name, cols in params:
        want = peer.read(name)
        for col in ("master", "exp_avg", "exp_avg_sq"):
            assert torch.equal(cols[col], want[col]), (name, col)
    # the same command again, told to go on to 6: it finds its import, reads nothing of
    # the DCP checkpoint and resumes from --save's newest (5), not from the import (3)
    argv[argv.index("--train-iters") + 1] = "6"
    r = pretrain(2, argv)
    assert r.returncode == 0, r.stderr[-3000:]
    assert [m["iteration"] for m in read_json_log(log) if "split" not in m][-1:] == [6]
    assert "resumed from " + str(save / "iter_0000005") in r.stdout + r.stderr, r.stderr[-2000:]


def test_bad_input_is_one_error_naming_the_file(tmp_path):
    """A truncated .distcp, an empty .metadata (the fake of
    tests/helpers/foreign_checkpoints.py), a run whose query groups do not fit wk's rows: one
    CheckpointError naming the file and what is wrong; through pretrain_gpt.py, exit 2
    and nothing published in --save."""
    import shutil

    from hybrid.checkpoint.peers import dcp, open_peer
    from hybrid.errors import CheckpointError
    from tests.helpers.launch import pretrain
    rec = _record()
    step = os.path.join(_unpack(tmp_path), "step-3")
    cut = str(tmp_path / "cut")
    shutil.copytree(step, cut)
    data = os.path.join(cut, "__1_0.distcp")
    with open(data, "r+b") as f:
        f.truncate(os.path.getsize(data) // 2)
    with pytest.raises(CheckpointError, match=rf"^{data}: truncated \("):
        open_peer(cut)
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / ".metadata").write_text("")
    (empty / "__0_0.distcp").write_text("")
    with pytest.raises(CheckpointError, match=rf"^{empty}/.metadata: not a readable DCP"):
        open_peer(str(empty))
    (empty / "common.pt").write_text("")  # a Megatron-LM torch_dist iteration: Megatron's
    assert not dcp.detect(str(empty)) and dcp.detect(cut) and dcp.detect(os.path.dirname(step))
    flags = dict(_flags(rec, 1, 2, 3), num_query_groups=1)  # another model: 1 K/V head
    argv = _cli({k: v for k, v in flags.items() if k not in ("zero_stage", "seed")}) + \
        PRETRAIN + ["--train-iters", "5", "--load", step, "--save", str(tmp_path / "new")]
    r = pretrain(2, argv)
    assert r.returncode == 2
    said = r.stderr.strip().splitlines()[-1]
    assert f"{step}/.metadata: wq has 32 rows and wk 16, which 4 heads and 1 query" in said, said
    assert not [n for n in os.listdir(tmp_path / "new") if "iter_" in n]


def _resave(src: str, dst: str, edit) -> None:
    """The DCP checkpoint ``src`` with its state dict changed by ``edit(sd)``, saved to
    ``dst`` by ``dcp.save`` in this process (the fixture is ours: a full unpickle)."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    whole = os.path.join(os.path.dirname(dst), "whole.pt")
    dcp_to_torch_save(src, whole)
    sd = torch.load(whole, weights_only=False)
    edit(sd)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(sd, checkpoint_id=dst, no_dist=True)


def test_newer_names_fused_qkv_state_tied_embeddings_and_a_model_only_save(tmp_path):
    """Newer torchtitan saves q, k, v as ``attention.qkv_linear.wq|wk|wv`` (its fused
    projection splits itself on save) but their Adam state as the fused parameter's,
    ``qkv_linear.wqkv`` laid out ``(groups, heads / groups + 2, head size, C)``, and
    names the output layer ``lm_head``; with weight tying, the output has no optimizer
    state of its own; a model-only save (torchtitan's last_save_model_only) has the
    weights alone. The fixture rewritten each way reads as the same tensors. The
    saved AdamW hyperparameters the run's flags do not repeat are one note each."""
    import torch

    from hybrid.checkpoint.peers import detect_peer, open_peer
    rec = _record()
    step = os.path.join(_unpack(tmp_path), "step-3")
    sh = rec["shape"]
    hd = sh["dim"] // sh["n_heads"]
    r = sh["n_heads"] // sh["n_kv_heads"]

    def newer(sd):
        opt = sd["optimizer"]
        for i in range(sh["n_layers"]):
            a = f"layers.{i}.attention."
            for w in ("wq", "wk", "wv"):
                sd[f"{a}qkv_linear.{w}.weight"] = sd.pop(f"{a}{w}.weight")
            for col in ("exp_avg", "exp_avg_sq"):
                q, k, v = (opt.pop(f"state.{a}{w}.weight.{col}") for w in ("wq", "wk", "wv"))
                parts = [q.reshape(sh["n_kv_heads"], r, hd, -1),
                         k.reshape(sh["n_kv_heads"], 1, hd, -1),
                         v.reshape(sh["n_kv_heads"], 1, hd, -1)]
                opt[f"state.{a}qkv_linear.wqkv.weight.{col}"] = torch.cat(parts, 1).reshape(
                    -1, sh["dim"])
            opt[f"state.{a}qkv_linear.wqkv.weight.step"] = opt.pop(f"state.{a}wq.weight.step")
            for w in ("wk", "wv"):
                del opt[f"state.{a}{w}.weight.step"]
        sd["lm_head.weight"] = sd.pop("output.weight")
        for col in ("exp_avg", "exp_avg_sq", "step"):
            opt[f"state.lm_head.weight.{col}"] = opt.pop(f"state.output.weight.{col}")

    def tied(sd):
        sd["output.weight"] = sd["tok_embeddings.weight"].clone()
        for col in ("exp_avg", "exp_avg_sq", "step"):
            del sd["optimizer"][f"state.output.weight.{col}"]

    def model_only(sd):  # torchtitan's last_save_model_only: the model's entries alone
        for key in ("optimizer", "lr_scheduler", "dataloader", "train_state"):
            del sd[key]

    config = dict(_flags(rec, 1, 1, 1))
    base = open_peer(step)
    base.configure(config)
    # layer 0 and the top-level tensors: every layer maps alike
    checked = [n for n in base.shapes if not n.startswith("blocks.") or
               n.startswith("blocks.0.")]
    want = {n: base.read(n) for n in checked}
    assert base.notes[3:] == []  # the recorder's AdamW is the flags' own
    odd = open_peer(step)
    odd.configure(dict(config, adam_beta2=0.999, lr=3e-4))
    assert odd.notes[3:] == ["--adam-beta2: the checkpoint's optimizer has 0.95, this run "
                             "0.999", "learning rate: the checkpoint's optimizer holds 0.001 "
                             "for step 4; hybrid's schedule gives 0.0003 for it"]
    for kind, edit in (("newer", newer), ("tied", tied), ("model_only", model_only)):
        (tmp_path / kind).mkdir()
        _resave(step, str(tmp_path / kind / "step-3"), edit)
        assert detect_peer(str(tmp_path / kind)) == "dcp"
        peer = open_peer(str(tmp_path / kind))
        peer.configure(config)
        assert (peer.iteration, peer.step) == ((0, 0) if kind == "model_only" else (3, 3))
        assert peer.flags["untie_embeddings_and_output_weights"] == (kind != "tied")
        assert set(peer.shapes) == set(base.shapes) - ({"output_layer.weight"}
                                                        if kind == "tied" else set())
        assert peer.columns == (("master",) if kind == "model_only" else base.columns)
        assert ("no optimizer state (a model-only save): Adam's moments start at zero"
                in peer.notes) == ("no train_state: iteration 0" in peer.notes) == (
                    kind == "model_only")
        for name in (n for n in checked if n in peer.shapes):
            got = peer.read(name)
            for col in peer.columns:
                assert torch.equal(got[col], want[name][col]), (kind, name, col)
