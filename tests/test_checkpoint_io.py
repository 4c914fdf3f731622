"""Checkpoint I/O proportional to what a rank owns, and exact resharding.

One 4-process session does every save and load below (spawning ranks is what
costs here); the tests then check its records against the raw files, read
independently of hybrid.checkpoint. (End-to-end resume, crashes and bad input
through pretrain_gpt.py: tests/test_checkpoint.py.)
"""

import os

import pytest

from launch import script_module

IO_VOCAB = 257


def _io_engine(ps, stage, seed):
    from hybrid.flags import Flags
    from hybrid.tensor_parallel import seed_all
    from hybrid.training import build_engine
    cfg = Flags(tensor_model_parallel_size=ps.tp_size, num_layers=2, hidden_size=32,
                      num_attention_heads=4, seq_length=8, zero_stage=stage, seed=seed,
                      zero_param_persistence_threshold=0, reduce_bucket_size=3000,
                      hidden_dropout=0.0, attention_dropout=0.0).validate(ps.world_size)
    rng = seed_all(seed, ps.tp_rank, ps.dp_rank, ps.device)
    model, _, engine = build_engine(cfg, ps, IO_VOCAB, rng)
    return cfg, rng, model, engine


def _io_state(engine, model):
    """This rank's pieces, their (n, 3) values, and how it holds each parameter."""
    import torch
    from hybrid.zero.state import iter_piece_values, shard_state
    pieces = shard_state(engine)["pieces"]
    values = torch.cat(list(iter_piece_values(engine))) if pieces else torch.zeros(0, 3)
    specs = {}
    for n, p in model.named_parameters():
        s = getattr(p, "tp_spec", None)
        specs[n] = (list(p.shape), None, 0, 1) if s is None else (list(s.full_shape), s.dim,
                                                                   s.rank, s.size)
    return {"pieces": pieces, "values": values, "specs": specs, "tp_rank": engine.ps.tp_rank}


def _io_train_and_save(ps, save, stage, weights_to=None):
    """Two steps (non-zero moments), then a save at iteration 2 (and a weights-only
    one, --no-save-optim, in ``weights_to``)."""
    import torch
    from hybrid.checkpoint import save_checkpoint
    cfg, rng, model, engine = _io_engine(ps, stage, seed=3)
    g = torch.Generator().manual_seed(ps.dp_rank)
    for _ in range(2):
        tokens = torch.randint(0, IO_VOCAB, (2, 9), generator=g)
        engine.zero_grad()
        engine.backward(model(tokens[:, :-1], tokens[:, 1:]))
        engine.step(1e-2)
    save_checkpoint(save, 2, 16, engine, ps, cfg, rng, vocab_size=IO_VOCAB)
    if weights_to:
        save_checkpoint(weights_to, 2, 16, engine, ps, cfg, rng, vocab_size=IO_VOCAB,
                        optimizer=False)
    return _io_state(engine, model)


def _io_load(ps, save, stage, save_to=None, **load_kw):
    """Load into a fresh engine (another seed) counting every open under ``save``
    (an independent check of the reader's list), the reader's counters and
    /proc/self/io rchar. Returns them with the loaded state, or {"error": message}.
    ``save_to``: then save the loaded engine there (a checkpoint in this layout).
    ``load_kw``: load_checkpoint's load_optim / load_rng. ``rng_kept``: the CPU and
    tracker RNG states are the fresh engine's own after the load."""
    import builtins
    from hybrid.checkpoint import RangeReader, load_checkpoint, save_checkpoint
    from hybrid.checkpoint.reader import process_rchar
    from hybrid.errors import CheckpointError
    cfg, rng, model, engine = _io_engine(ps, stage, seed=99)
    opened, real_open, real_os_open = [], builtins.open, os.open
    root = os.path.abspath(save) + os.sep

    def record(path):
        path = os.path.abspath(os.fspath(path))
        if path.startswith(root):
            opened.append(os.path.relpath(path, save))

    def open_(file, *a, **k):
        if isinstance(file, (str, os.PathLike)):
            record(file)
        return real_open(file, *a, **k)

    def os_open(path, *a, **k):
        record(path)
        return real_os_open(path, *a, **k)

    import torch
    rng_before = (torch.get_rng_state(), rng.get_states())
    reader = RangeReader()
    builtins.open, os.open = open_, os_open
    before = process_rchar()
    try:
        load_checkpoint(save, engine, ps, cfg, rng, IO_VOCAB, reader=reader, **load_kw)
    except CheckpointError as e:
        return {"error": str(e)}
    finally:
        after = process_rchar()
        builtins.open, os.open = real_open, real_os_open
    if save_to:
        save_checkpoint(save_to, 2, 16, engine, ps, cfg, rng, vocab_size=IO_VOCAB)
    states = rng.get_states()
    rng_kept = (torch.equal(torch.get_rng_state(), rng_before[0])
                and states.keys() == rng_before[1].keys()
                and all(torch.equal(states[k], rng_before[1][k]) for k in states))
    return {"opened": opened, "reader_files": [os.path.relpath(p, save)
                                               for p in reader.files_opened],
            "bytes": reader.bytes_read, "rchar": after - before, "rng_kept": rng_kept,
            "step": engine.optimizer.step_count, **_io_state(engine, model)}


