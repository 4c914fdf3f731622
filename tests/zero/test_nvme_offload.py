"""The nvme tier (ZeRO-Infinity's optimizer on disk) against the host tier, bit for bit.

Both run the same AdamW arithmetic through the piece-exact step, over units
(host) or over tiles that straddle units (nvme), so every loss, gradient norm,
parameter and master element must be *equal*, not close. The host tier itself
is checked against plain torch in test_offload.py and test_zero.py."""

import contextlib
import ctypes
import dataclasses
import logging
import os
import subprocess
from unittest import mock

import pytest
import torch

from hybrid.errors import ConfigError, SwapIOError, SwapSpaceError
from hybrid.parallel.state import ParallelState
from hybrid.recompute.checkpointing import apply_activation_checkpointing
from hybrid.tensor_parallel import InitValues
from hybrid.zero.offload.nvme import gds
from hybrid.zero.offload.nvme.homes import DiskHome
from hybrid.zero.offload.nvme.swap import SwapSpace
from hybrid.zero.offload.tiers import OffloadTiers, host_pinning
from hybrid.zero.state import iter_piece_values
from tests.helpers.harness import run_ranks
from tests.helpers.launch import TINY, pretrain
from tests.helpers.zero_reference import (
    _dp_step,
    _gpt,
    _my_micro_batches,
    _named_params,
    _train_cfg,
    zero_engine,
)

TILE = 1024  # elements: the shards here are a few thousand, so tiles cross unit bounds


class FakeGdsFile:
    """``torch.cuda.gds.GdsFile``'s interface over POSIX reads of CPU storages: the
    GDS path's wiring (probe, reader threads, offsets, whole-storage reads) on a CPU.
    ``reads``: (offset, bytes) of every load, for the test to check."""

    reads: list = []

    def __init__(self, path, flags):
        self.fd = os.open(path, flags)

    def __del__(self):
        os.close(self.fd)

    def save_storage(self, storage, offset=0):
        os.pwrite(self.fd, ctypes.string_at(storage.data_ptr(), storage.nbytes()), offset)

    def load_storage(self, storage, offset=0):
        data = os.pread(self.fd, storage.nbytes(), offset)
        ctypes.memmove(storage.data_ptr(), data, len(data))
        FakeGdsFile.reads.append((offset, len(data)))


def _engine(ps, stage, kw, tier, root):
    """``tier``: "optimizer[+param[+gds]]", e.g. "cpu", "nvme", "cpu+nvme" (param
    offload), "cpu+nvme+gds" (its reads through :class:`FakeGdsFile`)."""
    buffers = kw.pop("buffers", 3)
    optimizer, _, param = tier.partition("+")
    param, _, via = param.partition("+")
    nvme = dict(offload_nvme_path=root, offload_buffer_size=TILE,
                offload_buffer_count=buffers) if "nvme" in tier else {}
    cfg = _train_cfg(ps.world_size, ps.tp_size, zero_stage=stage, offload_optimizer=optimizer,
                     offload_param=param or None, offload_gds=bool(via), **nvme, **kw)
    model = _gpt(cfg, ps, device="meta")
    phase = None
    if cfg.recompute.granularity:
        phase = apply_activation_checkpointing(model, ps, model.rng, cfg.recompute).phase
    # "gds": the stand-in for cuFile; "cufile": torch's own binding
    with mock.patch.object(gds, "gds_file_class", lambda: FakeGdsFile) if via == "gds" \
            else contextlib.nullcontext():
        engine = zero_engine(model, ps, cfg, values=InitValues(cfg.seed, model.init_of),
                             recompute=phase)
    FakeGdsFile.reads = []  # (not the probe's)
    return cfg, model, engine


