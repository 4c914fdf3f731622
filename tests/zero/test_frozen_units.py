"""Stage 3 partitions frozen parameters too (hybrid/zero/units.py, [Note: frozen units]):
each rank holds 1/DP of a frozen base outside forward and backward, the training equals
the one-process reference, the frozen values never move, and a frozen unit is released
after its module's backward, not only at its end."""

import torch

from hybrid.parallel.state import ParallelState
from hybrid.recompute.checkpointing import apply_activation_checkpointing
from hybrid.tensor_parallel import InitValues
from hybrid.zero.flat_unit import ParamState
from hybrid.zero.offload.nvme.homes import disk_slots
from tests.helpers.harness import run_ranks
from tests.helpers.zero_reference import (
    BUCKETS,
    _gpt,
    _named_params,
    _train_cfg,
    _train_reference,
    _train_steps,
    zero_engine,
)

STEPS = 2

# the frozen part: a root parameter (the position embedding), the MLP of block 0 (beside
# its trainable attention: a frozen unit with trainable companions), block 1 whole (a
# frozen unit alone in its module, through which block 0's gradients flow)
FROZEN = ("wpe.", "blocks.0.mlp.", "blocks.1.")


def _freeze(model):
    for n, p in model.named_parameters():
        if n.startswith(FROZEN):
            p.requires_grad_(False)


def _frozen_bytes(model, engine):
    """Bytes this rank holds for the frozen parameters now: the storages of the frozen
    parameters (a partitioned one's is its unit's full buffer, freed outside a gather)
    and the frozen units' shards, each storage counted once."""
    seen, total = set(), 0
    tensors = [p for p in model.parameters() if not p.requires_grad]
    tensors += [u.shard for u in engine.frozen_units]
    for t in tensors:
        s = t.untyped_storage()
        if s.data_ptr() not in seen or s.nbytes() == 0:
            seen.add(s.data_ptr())
            total += s.nbytes()
    return total


def _train_frozen(ps, recompute):
    cfg = _train_cfg(ps.world_size, 1, zero_stage=3, **BUCKETS,
                     **({"recompute_granularity": "full"} if recompute else {}))
    model = _gpt(cfg, ps, device="meta")
    _freeze(model)
    phase = None
    if recompute:
        phase = apply_activation_checkpointing(model, ps, model.rng, cfg.recompute).phase
    engine = zero_engine(model, ps, cfg, values=InitValues(cfg.seed, model.init_of),
                         recompute=phase)
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    in_units = {id(p) for u in engine.units for p in u.params}
    assert not any(id(p) in in_units for n, p in model.named_parameters() if n in frozen)
    assert sorted(u.name for u in engine.frozen_units) == ["frozen0", "frozen1", "frozen_root"]
    start = _named_params(model, engine)
    before = _frozen_bytes(model, engine)
    # Where backward reaches the embedding (its last gradient), both blocks' frozen units
    # have been released again ([Note: releasing a frozen unit])
    states = []
    model.wte.weight.register_post_accumulate_grad_hook(
        lambda p: states.append({u.name: u.state for u in engine.frozen_units}))
    losses, norms = _train_steps(model, engine, ps, cfg, STEPS)
    after = _frozen_bytes(model, engine)
    gathered = {u.name: u.state for u in engine.frozen_units}
    return {"losses": losses, "norms": norms, "params": _named_params(model, engine),
            "start": start, "frozen": frozen, "bytes": (before, after),
            "whole": sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                         if n in frozen),
            "padded": sum(u.padded * 4 for u in engine.frozen_units),
            "at_embedding": states, "after_step": gathered,
            "state": engine.model_state_bytes(),
            "owned": sum(u.own_hi - u.own_lo for u in engine.units)}