def _barrier(ps):
    import torch
    ps.world_group.all_reduce(torch.zeros(1))


def _rewrite_as_format_2(src, dst):
    """Copy ``--save`` directory ``src`` (format 3, full) to ``dst`` in format 2, from
    that format's spec and not from hybrid.checkpoint: version 2 in metadata.json and
    the headers, no ``zero_layout["columns"]`` and no ``finetune`` record (format 2 had
    neither), and each data file's column blocks ``(3, rows)`` rewritten as
    interleaved fp32 rows ``[master, exp_avg, exp_avg_sq]`` ``(rows, 3)``."""
    import glob
    import json
    import shutil

    import numpy as np
    import torch
    shutil.copytree(src, dst)
    ckpt = os.path.join(dst, "iter_0000002")
    with open(os.path.join(ckpt, "metadata.json")) as f:
        meta = json.load(f)
    assert meta["version"] == 3 and meta["zero_layout"].pop("columns") == [
        "master", "exp_avg", "exp_avg_sq"]
    meta["version"] = 2
    del meta["finetune"]
    with open(os.path.join(ckpt, "metadata.json"), "w") as f:
        json.dump(meta, f, indent=1)
    for head in glob.glob(os.path.join(ckpt, "rank_*.pt")):
        h = torch.load(head, weights_only=True)
        h["version"] = 2
        torch.save(h, head)
        data = np.fromfile(head[:-3] + ".bin", dtype=np.float32).reshape(3, h["data_rows"])
        np.ascontiguousarray(data.T).tofile(head[:-3] + ".bin")


def _io_session(ps, root):
    """World 4. ``a``: TP2 x DP2 ZeRO-3, saved after two steps. Loaded back in the same
    layout, then at ZeRO-1 (same world layout, other units), TP1 x DP4 ZeRO-1 (saved
    again as ``b``), TP4 x DP1 ZeRO-0 and, on rank 0 alone, one process (the
    reference); ``b`` loaded at TP2 x DP2 ZeRO-3 must give back ``a``'s state.
    Weights only (``aw``, saved with ``a`` by --no-save-optim; loads with
    load_optim=False, as --no-load-optim and --finetune do): ``a`` in the same layout
    without the RNG (--finetune) and at TP1 x DP4; ``aw`` in the same layout and at
    TP4 x DP1, and as an exact resume (refused).
    Format 2 (``a2``: ``a`` rewritten by the test, interleaved rows): in the same
    layout exactly and weights only (--finetune), at TP1 x DP4 ZeRO-1 and, weights
    only, at TP4 x DP1 ZeRO-0.
    Then bad files: a truncated data file, a missing one."""
    import shutil

    from hybrid.parallel_state import ParallelState
    a, b, aw, a2 = (os.path.join(root, n) for n in ("a", "b", "aw", "a2"))
    out = {"saved": _io_train_and_save(ps, a, 3, weights_to=aw)}
    if ps.rank == 0:
        _rewrite_as_format_2(a, a2)
    _barrier(ps)
    out.update({"same": _io_load(ps, a, 3),
           "stage1": _io_load(ps, a, 1),
           "weights": _io_load(ps, a, 3, load_optim=False, load_rng=False),
           "wonly_same": _io_load(ps, aw, 3, load_optim=False),
           "wonly_exact": _io_load(ps, aw, 3).get("error"),
           "v2_same": _io_load(ps, a2, 3),
           "v2_weights": _io_load(ps, a2, 3, load_optim=False, load_rng=False)})
    tp1 = ParallelState.build(1, timeout=ps.timeout, device=ps.device)
    out["tp1dp4"] = _io_load(tp1, a, 1, save_to=b)
    out["weights_tp1dp4"] = _io_load(tp1, a, 1, load_optim=False)
    out["v2_tp1dp4"] = _io_load(tp1, a2, 1)
    tp4 = ParallelState.build(4, timeout=ps.timeout, device=ps.device)
    out["tp4dp1"] = _io_load(tp4, a, 0)
    out["wonly_tp4dp1"] = _io_load(tp4, aw, 0, load_optim=False)
    out["v2_weights_tp4dp1"] = _io_load(tp4, a2, 0, load_optim=False)
    out["back"] = _io_load(ps, b, 3)
    if ps.rank == 0:
        out["single"] = _io_load(ParallelState.single(), a, 0)
    truncated, missing = os.path.join(root, "truncated"), os.path.join(root, "missing")
    if ps.rank == 0:
        shutil.copytree(a, truncated)
        data = os.path.join(truncated, "iter_0000002", "rank_00001.bin")
        os.truncate(data, os.path.getsize(data) - 12)
        shutil.copytree(a, missing)
        os.remove(os.path.join(missing, "iter_0000002", "rank_00002.bin"))
    _barrier(ps)
    out["truncated"] = _io_load(ps, truncated, 3).get("error")
    out["missing"] = _io_load(tp4, missing, 0).get("error")
    return out