def _run(ps, stage, kw, tier, root, steps=range(2)):
    cfg, model, engine = _engine(ps, stage, dict(kw), tier, root)
    losses, norms, skipped = [], [], []
    for step in steps:
        loss, result = _dp_step(model, engine, ps, cfg, step)
        losses.append(loss)
        norms.append(float(result.grad_norm))
        skipped.append(bool(result.skipped))
    params = _named_params(model, engine)
    pieces = [v.clone() for v in iter_piece_values(engine)]
    off = engine.offload
    copy = off.out if off.writer is None else off.writer.out
    out = {"losses": losses, "norms": norms, "skipped": skipped, "params": params,
           "pieces": pieces, "steps": engine.optimizer.step_count,
           "bytes": engine.model_state_bytes(),
           # elements of the host copy of new parameters, and of the units without a home
           "upload_copy": 0 if copy is None else copy.numel(),
           "homeless": sum(u.own_hi - u.own_lo for u in engine.units if u.home is None),
           # host bytes of the gradients on their way to the step, and what bounds them
           "grad_host_bytes": off.grads.nbytes(),
           "biggest": max(u.own_hi - u.own_lo for u in engine.units),
           "grad_esize": torch.empty((), dtype=engine.grad_dtype).element_size(),
           # GDS: why not used (None: used), the reads, the (offset, bytes) of each slot
           "gds": engine.tiers.gds, "gds_reads": list(FakeGdsFile.reads),
           "slots": {(u.home.offset, u.home.numel * u.shard.element_size())
                     for u in engine.units if hasattr(u.home, "offset")}}
    return out, (cfg, model, engine)


def _compare(ps, variants, root):
    """For each variant: [(tier, its run, the swap files' sizes, any left after close)]
    for the host tier first, then each of the variant's other tiers."""
    out = []
    for stage, kw, tiers in variants:
        runs = []
        for tier in ("cpu", *tiers):
            got, (_, _, e) = _run(ps, stage, kw, tier, root)
            where = os.path.join(root, f"rank{ps.rank:05d}")
            files = {f: os.path.getsize(os.path.join(where, f))
                     for f in (os.listdir(where) if os.path.isdir(where) else [])
                     if f.endswith(".swp")}
            e.close()
            left = [f for f in files if os.path.exists(os.path.join(where, f))]
            runs.append((tier, got, files, left))
        out.append(runs)
    return out


