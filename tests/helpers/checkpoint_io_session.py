"""The 4-process checkpoint I/O session and the raw-file readers its tests share.

One session does every save and load the checkpoint I/O tests check
(tests/checkpoint/test_checkpoint_io.py, tests/checkpoint/test_checkpoint_format2.py):
spawning ranks is what costs, so it runs once (the ``io_session`` fixture, session-scoped,
made visible to the tests by conftest.py). The readers here parse the raw
files independently of hybrid.checkpoint.
"""

import os

import pytest

IO_VOCAB = 257
IO_BLOCK = 4096


def _io_engine(ps, stage, seed):
    from hybrid.config import Flags, build_config
    from hybrid.tensor_parallel import seed_all
    from hybrid.train.setup import build_engine
    cfg = build_config(Flags(tensor_model_parallel_size=ps.tp_size, num_layers=2, hidden_size=32,
                      num_attention_heads=4, seq_length=8, zero_stage=stage, seed=seed,
                      zero_param_persistence_threshold=0, reduce_bucket_size=3000,
                      hidden_dropout=0.0, attention_dropout=0.0), ps.world_size)
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
    # 4 KiB checksum blocks (not 16 MiB): several per file, so that partial blocks occur
    save_checkpoint(save, 2, 16, engine, ps, cfg.to_dict(), rng, vocab_size=IO_VOCAB,
                    checksum_block_bytes=IO_BLOCK)
    if weights_to:
        save_checkpoint(weights_to, 2, 16, engine, ps, cfg.to_dict(), rng, vocab_size=IO_VOCAB,
                        optimizer=False, checksum_block_bytes=IO_BLOCK)
    return _io_state(engine, model)


def _io_load(ps, save, stage, save_to=None, **load_kw):
    """Load into a fresh engine (another seed) counting every open under ``save``
    (an independent check of the reader's list), the reader's counters and
    /proc/self/io rchar. Returns them with the loaded state, or {"error": message}.
    ``save_to``: then save the loaded engine there (a checkpoint in this layout).
    ``load_kw``: load_checkpoint's load_optim / load_rng. ``rng_kept``: the CPU and
    tracker RNG states are the fresh engine's own after the load."""
    from hybrid.checkpoint import RangeReader, load_checkpoint, save_checkpoint
    from hybrid.checkpoint.reader import process_rchar
    from hybrid.errors import CheckpointError
    from tests.helpers.opened import files_opened
    cfg, rng, model, engine = _io_engine(ps, stage, seed=99)

    import torch
    rng_before = (torch.get_rng_state(), rng.get_states())
    reader = RangeReader()
    before = process_rchar()
    with files_opened(save) as opened:
        try:
            load_checkpoint(save, engine, ps, cfg.seed, rng, IO_VOCAB, reader=reader, **load_kw)
        except CheckpointError as e:
            return {"error": str(e)}
        finally:
            after = process_rchar()
    if save_to:
        save_checkpoint(save_to, 2, 16, engine, ps, cfg.to_dict(), rng, vocab_size=IO_VOCAB)
    states = rng.get_states()
    rng_kept = (torch.equal(torch.get_rng_state(), rng_before[0])
                and states.keys() == rng_before[1].keys()
                and all(torch.equal(states[k], rng_before[1][k]) for k in states))
    return {"opened": opened, "reader_files": [os.path.relpath(p, save)
                                               for p in reader.files_opened],
            "bytes": reader.bytes_read, "rechecked": reader.bytes_rechecked,
            "rchar": after - before, "rng_kept": rng_kept,
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
    del meta["finetune"], meta["checksums"]
    with open(os.path.join(ckpt, "metadata.json"), "w") as f:
        json.dump(meta, f, indent=1)
    for head in glob.glob(os.path.join(ckpt, "rank_*.pt")):
        h = torch.load(head, weights_only=True)
        h["version"] = 2
        del h["checksums"]
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

    from hybrid.parallel.state import ParallelState
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


@pytest.fixture(scope="session")
def io_session(tmp_path_factory):
    from tests.helpers.harness import run_ranks
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
    # each data file read comes with its header (the data file's checksums); in the same
    # world layout the rank's own header is read too (the RNG states)
    checked = "checksums" in meta
    heads = {k for k in owners} if checked else set()
    heads |= {r} if header else set()
    files = {f"iter_0000002/rank_{k:05d}.bin" for k in owners}
    files |= {f"iter_0000002/rank_{k:05d}.pt" for k in heads}
    assert sorted(got["opened"]) == sorted(["latest", "iter_0000002/metadata.json", *files])
    head = sum(os.path.getsize(os.path.join(ckpt, f"rank_{k:05d}.pt")) for k in heads)
    extra = (got["bytes"] - head - os.path.getsize(os.path.join(ckpt, "metadata.json"))
             - got["rechecked"])
    # fp32 master, or master and both moments (always, from format 2's interleaved rows)
    per_element = 4 if master_only and meta["version"] == 3 else 12
    assert extra <= 2 * per_element * needed, (r, extra, needed)  # narrow rectangles: <= 2x
    # checking the checksums reads only the bytes of touched blocks the load did not read:
    # never one twice (the needed elements were all read, at least once)
    data_files = sum(os.path.getsize(os.path.join(ckpt, f"rank_{k:05d}.bin")) for k in owners)
    assert got["rechecked"] <= data_files - per_element * needed, (r, got["rechecked"])


def _rows(ckpt, rank):
    import torch
    return torch.load(os.path.join(ckpt, f"rank_{rank:05d}.pt"), weights_only=True)["data_rows"]