@pytest.fixture(scope="module")
def io_session(tmp_path_factory):
    from harness import run_ranks
    root = str(tmp_path_factory.mktemp("io"))
    return root, run_ranks(_io_session, world_size=4, tp=2, args=(root,))


def _own_file_bytes(ckpt, rank):
    return sum(os.path.getsize(os.path.join(ckpt, f"rank_{rank:05d}{e}")) for e in (".pt", ".bin"))


def _old_full_tensors(ckpt):
    """Straight from the files, independently of hybrid.checkpoint's readers:
    {name: (full (*shape, C) fp32 values -- C the saved columns, 3 or (weights only) 1 --,
    [full map of the rank whose file holds each element, per TP replica of a replicated
    parameter])}."""
    import glob
    import json

    import numpy as np
    import torch
    with open(os.path.join(ckpt, "metadata.json")) as f:
        meta = json.load(f)
    tp = meta["tensor_model_parallel_size"]
    v2 = meta["version"] == 2  # interleaved rows, all three columns
    ncols = 3 if v2 else len(meta["zero_layout"]["columns"])
    local = {}  # name -> tp rank -> (values (n, C), owners (n,))
    specs = {}
    for head in sorted(glob.glob(os.path.join(ckpt, "rank_*.pt"))):
        h = torch.load(head, weights_only=True)
        # format 3: one block per column, (columns, rows) -> rows of columns;
        # format 2: rows of columns already
        data = torch.from_numpy(np.fromfile(head[:-3] + ".bin", dtype=np.float32))
        data = data.view(h["data_rows"], 3) if v2 else data.view(ncols, h["data_rows"]).t()
        for name, ranges in h["pieces"].items():
            spec = h["specs"][name]
            specs[name] = spec
            n = 1
            for i, s in enumerate(spec["full_shape"]):
                n *= s // spec["tp_size"] if i == spec["dim"] else s
            v, o = local.setdefault(name, {}).setdefault(
                h["tp_rank"], (torch.full((n, ncols), float("nan")), torch.full((n,), -1)))
            for lo, hi, row in ranges:
                v[lo:hi] = data[row: row + hi - lo]
                o[lo:hi] = h["rank"]
    out = {}
    for name, per_tp in local.items():
        spec = specs[name]
        shape = list(spec["full_shape"])
        if spec["dim"] is None:
            out[name] = (per_tp[0][0].view(*shape, ncols),
                         [per_tp[t][1].view(shape) for t in range(tp)])
            continue
        local_shape = list(shape)
        local_shape[spec["dim"]] //= spec["tp_size"]
        vals = torch.cat([per_tp[t][0].view(*local_shape, ncols) for t in range(tp)],
                         spec["dim"])
        owners = torch.cat([per_tp[t][1].view(local_shape) for t in range(tp)], spec["dim"])
        out[name] = (vals, [owners])
    assert not any(torch.isnan(v).any() for v, _ in out.values())  # every element saved
    return meta, out