def _assert_tier_bytes(tier, got, files, left, what):
    """The swap files hold what the tier moved there (the optimizer 12 bytes per element
    of whole tiles); they are gone after close; the host keeps only staging."""
    n = sum(p.shape[0] for p in got["pieces"])
    optimizer, _, param = tier.partition("+")
    want = {"optimizer.swp", "grads.swp"} if optimizer == "nvme" else set()
    want |= {"params.swp"} if param.startswith("nvme") else set()
    assert set(files) == want and not left, (what, files, left)
    if optimizer == "nvme":
        e = got["grad_esize"]
        assert files["optimizer.swp"] == -(-n // TILE) * TILE * 12, what
        # the gradient shard is on disk too, tile by tile in 4096-aligned slots; the
        # host holds 2 staging buffers of the largest unit (each 4096-aligned), not it
        assert files["grads.swp"] == -(-n // TILE) * -(-TILE * e // 4096) * 4096, what
        assert got["grad_host_bytes"] <= 2 * (got["biggest"] * e + 4096) < n * e, what
        assert got["bytes"]["optimizer"] <= 4 * TILE * (12 + e) + got["grad_host_bytes"] \
            + n * 4, what
    if param.startswith("nvme"):
        assert files["params.swp"] >= got["bytes"]["params"], what
    if param.endswith("+gds"):  # every shard came off disk whole, at its slot, in each
        # forward and backward of both steps
        reads = got["gds_reads"]
        assert got["gds"] is None and set(reads) == got["slots"], what
        assert all(reads.count(s) >= 4 for s in got["slots"]), what
    else:
        assert not got["gds_reads"], what
    if param:  # the partitioned shards left the device: only persistent units remain
        assert got["bytes"]["params"] < n * 2, what
        # the step writes new shards straight home: a host copy only of the units kept
        # whole (the delayed update's copy holds them for a step: the whole shard)
        delayed = "delayed" in what
        assert got["upload_copy"] == (n if delayed else got["homeless"]) < 2 * n, what
    assert got["bytes"]["disk"] == sum(files.values()), what


def _assert_equal(host, nvme, what):
    assert host["losses"] == nvme["losses"], (what, host["losses"], nvme["losses"])
    assert host["norms"] == nvme["norms"], what
    assert host["skipped"] == nvme["skipped"] and host["steps"] == nvme["steps"], what
    for name, t in host["params"].items():
        assert torch.equal(t, nvme["params"][name]), (what, name)
    assert len(host["pieces"]) == len(nvme["pieces"])
    for a, b in zip(host["pieces"], nvme["pieces"]):  # master, exp_avg, exp_avg_sq
        assert torch.equal(a, b), what


# the host and disk homes of stage 3 (the disk's read through GPUDirect Storage's interface)
P3 = ("nvme", "cpu+cpu", "cpu+nvme", "cpu+nvme+gds", "nvme+nvme")
DP_VARIANTS = [(1, {}, ("nvme",)),
               (2, {"offload_delayed_update": True, "offload_delayed_update_warmup": 1,
                    "buffers": 2}, ("nvme",)),
               (3, {"bf16": True}, P3),
               (3, {"offload_delayed_update": True}, ("nvme+nvme",)),
               # fp16, with the small units kept whole (their new parameters go up from a
               # host copy of their own, the others straight to their homes)
               (3, {"fp16": True, "initial_loss_scale": 1024.0, "buffers": 4,
                    "zero_param_persistence_threshold": 200}, ("nvme+nvme",))]
TP_VARIANTS = [(3, {"bf16": True, "sequence_parallel": True, "recompute_granularity": "full"},
                ("nvme+nvme",))]


def test_nvme_tier_is_the_host_tier_bit_for_bit(tmp_path):
    """TP1 x DP2 at stages 1-3 (fp32, bf16, fp16 with its loss scale, the delayed update)
    and TP2 with SP and full recompute: every loss, norm, parameter, master and moment
    element of the nvme tier equals the host tier's. The swap file holds 12 bytes per
    element of whole tiles, and is deleted when the engine closes."""
    for world_tp, variants in ((1, DP_VARIANTS), (2, TP_VARIANTS)):
        root = str(tmp_path / f"tp{world_tp}")
        res = run_ranks(_compare, world_size=2, tp=world_tp, args=(variants, root))
        for rank, per_rank in enumerate(res):
            for (stage, kw, _), runs in zip(variants, per_rank):
                _, host, _, _ = runs[0]
                for tier, got, files, left in runs[1:]:
                    what = f"rank {rank}, TP{world_tp}, stage {stage} {kw}, {tier}"
                    _assert_equal(host, got, what)
                    _assert_tier_bytes(tier, got, files, left, what)


@pytest.mark.skipif(torch.cuda.is_available(), reason="cuFile may work on a GPU machine")
def test_gds_where_cufile_does_not_work_is_one_warning_and_the_pinned_path(tmp_path, caplog):
    """--offload-gds with torch's own cuFile binding on this CPU build: the probe says
    why it cannot be used (one warning naming the flag), params.swp is read through
    host buffers, training steps as without the flag, and the probe leaves no file.
    Without --offload-param nvme the flag is one error naming both flags."""
    ps = ParallelState.single()
    with caplog.at_level(logging.WARNING, logger="hybrid"):
        cfg, model, engine = _engine(ps, 3, {}, "cpu+nvme+cufile", str(tmp_path / "a"))
    reason = engine.tiers.gds
    assert reason and "not supported on this platform" in reason, reason
    warned = [r.getMessage() for r in caplog.records if "--offload-gds" in r.getMessage()]
    assert warned == [f"--offload-gds: GPUDirect Storage does not work here ({reason}); "
                      f"params.swp is read through host buffers"]
    homes = [u.home for u in engine.units if u.home is not None]
    assert homes and all(type(h) is DiskHome for h in homes)
    assert sorted(os.listdir(tmp_path / "a" / "rank00000")) == [".lock", "params.swp"]
    plain = _engine(ps, 3, {}, "cpu+nvme", str(tmp_path / "b"))
    for step in range(2):
        assert _dp_step(model, engine, ps, cfg, step)[0] == \
            _dp_step(plain[1], plain[2], ps, plain[0], step)[0]
    engine.close()
    plain[2].close()
    with pytest.raises(ConfigError, match="--offload-gds .* needs --offload-param nvme "
                                          r"\(got cpu\)"):
        _train_cfg(1, 1, zero_stage=3, offload_optimizer="cpu", offload_param="cpu",
                   offload_gds=True)


def test_pinning_asked_without_cuda_is_pageable_memory(tmp_path):
    """--offload-pin-memory (DeepSpeed's pin_memory keys) on a machine without CUDA:
    the host homes and buffers are ordinary memory and training steps (pinning needs
    CUDA; it used to raise at the first host home). Unasked, a CPU device pins nothing."""
    assert host_pinning(True, torch.device("cpu")) is torch.cuda.is_available()
    assert host_pinning(None, torch.device("cpu")) is False
    ps = ParallelState.single()
    cfg, model, engine = _engine(ps, 3, {"offload_pin_memory": True}, "cpu+cpu",
                                 str(tmp_path))
    assert engine.tiers.pin is torch.cuda.is_available()
    assert _dp_step(model, engine, ps, cfg, 0)[1].skipped is not None
    engine.close()


def test_a_shard_smaller_than_a_tile_stages_and_swaps_its_own_size(tmp_path):
    """The default tile (8Mi elements: 96 MiB of states per staging buffer) is cut to a
    smaller shard, rounded up to 1024 elements: the staging buffers, the swap files and
    the estimator's terms all follow OffloadConfig.tile."""
    from hybrid.config.sections import OffloadConfig
    from hybrid.zero.offload.nvme import tiles
    default = OffloadConfig(optimizer="nvme")
    assert (default.tile(50_000), default.tile(1), default.tile(10 << 20)) == (
        50_176, 1024, 8 << 20)
    ps = ParallelState.single()
    kw = {"buffers": 2}
    cfg, model, engine = _engine(ps, 1, kw, "nvme", str(tmp_path))
    engine.close()
    cfg = dataclasses.replace(cfg, offload=dataclasses.replace(cfg.offload,
                                                               buffer_size=1 << 23))
    n = sum(u.own_hi - u.own_lo for u in engine.units)
    tier = OffloadTiers(cfg.offload, 0, engine.units, dtype=torch.float32,
                        grad_dtype=torch.float32, device=torch.device("cpu"))
    try:
        tile = -(-n // 1024) * 1024
        assert n < 1 << 23 and tier.states.tile == tile
        assert [b.numel() for b in tier.states.staging] == [3 * tile] * 2
        assert os.path.getsize(os.path.join(tier.space.dir, tiles.FILE)) == 12 * tile
    finally:
        tier.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_disk_homes_train_the_host_home_s_curve(tmp_path):
    """On a GPU, stage 3 bf16 with the parameter shards in params.swp -- read through
    pinned host buffers, and with --offload-gds through GPUDirect Storage where the
    probe passes (else that same path; ``tiers.gds`` says which) -- trains the curve of
    the host home bit for bit: losses and every parameter after 3 steps."""
    from hybrid.train.step import train_step
    ps = ParallelState.single("cuda")
    runs = {}
    for tier in ("cpu+cpu", "cpu+nvme", "cpu+nvme+cufile"):
        cfg, model, engine = _engine(ps, 3, {"bf16": True}, tier, str(tmp_path / tier))
        losses = []
        for step in range(3):
            batches = [(x.cuda(), y.cuda()) for x, y in
                       _my_micro_batches(step, ps, cfg.loop.micro_batch_size)]
            losses.append(float(train_step(model, engine, batches, 1e-2)[0]))
        runs[tier] = (losses, _named_params(model, engine), engine.tiers.gds)
        engine.close()
    print("GPUDirect Storage:", runs["cpu+nvme+cufile"][2] or "used")
    losses, params, _ = runs["cpu+cpu"]
    for tier in ("cpu+nvme", "cpu+nvme+cufile"):
        assert runs[tier][0] == losses, (tier, runs[tier][0], losses)
        for name, t in params.items():
            assert torch.equal(runs[tier][1][name], t), (tier, name)


def test_not_enough_space_is_one_error_before_training(tmp_path):
    """The bytes asked exceed what the directory's file system has free: one error
    naming the directory, the bytes needed and free, and nothing left behind."""
    st = os.statvfs(tmp_path)
    need = st.f_bavail * st.f_frsize + (1 << 40)
    with pytest.raises(SwapSpaceError) as e:
        SwapSpace(str(tmp_path), 3, {"optimizer.swp": need})
    msg = str(e.value)
    assert f"{tmp_path / 'rank00003'}: {need} bytes needed" in msg and " free" in msg
    assert not (tmp_path / "rank00003" / "optimizer.swp").exists()


def test_two_jobs_on_one_directory_and_a_swap_file_lost_mid_run(tmp_path):
    """A second job on the same --offload-nvme-path stops at start naming the directory;
    a swap file truncated (the gradients', the optimizer's), then deleted, between steps
    is named with its rank."""
    ps = ParallelState.single()
    cfg, model, engine = _engine(ps, 1, {}, "nvme", str(tmp_path))
    with pytest.raises(SwapSpaceError, match=f"{tmp_path / 'rank00000'} is in use by another "
                                             f"job \\(pid {os.getpid()}"):
        SwapSpace(str(tmp_path), 0, {})
    _dp_step(model, engine, ps, cfg, 0)
    grads = tmp_path / "rank00000" / "grads.swp"  # (the gradients' file is checked too)
    size = os.path.getsize(grads)
    os.truncate(grads, 0)
    with pytest.raises(SwapIOError, match=f"rank 0: swap file {grads} was truncated to "):
        _dp_step(model, engine, ps, cfg, 1)
    os.truncate(grads, size)
    path = tmp_path / "rank00000" / "optimizer.swp"
    os.truncate(path, 4096)
    with pytest.raises(SwapIOError, match=f"rank 0: swap file {path} was truncated to 4096"):
        _dp_step(model, engine, ps, cfg, 1)
    os.unlink(path)
    with pytest.raises(SwapIOError, match=f"rank 0: swap file {path} was deleted"):
        _dp_step(model, engine, ps, cfg, 1)
    engine.close()
    SwapSpace(str(tmp_path), 0, {}).close()  # the lock went with the engine


def test_a_full_disk_through_the_script(tmp_path):
    """--offload-nvme-path on a 64 KiB file system: pretrain_gpt.py exits 2 with the one
    error, before any step (tmpfs mounted for the test; needs root)."""
    small = tmp_path / "small"
    small.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs",
                                            str(small)], capture_output=True,
                                           check=False).returncode:
        pytest.skip("cannot mount a size-limited tmpfs here (needs root)")
    try:
        r = pretrain(1, TINY + ["--zero-stage", "1", "--offload-optimizer", "nvme",
                                "--offload-nvme-path", str(small), "--train-iters", "2",
                                "--offload-buffer-size", "1024"])
    finally:
        subprocess.run(["umount", str(small)], check=True)
    assert r.returncode == 2, r.stderr[-2000:]
    assert f"not enough space for the nvme swap files in {small / 'rank00000'}: " in r.stderr
    assert "iteration" not in r.stdout