def test_frozen_parameters_are_partitioned_and_train_like_one_process():
    """ZeRO 3 at DP 2, with and without recompute: the losses, clipped norms and trained
    parameters equal the one-process reference's (the frozen ones get no gradient there
    either); the frozen values are bit for bit the initial ones; outside forward and
    backward each rank holds half the frozen bytes (its shard of each padded unit); and
    when backward reaches the embedding, both blocks' frozen units are free again."""
    cfg = _train_cfg(1, 1)
    ref_model = _gpt(cfg, ParallelState.single())
    _freeze(ref_model)
    ref = _train_reference(ref_model, cfg, STEPS)
    res = run_ranks(_train_frozen_both, world_size=2, tp=1)
    for recompute, got in enumerate(res[0]):
        what = f"recompute={bool(recompute)}"
        for a, b in zip(got["losses"], ref["losses"]):
            assert abs(a - b) <= 1e-5 * abs(b), f"{what}: loss {a} vs {b}"
        for a, b in zip(got["norms"], ref["norms"]):
            assert abs(a - b) <= 1e-5 * abs(b), f"{what}: grad norm {a} vs {b}"
        for name, want in ref["params"].items():
            torch.testing.assert_close(got["params"][name], want, rtol=1e-5, atol=1e-6,
                                       msg=lambda m, name=name, what=what: f"{what}: {name}: {m}")
            if name in got["frozen"]:
                assert torch.equal(got["params"][name], got["start"][name]), (what, name)
            else:  # (the trainable ones did move)
                assert not torch.equal(got["params"][name], got["start"][name]), (what, name)
        for rank in range(2):
            r = res[rank][recompute]
            before, after = r["bytes"]
            # each rank: its half of every padded frozen unit, nothing whole
            assert before == after == r["padded"] // 2, (what, rank, r["bytes"], r["whole"])
            assert r["padded"] - r["whole"] < 4 * 2 * 3, (what, r["padded"], r["whole"])
            assert all(s is ParamState.SHARDED for s in r["after_step"].values()), r
            # no gradient, moment or master for a frozen element: fp32 gradient shard and
            # two moments (the fp32 shard is its own master) of the trainable ones only
            assert r["state"]["grads"] == 4 * r["owned"], (what, r["state"])
            assert r["state"]["optimizer"] == 8 * r["owned"], (what, r["state"])
            for seen in r["at_embedding"]:  # (one per micro-batch)
                assert seen["frozen0"] is seen["frozen1"] is ParamState.SHARDED, (what, seen)
                assert seen["frozen_root"] is ParamState.GATHERED, (what, seen)


def _train_frozen_both(ps):
    return [_train_frozen(ps, False), _train_frozen(ps, True)]