def _expected_piece(full, owners, spec, lo, hi, tp_rank):
    """(values (hi - lo, C), owner ranks) of new-local [lo, hi) cut from the old full tensors."""
    import torch
    shape, dim, rank, size = spec
    owner = owners[tp_rank % len(owners)]
    if list(full.shape[:-1]) != shape:  # the padded vocabulary: cut or zero-fill rows
        fv, fo = torch.zeros(*shape, full.shape[-1]), torch.full(shape, -1)
        n = min(shape[0], full.shape[0])
        fv[:n], fo[:n] = full[:n], owner[:n]
        full, owner = fv, fo
    if dim is not None:
        full, owner = full.chunk(size, dim)[rank], owner.chunk(size, dim)[rank]
    return full.reshape(-1, full.shape[-1])[lo:hi], owner.reshape(-1)[lo:hi]


def test_same_layout_load_reads_only_the_rank_s_own_files(io_session):
    """TP2 x DP2 ZeRO-3, same layout: each rank opens latest, the metadata, its own
    header and its own data file, nothing else; reads at most 1.1x its own files
    (the reader's count agrees with the kernel's); and gets back exactly what it saved."""
    import torch
    root, results = io_session
    ckpt = os.path.join(root, "a", "iter_0000002")
    for r, out in enumerate(results):
        s, got = out["saved"], out["same"]
        assert "error" not in got, got
        with open(os.path.join(root, "a", "latest")) as f:
            assert f.read() == "iter_0000002"
        own = {f"iter_0000002/rank_{r:05d}.pt", f"iter_0000002/rank_{r:05d}.bin"}
        assert sorted(got["opened"]) == sorted(["latest", "iter_0000002/metadata.json", *own])
        assert sorted(got["reader_files"]) == sorted(own | {"iter_0000002/metadata.json"})
        assert got["bytes"] <= 1.1 * _own_file_bytes(ckpt, r)
        # rchar also counts 'latest' and Python's own reads; nothing of size
        assert got["bytes"] <= got["rchar"] <= got["bytes"] + 64 * 1024, (got["bytes"],
                                                                          got["rchar"])
        assert got["pieces"] == s["pieces"]
        assert torch.equal(got["values"], s["values"])


def _check_reshard(ckpt, got, r, header, master_only=False):
    """``got`` equals the old full tensors' cut exactly, and rank ``r`` opened only the
    data files holding its elements (plus its own header when ``header``).
    ``master_only`` (a weights-only load): the master equals the cut, both moments
    and the step count are zero, and only master bytes count as needed."""
    import torch
    meta, old = _old_full_tensors(ckpt)
    assert "error" not in got, got
    owners, needed, off = set(), 0, 0
    for name, lo, hi in got["pieces"]:
        v, o = _expected_piece(*old[name], got["specs"][name], lo, hi, got["tp_rank"])
        mine = got["values"][off: off + hi - lo]
        if master_only:
            assert torch.equal(mine[:, :1], v[:, :1]), (r, name, lo, hi)
            assert not mine[:, 1:].any(), (r, name)
        else:
            assert torch.equal(mine, v), (r, name, lo, hi)
        owners |= set(o.tolist()) - {-1}
        off += hi - lo
        needed += hi - lo
    if master_only:
        assert got["step"] == 0
    files = {f"iter_0000002/rank_{k:05d}.bin" for k in owners}
    files |= {f"iter_0000002/rank_{r:05d}.pt"} if header else set()
    assert sorted(got["opened"]) == sorted(["latest", "iter_0000002/metadata.json", *files])
    head = os.path.getsize(os.path.join(ckpt, f"rank_{r:05d}.pt")) if header else 0
    extra = got["bytes"] - head - os.path.getsize(os.path.join(ckpt, "metadata.json"))
    # fp32 master, or master and both moments (always, from format 2's interleaved rows)
    per_element = 4 if master_only and meta["version"] == 3 else 12
    assert extra <= 2 * per_element * needed, (r, extra, needed)  # narrow rectangles: <= 2x


@pytest.mark.parametrize("case", ["stage1", "tp1dp4", "tp4dp1", "single"])
def test_reshard_is_exact_and_reads_only_the_overlapping_ranges(io_session, case):
    """TP2 x DP2 ZeRO-3 -> ZeRO-1 in the same world layout (header read for the RNG
    states), TP1 x DP4, TP4 x DP1 ZeRO-0, and one process: master and both moments
    equal the old full tensors' cut to the bit, and each rank opened only the data
    files holding its elements and read at most 2x what it needs."""
    root, results = io_session
    ckpt = os.path.join(root, "a", "iter_0000002")
    for r, out in enumerate(results):
        if case in out:
            _check_reshard(ckpt, out[case], r, header=case == "stage1")


