"""A ``hybrid.initialize`` engine's frozen parameters and persistent buffers are saved
and loaded (``module_state.pt``, :mod:`hybrid.checkpoint.module_state`): a resume from
another start continues the saved run exactly, another module's state is one error
naming the file. One process, ``ParallelState.single()``."""

import json
import os
from pathlib import Path

import pytest
import torch
from torch import nn

from hybrid import deepspeed
from hybrid.checkpoint import module_state
from hybrid.checkpoint.integrity import verify_checkpoint
from hybrid.errors import CheckpointError, ConfigError
from hybrid.parallel.state import ParallelState
from hybrid.zero.flat_unit import ParamState
from tests.helpers.harness import run_ranks


class Net(nn.Module):
    """A frozen pretrained part, a BatchNorm (running statistics: buffers), a trained head."""

    def __init__(self, norm: bool = True):
        super().__init__()
        self.base = nn.Linear(6, 8)
        self.norm = nn.BatchNorm1d(8, affine=False) if norm else nn.Identity()
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.norm(self.base(x))))


def _engine(stage: int, seed: int, norm: bool = True, mpu=None, **zero):
    """``zero``: more of the ds_config's zero_optimization; ``mpu``: the ranks (one
    process by default), each training on the same 4 samples."""
    torch.manual_seed(seed)  # another seed: another frozen part and head
    net = Net(norm)
    net.base.requires_grad_(False)
    mpu = mpu or ParallelState.single()
    cfg = {"train_batch_size": 4 * mpu.dp_size,
           "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
           "zero_optimization": {"stage": stage, **zero}}
    params = [p for p in net.parameters() if p.requires_grad]
    return deepspeed.initialize(model=net, model_parameters=params, config=cfg, mpu=mpu)[0]