def test_a_frozen_base_is_one_eighth_per_rank_at_dp8_under_the_fake_process_group():
    """DP 8 through torch's fake process group (rank 3 of 8; no peers: the gathers
    return at once, so only the bytes mean something): a GPT whose blocks are all frozen
    (a LoRA base) holds 1/8 of the frozen bytes after construction and again after a
    forward and backward, every frozen unit released."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=3, world_size=8)
    try:
        ps = ParallelState.build(1)
        cfg = _train_cfg(8, 1, zero_stage=3, num_layers=4, hidden_size=64,
                         global_batch_size=16)
        model = _gpt(cfg, ps, device="meta")
        for n, p in model.named_parameters():
            if n.startswith("blocks."):
                p.requires_grad_(False)
        whole = sum(p.numel() * 4 for p in model.parameters() if not p.requires_grad)
        engine = zero_engine(model, ps, cfg, values=InitValues(cfg.seed, model.init_of))
        assert len(engine.frozen_units) == 4
        padded = sum(u.padded * 4 for u in engine.frozen_units)
        assert whole <= padded < whole + 4 * 8 * 4
        assert _frozen_bytes(model, engine) == padded // 8  # 99,968 of 799,744 bytes
        x = torch.randint(0, 257, (2, 16))
        engine.backward(model(x, x))
        assert _frozen_bytes(model, engine) == padded // 8
        assert all(u.state is ParamState.SHARDED for u in engine.frozen_units)
        ps.close()
    finally:
        dist.destroy_process_group()


class _Block(torch.nn.Module):
    """A LoRA-like block: a frozen base weight beside a trainable low-rank path."""

    def __init__(self):
        super().__init__()
        self.base = torch.nn.Linear(8, 8)
        self.a = torch.nn.Linear(8, 2, bias=False)
        self.b = torch.nn.Linear(2, 8, bias=False)

    def forward(self, *, hidden):
        return hidden + torch.tanh(self.base(hidden) + self.b(self.a(hidden)))


class _Adapted(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(4, 8)
        self.blocks = torch.nn.ModuleList([_Block() for _ in range(3)])

    def forward(self, x):
        h = self.inp(x)
        for blk in self.blocks:
            h = blk(hidden=h)  # (by keyword, as transformers' layers are called)
        return h.square().mean()


def test_a_block_called_by_keyword_frees_its_frozen_unit_after_its_backward():
    """The hidden states reach a block by keyword: its frozen unit is still released
    once their gradient is complete (before backward reaches the first layer), the
    adapter's gradients equal plain torch's and the base stays as it was."""
    from hybrid.config.sections import ZeroConfig
    from hybrid.zero import apply_zero

    torch.manual_seed(0)
    model = _Adapted()
    for blk in model.blocks:
        blk.base.requires_grad_(False)
    ref = _Adapted()
    ref.load_state_dict(model.state_dict())
    for blk in ref.blocks:
        blk.base.requires_grad_(False)
    x = torch.randn(5, 4)
    ref(x).backward()
    engine = apply_zero(model, ParallelState.single(),
                        ZeroConfig(stage=3, param_persistence_threshold=0))
    assert [u.name for u in engine.frozen_units] == ["frozen0", "frozen1", "frozen2"]
    seen = []
    model.inp.weight.register_post_accumulate_grad_hook(
        lambda p: seen.append([u.state for u in engine.frozen_units]))
    engine.backward(model(x))
    assert seen == [[ParamState.SHARDED] * 3]
    with engine.gathered():
        for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
            if not p.requires_grad:
                assert torch.equal(p, q), n
    for pc in engine.owned_pieces():  # (one rank: the reduced gradient is plain torch's)
        want = dict(ref.named_parameters())[pc.name].grad.reshape(-1)[pc.lo: pc.hi]
        torch.testing.assert_close(engine.grad_values(pc), want, msg=pc.name)


def test_frozen_units_are_held_for_a_pipeline_step_and_freed_with_their_part():
    """Inside ``params_held`` (a pipeline step) a frozen unit stays gathered after its
    backward, like a trainable one, and ``release_params`` of the model's one part frees
    it ([Note: held for a pipeline step])."""
    from hybrid.config.sections import ZeroConfig
    from hybrid.zero import apply_zero

    torch.manual_seed(0)
    model = _Adapted()
    for blk in model.blocks:
        blk.base.requires_grad_(False)
    engine = apply_zero(model, ParallelState.single(),
                        ZeroConfig(stage=3, param_persistence_threshold=0))
    with engine.params_held():
        engine.backward(model(torch.randn(5, 4)))
        assert all(u.state is ParamState.GATHERED for u in engine.frozen_units)
        engine.release_params(0)
        assert all(u.state is ParamState.SHARDED for u in engine.frozen_units)
        assert all(u.state is ParamState.SHARDED for u in engine.units if u.partition_params)


def _device_frozen_bytes(engine):
    """Device bytes of the frozen units now: their shards' and full buffers' storages."""
    return sum(u.shard.untyped_storage().nbytes() + u.full.untyped_storage().nbytes()
               for u in engine.frozen_units)


def _train_frozen_offloaded(ps, root):
    """Stage 3 with the optimizer on the host, the parameters on the device, in host
    memory and in params.swp: the frozen units' bytes where they live, and the curve."""
    return {param: _one_offloaded(ps, root, param) for param in (None, "cpu", "nvme")}