def _rows(ckpt, rank):
    import torch
    return torch.load(os.path.join(ckpt, f"rank_{rank:05d}.pt"), weights_only=True)["data_rows"]


def test_no_save_optim_writes_the_master_column_only(io_session):
    """--no-save-optim: every data file is exactly 1/3 of the full one (4 of 12 bytes
    per element), the whole checkpoint smaller by just the moments, the columns are
    named, no step or loss scale is recorded, and the master values are the full
    checkpoint's."""
    import json

    import torch
    root, results = io_session
    full, weights = (os.path.join(root, n, "iter_0000002") for n in ("a", "aw"))
    for r in range(len(results)):
        data = [os.path.getsize(os.path.join(c, f"rank_{r:05d}.bin")) for c in (full, weights)]
        assert data[1] * 3 == data[0] == 12 * _rows(full, r) > 0
    # The rest (headers: RNG states, piece tables; metadata) is the same but for the
    # step and loss scale; at this toy size it is a good part of the whole (the
    # whole-checkpoint ratio at a larger size: tests/test_checkpoint.py).
    total = [sum(os.path.getsize(os.path.join(c, f)) for f in os.listdir(c))
             for c in (full, weights)]
    moments = sum(8 * _rows(full, r) for r in range(len(results)))
    assert abs(total[0] - total[1] - moments) < 1024, (total, moments)
    with open(os.path.join(weights, "metadata.json")) as f:
        meta = json.load(f)
    assert meta["zero_layout"]["columns"] == ["master"]
    assert meta["step"] is None and meta["loss_scaler"] is None
    _, old_full = _old_full_tensors(full)
    _, old_weights = _old_full_tensors(weights)
    for name, (values, _) in old_full.items():
        assert torch.equal(old_weights[name][0], values[..., :1]), name


def test_weights_only_load_reads_only_the_master_bytes(io_session):
    """load_optim=False, load_rng=False (--finetune) from a full checkpoint, same layout:
    each rank opens latest, the metadata and its own data file -- not its header -- and
    reads exactly the metadata plus its master block (a third of its data file); it
    gets the saved master, zero moments and step, and keeps its own RNG. With the RNG
    (--no-load-optim) from a weights-only checkpoint it reads its header as well."""
    import torch
    root, results = io_session
    ckpt, wckpt = (os.path.join(root, n, "iter_0000002") for n in ("a", "aw"))
    for r, out in enumerate(results):
        s, got = out["saved"], out["weights"]
        assert "error" not in got, got
        own_bin = f"iter_0000002/rank_{r:05d}.bin"
        assert sorted(got["opened"]) == sorted(["latest", "iter_0000002/metadata.json",
                                                own_bin])
        meta_bytes = os.path.getsize(os.path.join(ckpt, "metadata.json"))
        assert got["bytes"] == meta_bytes + 4 * _rows(ckpt, r)
        assert got["bytes"] <= got["rchar"] <= got["bytes"] + 64 * 1024
        assert got["pieces"] == s["pieces"]
        assert torch.equal(got["values"][:, 0], s["values"][:, 0])
        assert s["values"][:, 1:].abs().sum() > 0 and not got["values"][:, 1:].any()
        assert got["step"] == 0 and out["same"]["step"] == 2
        assert got["rng_kept"] and not out["same"]["rng_kept"]
        w = out["wonly_same"]
        assert "error" not in w, w
        head = f"iter_0000002/rank_{r:05d}.pt"
        assert sorted(w["opened"]) == sorted(["latest", "iter_0000002/metadata.json",
                                              head, own_bin])
        assert w["bytes"] == sum(os.path.getsize(os.path.join(wckpt, f)) for f in
                                 ("metadata.json", f"rank_{r:05d}.pt", f"rank_{r:05d}.bin"))
        assert torch.equal(w["values"][:, 0], s["values"][:, 0]) and not w["values"][:, 1:].any()
        assert not w["rng_kept"] and w["step"] == 0