def _train(engine, steps) -> list[float]:
    losses = []
    for step in steps:
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(4, 6, generator=g), torch.randint(0, 3, (4,), generator=g)
        loss = nn.functional.cross_entropy(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("stage", [1, 3])
def test_frozen_parameters_and_buffers_come_back_and_the_run_continues_exactly(tmp_path,
                                                                                stage):
    """2 steps, save, 2 more; an engine built from another seed (another frozen layer,
    fresh BatchNorm statistics) loads the save and its 2 steps are the saved run's, bit
    for bit; its frozen weight and buffers are the saver's."""
    engine = _engine(stage, 0)
    _train(engine, range(2))
    path = engine.save_checkpoint(str(tmp_path))
    assert "module_state.pt" in os.listdir(path)
    assert verify_checkpoint(path)["damaged"] == []
    want = _train(engine, range(2, 4))
    other = _engine(stage, 1)
    assert not torch.equal(other.module.base.weight, engine.module.base.weight)
    other.load_checkpoint(str(tmp_path))
    saved = torch.load(os.path.join(path, "module_state.pt"), weights_only=True)
    assert sorted(saved) == ["base.bias", "base.weight", "norm.num_batches_tracked",
                             "norm.running_mean", "norm.running_var"]
    assert int(saved["norm.num_batches_tracked"]) == 2
    for name, t in saved.items():
        assert torch.equal(other.module.state_dict()[name], t), name
    assert _train(other, range(2, 4)) == want


# ZeRO 3 partitions the frozen base (hybrid/zero/units.py, [Note: frozen units]) once it
# is over the persistence threshold: 0 here, so every parameter is partitioned
PARTITIONED = {"stage3_param_persistence_threshold": 0}


def _partitioned_frozen_run(ps, root: str):
    """At DP 2: 2 steps, save, 2 more; another seed's engine loads and continues; a
    stage 2 engine (the frozen base whole) loads the same save."""
    engine = _engine(3, 0, mpu=ps, **PARTITIONED)
    start = module_state.gather_frozen(engine.zero.frozen_units, engine.zero.param_pipeline,
                                       keep=True)[id(engine.module.base.weight)]
    (unit,) = engine.zero.frozen_units
    held = unit.shard.untyped_storage().nbytes() + unit.full.untyped_storage().nbytes()
    _train(engine, range(2))
    path = engine.save_checkpoint(root)
    want = _train(engine, range(2, 4))
    other = _engine(3, 1, mpu=ps, **PARTITIONED)
    other.load_checkpoint(root)
    (back,) = other.zero.frozen_units
    shard = back.shard.clone()
    got = _train(other, range(2, 4))
    other.save_16bit_model(os.path.join(root, "16bit"))  # (gathers the frozen unit too)
    # rank 1 writes the frozen weight (a pretrained value loaded by hand): every rank keeps
    # its shard of it afterwards
    w = other.module.base.weight
    with deepspeed.zero.GatheredParameters([w], modifier_rank=1), torch.no_grad():
        w.fill_(0.5 if ps.dp_rank == 1 else -1.0)
    with other.zero.gathered():
        modified = w.detach().clone()
    stage2 = _engine(2, 1, mpu=ps)
    stage2.load_checkpoint(root)
    return {"path": path, "start": start, "held": held, "unit": (unit.numel, unit.padded),
            "state": unit.state, "want": want, "got": got, "shard": shard,
            "own": (back.own_lo, back.own_hi), "stage2_base": stage2.module.base.weight.clone(),
            "stage2": _train(stage2, range(2, 4)), "modified": modified}


def test_a_partitioned_frozen_base_round_trips_and_resumes_at_another_stage_and_dp(
        tmp_path):
    """ZeRO 3 at DP 2 with the frozen base partitioned (each rank holds half of it): the
    save writes it whole (gathered unit by unit) and unchanged bit for bit; an engine
    from another seed loads it (each rank its shard of it) and continues the saved run
    bit for bit; a stage 2 engine at DP 2 and a one-process stage 3 engine load it whole
    and continue the same curve; ``zero_to_fp32`` and ``save_16bit_model`` give it whole;
    a ``GatheredParameters(modifier_rank=1)`` write of it stays."""
    from hybrid.deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    res = run_ranks(_partitioned_frozen_run, world_size=2, args=(str(tmp_path),))
    r0 = res[0]
    for r in res:
        assert torch.equal(r["modified"], torch.full((8, 6), 0.5))
    assert torch.equal(get_fp32_state_dict_from_zero_checkpoint(str(tmp_path))["base.weight"],
                       r0["start"])
    sixteen = torch.load(tmp_path / "16bit" / "pytorch_model.bin", weights_only=True)
    assert torch.equal(sixteen["base.weight"], r0["start"])
    numel, padded = r0["unit"]
    assert numel == 6 * 8 + 8 and padded == 56
    for r in res:
        assert r["held"] == padded // 2 * 4 and r["state"] is ParamState.SHARDED
        assert r["got"] == r0["want"] == r["want"]
    saved = torch.load(os.path.join(r0["path"], "module_state.pt"), weights_only=True)
    assert torch.equal(saved["base.weight"], r0["start"])  # (never trained)
    flat = torch.cat([saved["base.weight"].reshape(-1), saved["base.bias"]])
    for r in res:  # each rank took its shard of the file
        lo, hi = r["own"]
        assert torch.equal(r["shard"], flat[lo:hi])
    assert torch.equal(r0["stage2_base"], saved["base.weight"])
    for a, b in zip(r0["stage2"], r0["want"]):
        assert abs(a - b) <= 1e-6 * abs(b), (r0["stage2"], r0["want"])
    single = _engine(3, 1, **PARTITIONED)
    assert single.zero.frozen_units  # (over DP 1: a unit all the same)
    single.load_checkpoint(str(tmp_path))
    with single.zero.gathered():
        assert torch.equal(single.module.base.weight, saved["base.weight"])
    for a, b in zip(_train(single, range(2, 4)), r0["want"]):
        assert abs(a - b) <= 1e-6 * abs(b)


def test_exclude_frozen_parameters_saves_the_buffers_and_the_load_keeps_the_module_s_own(
        tmp_path):
    """DeepSpeed's ``exclude_frozen_parameters=True`` (Hugging Face's Trainer passes it for
    a PEFT model): the file holds the buffers only; a script that rebuilds the same
    frozen part (its pretrained base) continues the saved run bit for bit, and one with
    another frozen part keeps it (the checkpoint does not claim to have it)."""
    engine = _engine(3, 0)
    _train(engine, range(2))
    path = engine.save_checkpoint(str(tmp_path), exclude_frozen_parameters=True)
    want = _train(engine, range(2, 4))
    saved = torch.load(os.path.join(path, "module_state.pt"), weights_only=True)
    assert sorted(saved) == ["norm.num_batches_tracked", "norm.running_mean",
                             "norm.running_var"]
    same = _engine(3, 0)  # the same frozen base, fresh statistics
    with torch.no_grad():
        same.module.head.weight.mul_(3)  # (the load must replace what trains)
    same.load_checkpoint(str(tmp_path))
    assert torch.equal(same.module.norm.running_mean, saved["norm.running_mean"])
    assert _train(same, range(2, 4)) == want
    other = _engine(3, 1)
    base = other.module.base.weight.detach().clone()
    other.load_checkpoint(str(tmp_path))
    assert torch.equal(other.module.base.weight, base)


def test_zero_to_fp32_gives_the_buffers_and_frozen_parameters_as_deepspeed_s_does(tmp_path):
    """``get_fp32_state_dict_from_zero_checkpoint``: the whole state dict, buffers and
    frozen parameters with the trained masters (DeepSpeed's keys); the frozen ones left
    out when asked, or when the save excluded them."""
    from hybrid.deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    engine = _engine(3, 0)
    _train(engine, range(1))
    engine.save_checkpoint(str(tmp_path / "all"))
    engine.save_checkpoint(str(tmp_path / "some"), exclude_frozen_parameters=True)
    full = engine.module.state_dict()
    for where, exclude, frozen in (("all", False, True), ("all", True, False),
                                   ("some", False, False)):
        sd = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path / where),
                                                      exclude_frozen_parameters=exclude)
        want = [n for n in full if frozen or not n.startswith("base.")]
        assert sorted(sd) == sorted(want), (where, exclude)
        for n in ("base.weight", "norm.running_var") if frozen else ("norm.running_var",):
            assert torch.equal(sd[n], full[n]), n