def _one_offloaded(ps, root, param):
    """One run of :func:`_train_frozen_offloaded`, ``param``: the --offload-param tier."""
    nvme = {"offload_nvme_path": f"{root}/{param}"} if param == "nvme" else {}
    cfg = _train_cfg(ps.world_size, 1, zero_stage=3, **BUCKETS, offload_optimizer="cpu",
                     offload_param=param, **nvme)
    model = _gpt(cfg, ps, device="meta")
    _freeze(model)
    engine = zero_engine(model, ps, cfg, values=InitValues(cfg.seed, model.init_of))
    start = _named_params(model, engine)
    before = _device_frozen_bytes(engine)
    ahead = []  # per load of a frozen unit's home: was its read already under way?
    for h in engine.tiers.homes(engine.frozen_units) if param == "nvme" else ():
        def load_into(shard, h=h, load=h.load_into):
            ahead.append(h._read is not None)
            load(shard)
        h.load_into = load_into
    during = []  # (block 1 is frozen whole: its unit is gathered while it runs)
    model.blocks[1].register_forward_pre_hook(  # (after the gatherer's)
        lambda *_: during.append(_device_frozen_bytes(engine)))
    losses, norms = _train_steps(model, engine, ps, cfg, STEPS)
    homes = engine.tiers.homes(engine.frozen_units)
    out = {
        "losses": losses, "norms": norms, "params": _named_params(model, engine),
        "start": start, "bytes": (before, _device_frozen_bytes(engine)),
        "during": during, "padded": sum(u.padded for u in engine.frozen_units) * 4,
        "largest": max(u.padded for u in engine.frozen_units) * 4,
        "homes": [type(h).__name__ for h in homes], "ahead": ahead,
        "host": sum(h.host_bytes() for h in homes if h is not None),
        "disk": engine.model_state_bytes()["disk"],
        "slots": [disk_slots([u.shard_size for u in us], 4)[1] for us in (
            [u for u in engine.units if u.partition_params], engine.frozen_units)],
        "shards": [u.shard_values().clone() for u in engine.frozen_units],
        "owned": sum(u.own_hi - u.own_lo for u in engine.units),
        "optimizer": engine.optimizer.state_bytes()}
    engine.close()
    return out


def test_offloaded_frozen_units_live_in_the_parameter_homes_and_train_the_same_curve(
        tmp_path):
    """ZeRO-Infinity on a frozen base ([Note: frozen units at home] in
    hybrid/zero/offload/tiers.py), DP 2, the optimizer on the host: with --offload-param
    cpu and nvme the frozen units' shards are in host memory / params.swp, the device
    holds none of their bytes outside forward and backward (half of each padded unit
    without parameter offload; a whole unit while it runs), and the curve is the one of
    the run without parameter offload bit for bit (the one-process reference's within
    the tolerance above); the frozen values never move; the optimizer's state is the
    trainable elements' only."""
    cfg = _train_cfg(1, 1)
    ref_model = _gpt(cfg, ParallelState.single())
    _freeze(ref_model)
    ref = _train_reference(ref_model, cfg, STEPS)
    res = run_ranks(_train_frozen_offloaded, world_size=2, tp=1, args=(str(tmp_path),))
    for rank, by_tier in enumerate(res):
        plain = by_tier[None]
        half = plain["padded"] // 2
        assert plain["bytes"] == (half, half), plain["bytes"]
        assert plain["homes"] == ["NoneType"] * 3  # (no home: on the device)
        for tier, home in (("cpu", "HostHome"), ("nvme", "DiskHome")):
            got, what = by_tier[tier], f"rank {rank} {tier}"
            assert got["bytes"] == (0, 0), (what, got["bytes"])
            assert got["homes"] == [home] * 3, (what, got["homes"])
            # (the largest frozen unit, block 1's, is gathered whole while it runs)
            assert len(got["during"]) == 4 and all(b >= got["largest"] for b in got["during"]), \
                (what, got["during"], got["largest"])
            assert got["host"] == (half if tier == "cpu" else 0), (what, got["host"])
            assert got["losses"] == plain["losses"] and got["norms"] == plain["norms"], what
            for name, want in plain["params"].items():
                assert torch.equal(got["params"][name], want), (what, name)
                if name.startswith(FROZEN):
                    assert torch.equal(got["params"][name], got["start"][name]), (what, name)
            for a, b in zip(got["shards"], plain["shards"]):
                assert torch.equal(a, b), what
            assert got["optimizer"] == plain["optimizer"] == 8 * got["owned"], what  # (moments)
        # the gatherer's read ahead reaches the frozen units' slots too
        assert any(by_tier["nvme"]["ahead"]), by_tier["nvme"]["ahead"]
        # params.swp holds the frozen units' slots as well as the trainable ones'
        nvme = by_tier["nvme"]
        assert nvme["disk"] == sum(nvme["slots"]) and nvme["slots"][1] >= half, nvme["slots"]
    for a, b in zip(res[0][None]["losses"], ref["losses"]):
        assert abs(a - b) <= 1e-5 * abs(b), (a, b)