@pytest.mark.parametrize("case,ckpt", [("weights_tp1dp4", "a"), ("wonly_tp4dp1", "aw")])
def test_weights_only_reshard_reads_only_the_overlapping_master_ranges(io_session, case, ckpt):
    """load_optim=False into TP1 x DP4 ZeRO-1 from the full checkpoint, and into TP4 x
    DP1 ZeRO-0 from the weights-only one: the master is the old full tensor's cut to
    the bit, the moments zero, and each rank read at most 2x the master bytes it
    needs, from only the data files holding its elements."""
    root, results = io_session
    for r, out in enumerate(results):
        _check_reshard(os.path.join(root, ckpt, "iter_0000002"), out[case], r, header=False,
                       master_only=True)


def test_exact_load_of_a_weights_only_checkpoint_names_the_flags(io_session):
    """Resuming a --no-save-optim checkpoint with its optimizer: the same error on every
    rank, naming the checkpoint and the flags that load it, nothing zeroed silently."""
    _, results = io_session
    for out in results:
        e = out["wonly_exact"]
        assert e == results[0]["wonly_exact"]
        assert "aw/iter_0000002: saved with --no-save-optim" in e, e
        assert "--no-load-optim" in e and "--finetune" in e, e


def test_reshard_there_and_back_is_bit_identical(io_session):
    """TP2 x DP2 ZeRO-3 -> TP1 x DP4 ZeRO-1, saved, -> TP2 x DP2 ZeRO-3: every rank has
    exactly the pieces and values it saved at first."""
    import torch
    _, results = io_session
    for out in results:
        assert out["back"]["pieces"] == out["saved"]["pieces"]
        assert torch.equal(out["back"]["values"], out["saved"]["values"])


def test_merged_state_equals_the_raw_files(io_session):
    """The tools' path (one full parameter at a time through the reader)."""
    import torch
    from hybrid.checkpoint import merged_state
    ckpt = os.path.join(io_session[0], "a", "iter_0000002")
    _, old = _old_full_tensors(ckpt)
    _, merged = merged_state(ckpt)
    assert set(merged) == set(old)
    for name, (full, _) in old.items():
        for k, key in enumerate(("master", "exp_avg", "exp_avg_sq")):
            assert torch.equal(merged[name][key], full[..., k]), (name, key)


def test_merged_state_of_a_weights_only_checkpoint_is_its_master(io_session):
    """The tools' path on --no-save-optim: the master only; asking for a moment is a
    CheckpointError naming the flag."""
    import torch
    from hybrid.checkpoint import iter_full_params, merged_state
    from hybrid.errors import CheckpointError
    root = io_session[0]
    _, full = merged_state(os.path.join(root, "a", "iter_0000002"))
    _, weights = merged_state(os.path.join(root, "aw", "iter_0000002"))
    assert set(weights) == set(full)
    for name, s in weights.items():
        assert list(s) == ["master"] and torch.equal(s["master"], full[name]["master"])
    with pytest.raises(CheckpointError, match="saved with --no-save-optim"):
        iter_full_params(os.path.join(root, "aw", "iter_0000002"), ("master", "exp_avg"))


def test_bad_data_files_fail_every_rank_naming_the_file(io_session):
    """A truncated data file (read by rank 1 only) and a missing one (read by the TP4
    ranks that need it): every rank raises the same error, which names the file."""
    _, results = io_session
    for out in results:
        assert "rank_00001.bin: corrupt or truncated" in out["truncated"], out["truncated"]
        assert "rank_00002.bin: missing checkpoint shard" in out["missing"], out["missing"]


@pytest.mark.parametrize("version", [1])
def test_an_older_checkpoint_version_is_named_as_an_older_format(tmp_path, version):
    import json
    from hybrid.checkpoint import read_metadata
    from hybrid.errors import CheckpointError
    (tmp_path / "metadata.json").write_text(json.dumps({"version": version, "complete": True}))
    with pytest.raises(CheckpointError, match=f"metadata.json: an older checkpoint format "
                                              f"\\(version {version}"):
        read_metadata(str(tmp_path))