def _mapped_from(t: torch.Tensor, path: str) -> bool:
    """Whether ``t``'s bytes lie in a mapping of file ``path`` (Linux: /proc/self/maps)."""
    ptr = t.data_ptr()
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split()
        if len(fields) >= 6 and fields[5] == path:
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            if lo <= ptr < hi:
                return True
    return False


def test_a_frozen_base_is_written_from_the_module_s_own_tensors_and_read_mapped(tmp_path,
                                                                                monkeypatch):
    """No second copy of a frozen base on either side: the save hands ``torch.save`` the
    module's own frozen tensors (the buffers, which steps move, copied) and takes the
    checksum as the bytes pass; the load maps the file (checked in 8 MiB reads)."""
    engine = _engine(1, 0)
    seen = {}
    real = torch.save

    def save(obj, f, *a, **kw):
        if isinstance(obj, dict) and "base.weight" in obj:
            seen.update(obj)
        return real(obj, f, *a, **kw)
    monkeypatch.setattr(torch, "save", save)
    path = engine.save_checkpoint(str(tmp_path))
    monkeypatch.setattr(torch, "save", real)
    net = engine.module
    assert seen["base.weight"].data_ptr() == net.base.weight.data_ptr()
    assert seen["norm.running_mean"].data_ptr() != net.norm.running_mean.data_ptr()
    assert verify_checkpoint(path)["damaged"] == []
    meta = json.loads(Path(path, "metadata.json").read_text())
    back = module_state.read(path, meta)
    assert _mapped_from(back["base.weight"], os.path.join(path, module_state.FILE))
    assert torch.equal(back["base.weight"], net.base.weight)


def test_another_module_s_buffers_and_a_damaged_file_are_one_error_naming_it(tmp_path):
    path = _engine(1, 0).save_checkpoint(str(tmp_path))
    file = os.path.join(path, "module_state.pt")
    # the same parameters (the signature checked before), no BatchNorm statistics
    with pytest.raises(CheckpointError, match=rf"^{file}: frozen parameters and buffers of "
                                              r"another module: it has \['norm.num_batches"):
        _engine(1, 0, norm=False).load_checkpoint(str(tmp_path))
    data = bytearray(Path(file).read_bytes())
    data[len(data) // 2] ^= 0xFF
    Path(file).write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=rf"^{file}: bytes \[0, {len(data)}\) do not "
                                              r"match their saved checksum"):
        _engine(1, 0).load_checkpoint(str(tmp_path))


def test_a_module_with_nothing_frozen_writes_no_file_and_a_split_frozen_one_is_refused():
    assert module_state.encode(nn.Linear(2, 2), tp_size=1) is None
    net = Net()
    net.base.requires_grad_(False)
    net.base.weight.tp_spec = object()  # (a TP-split parameter, as hybrid's layers mark one)
    with pytest.raises(ConfigError, match=r"^save_checkpoint: base.weight is frozen"):
        module_state.encode(net, tp_size=2)
    assert module_state.encode(net, tp_size=1) is not None


def test_a_frozen_base_trains_under_bf16_at_every_stage_in_the_training_dtype():
    """bf16 (``"bf16": {"enabled": true}``): the frozen base is cast to bf16 with the
    parameters that train, as DeepSpeed's ``module.bfloat16()`` does (left in fp32, the
    first matmul of a bf16 input fails), at every stage; it stays the bf16 rounding of
    its initial value, and the stages' losses are one curve."""
    curves = {}
    for stage in (0, 2, 3):
        torch.manual_seed(0)
        net = Net()
        net.base.requires_grad_(False)
        want = net.base.weight.detach().to(torch.bfloat16)
        cfg = {"train_batch_size": 4, "bf16": {"enabled": True},
               "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
               "zero_optimization": {"stage": stage}}
        params = [p for p in net.parameters() if p.requires_grad]
        engine = deepspeed.initialize(model=net, model_parameters=params, config=cfg,
                                      mpu=ParallelState.single())[0]
        assert engine.module.base.weight.dtype == torch.bfloat16
        losses = []
        for step in range(3):
            g = torch.Generator().manual_seed(step)
            x, y = torch.randn(4, 6, generator=g), torch.randint(0, 3, (4,), generator=g)
            loss = nn.functional.cross_entropy(engine(x.bfloat16()).float(), y)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        assert torch.equal(engine.module.base.weight, want)
        curves[stage] = losses
    assert curves[0] == curves[2] == curves[3], curves
    assert curves[0][2] != curves[0][0]  # (the head trains)