def test_format_2_loads_exactly_in_the_same_layout(io_session):
    """A format-2 checkpoint (the test's rewrite of ``a``: the same values, interleaved)
    in the same layout: each rank opens latest, the metadata, its own header and data
    file only, reads its own files once, and gets back bit-exactly the master and
    moments it saved, step and RNG included. Weights only (--finetune): the same data
    file, no header, and -- rows being interleaved -- all 12 bytes of each of its rows,
    of which it keeps the master."""
    import torch
    root, results = io_session
    ckpt, ckpt2 = (os.path.join(root, n, "iter_0000002") for n in ("a", "a2"))
    _, old = _old_full_tensors(ckpt)
    _, old2 = _old_full_tensors(ckpt2)
    assert old.keys() == old2.keys()
    assert all(torch.equal(old[n][0], old2[n][0]) for n in old)
    meta_bytes = os.path.getsize(os.path.join(ckpt2, "metadata.json"))
    for r, out in enumerate(results):
        with open(os.path.join(ckpt, f"rank_{r:05d}.bin"), "rb") as f3, \
                open(os.path.join(ckpt2, f"rank_{r:05d}.bin"), "rb") as f2:
            b3, b2 = f3.read(), f2.read()
        assert len(b3) == len(b2) and b3 != b2  # really another byte order
        s, got, w = out["saved"], out["v2_same"], out["v2_weights"]
        assert "error" not in got, got
        own = {f"iter_0000002/rank_{r:05d}.pt", f"iter_0000002/rank_{r:05d}.bin"}
        assert sorted(got["opened"]) == sorted(["latest", "iter_0000002/metadata.json", *own])
        assert got["bytes"] == meta_bytes + _own_file_bytes(ckpt2, r)
        assert got["pieces"] == s["pieces"]
        assert torch.equal(got["values"], s["values"])
        assert got["step"] == 2 and not got["rng_kept"]
        assert "error" not in w, w
        assert sorted(w["opened"]) == sorted(["latest", "iter_0000002/metadata.json",
                                              f"iter_0000002/rank_{r:05d}.bin"])
        assert w["bytes"] == meta_bytes + 12 * _rows(ckpt2, r)
        assert torch.equal(w["values"][:, 0], s["values"][:, 0])
        assert not w["values"][:, 1:].any() and w["step"] == 0 and w["rng_kept"]


@pytest.mark.parametrize("case,master_only", [("v2_tp1dp4", False),
                                              ("v2_weights_tp4dp1", True)])
def test_format_2_reshards_exactly(io_session, case, master_only):
    """Format 2 into TP1 x DP4 ZeRO-1 (master and moments) and, weights only, into
    TP4 x DP1 ZeRO-0: the old full tensors' cut to the bit (read from the interleaved
    files by the test), only the data files holding the rank's elements opened, at
    most 2x the interleaved rows needed read."""
    root, results = io_session
    for r, out in enumerate(results):
        _check_reshard(os.path.join(root, "a2", "iter_0000002"), out[case], r, header=False,
                       master_only=master_only)


def test_tools_read_format_2(io_session, tmp_path):
    """merged_state, convert_checkpoint.py --with-optimizer, generate.py's model and
    export_hf.py on the format-2 copy give the format-3 original's values, to the bit."""
    import torch
    from hybrid.checkpoint import merged_state
    root = io_session[0]
    _, full = merged_state(os.path.join(root, "a", "iter_0000002"))
    _, v2 = merged_state(os.path.join(root, "a2", "iter_0000002"))
    assert v2.keys() == full.keys()
    for name, s in v2.items():
        assert s.keys() == full[name].keys()
        assert all(torch.equal(s[k], full[name][k]) for k in s), name
    out = str(tmp_path / "merged.pt")
    assert script_module("convert_checkpoint").main([os.path.join(root, "a2"), out,
                                               "--with-optimizer"]) == 0
    merged = torch.load(out)
    for name, s in full.items():
        assert torch.equal(merged["model"][name], s["master"])
        assert torch.equal(merged["optimizer"][name]["exp_avg_sq"], s["exp_avg_sq"])
    model, _ = script_module("generate").load_model(os.path.join(root, "a2", "iter_0000002"), "cpu")
    for name, p in model.named_parameters():  # the embedding: its real vocabulary rows
        cut = slice(IO_VOCAB if name == "wte.weight" else None)
        assert torch.equal(p.detach()[cut], full[name]["master"][cut]), name
    pytest.importorskip("safetensors")
    from safetensors.torch import load_file
    hf = str(tmp_path / "hf")
    assert script_module("export_hf").main([os.path.join(root, "a2"), hf]) == 0
    wte = load_file(os.path.join(hf, "model.safetensors"))["transformer.wte.weight"]
    assert torch.equal(wte, full["wte.weight"]["master"][: wte.shape[0]])