def _offloaded(root: str, param: str) -> dict:
    """ZeRO-Infinity's ds_config keys: the optimizer on the host, the parameters on
    ``param`` (params.swp under ``root`` for nvme)."""
    where = {"device": param, **({"nvme_path": root} if param == "nvme" else {})}
    return {**PARTITIONED, "offload_optimizer": {"device": "cpu"}, "offload_param": where}


def _device_bytes(unit) -> int:
    return unit.shard.untyped_storage().nbytes() + unit.full.untyped_storage().nbytes()


def _offloaded_frozen_run(ps, root: str):
    """At DP 2, the frozen base partitioned and offloaded (hybrid/zero/offload/tiers.py,
    [Note: frozen units at home]): save on the host tier, load on the disk tier from
    another seed, and into a stage 3 engine without parameter offload; a plain stage 3
    save loads into an offloaded engine; a GatheredParameters write goes home."""
    engine = _engine(3, 0, mpu=ps, **_offloaded(root, "cpu"))
    (unit,) = engine.zero.frozen_units
    start = unit.shard_values().clone()
    _train(engine, range(2))
    engine.save_checkpoint(f"{root}/off")
    want = _train(engine, range(2, 4))
    out = {"held": _device_bytes(unit), "start": start, "want": want}
    for name, zero in (("nvme", _offloaded(f"{root}/swap", "nvme")), ("plain", PARTITIONED)):
        other = _engine(3, 1, mpu=ps, **zero)
        (back,) = other.zero.frozen_units
        other.load_checkpoint(f"{root}/off")
        out[name] = {"held": _device_bytes(back), "shard": back.shard_values().clone(),
                     "got": _train(other, range(2, 4))}
        if name == "plain":
            other.save_checkpoint(f"{root}/plain")
        other.close()
    # the other way: a save without parameter offload into an offloaded engine
    into = _engine(3, 1, mpu=ps, **_offloaded(f"{root}/swap2", "nvme"))
    (back,) = into.zero.frozen_units
    into.load_checkpoint(f"{root}/plain")
    out["into"] = {"shard": back.shard_values().clone(), "held": _device_bytes(back)}
    # rank 1 writes the frozen weight: every rank's home keeps its shard of it
    w = into.module.base.weight
    with deepspeed.zero.GatheredParameters([w], modifier_rank=1), torch.no_grad():
        w.fill_(0.5 if ps.dp_rank == 1 else -1.0)
    out["modified"] = (back.shard_values().clone(), _device_bytes(back), (back.own_lo, back.own_hi))
    into.close()
    return out


def test_an_offloaded_frozen_base_round_trips_on_the_host_and_disk_tiers(tmp_path):
    """ZeRO-Infinity at DP 2 with the frozen base partitioned and offloaded: the device
    holds none of its bytes after a load (each rank's shard of the file goes to its
    home); a resume on the disk tier from another seed continues the host tier's run bit
    for bit, a stage 3 engine without parameter offload the same way; its save loads
    back into an offloaded engine; a GatheredParameters(modifier_rank=1) write lands
    in the homes."""
    res = run_ranks(_offloaded_frozen_run, world_size=2, args=(str(tmp_path),))
    flat = torch.cat([res[0]["start"], res[1]["start"]])  # (the padded unit, in rank order)
    for rank, r in enumerate(res):
        assert r["held"] == 0, r["held"]
        mine = r["start"]
        for name in ("nvme", "plain"):
            assert r[name]["got"] == res[0]["want"] == r["want"], (rank, name, r[name]["got"])
            assert torch.equal(r[name]["shard"], mine), (rank, name)
        assert r["nvme"]["held"] == 0 and r["plain"]["held"] == mine.numel() * 4, r
        assert r["into"]["held"] == 0 and torch.equal(r["into"]["shard"], mine), rank
        shard, held, (lo, hi) = r["modified"]
        want = torch.cat([torch.full((48,), 0.5), flat[48:56]])[lo:hi]  # (the bias stays)
        assert held == 0 and torch.equal(shard, want), (rank, shard, want)
