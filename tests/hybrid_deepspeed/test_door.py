"""``import hybrid.deepspeed as deepspeed`` in one process (ParallelState.single(): no
collective needed): the engine's surface with DeepSpeed's types, the user's RNG left as
it was, the auto-resume idiom and string tags, the legacy config and the scheduler's own
lengths, and one error naming the call for what hybrid cannot honour yet."""

import argparse
import fcntl
import json
import math
import os

import pytest
import torch
from torch import nn

from hybrid import deepspeed
from hybrid.errors import CheckpointError, ConfigError
from hybrid.parallel.state import ParallelState
from tests.helpers.foreign_checkpoints import FOREIGN, write_foreign
from tests.hybrid_deepspeed.test_tutorials import Net  # the CIFAR tutorial's shape, tiny

DS = {"train_batch_size": 4, "gradient_accumulation_steps": 2,
      "optimizer": {"type": "Adam", "params": {"lr": 1e-2}}, "zero_optimization": True}


def _engine(config=None, **kw):
    torch.manual_seed(0)
    net = Net()
    return deepspeed.initialize(model=net, model_parameters=net.parameters(),
                                config=config or DS, mpu=ParallelState.single(), **kw)


def _train(engine, steps, seed=1):
    g = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps * engine.gradient_accumulation_steps()):
        x = torch.randn(engine.train_micro_batch_size_per_gpu(), 3, 2, 2, generator=g)
        y = torch.randint(0, 4, (engine.train_micro_batch_size_per_gpu(),), generator=g)
        loss = nn.functional.cross_entropy(engine(x.to(engine.device)), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def test_the_engine_surface_has_deepspeeds_names_and_types():
    engine, optimizer, loader, sched = _engine()
    assert optimizer is engine.optimizer and loader is None and sched is engine.lr_scheduler
    assert isinstance(engine, deepspeed.DeepSpeedEngine)
    for name, kind, value in (("device", torch.device, torch.device("cpu")),
                              ("local_rank", int, 0), ("global_rank", int, 0),
                              ("world_size", int, 1), ("dp_world_size", int, 1),
                              ("global_samples", int, 0), ("global_steps", int, 0)):
        got = getattr(engine, name)
        assert type(got) is kind and got == value, (name, got)
    for name, kind, value in (("train_micro_batch_size_per_gpu", int, 2),
                              ("gradient_accumulation_steps", int, 2),
                              ("train_batch_size", int, 4), ("zero_optimization_stage", int, 1),
                              ("fp16_enabled", bool, False), ("bfloat16_enabled", bool, False),
                              ("gradient_clipping", float, 1.0), ("was_step_applied", bool, False)):
        got = getattr(engine, name)()
        assert type(got) is kind and got == value, (name, got)
    assert engine.get_global_grad_norm() is None
    assert [id(p) for p in engine.parameters()] == [id(p) for p in engine.module.parameters()]
    groups = optimizer.param_groups  # one group of what was given, decayed as DeepSpeed's
    assert [len(g["params"]) for g in groups] == [4]
    assert [g["weight_decay"] for g in groups] == [0.0]  # FusedAdam's default, not torch's
    assert all(g["lr"] == 1e-2 and g["betas"] == (0.9, 0.999) for g in groups)
    assert optimizer.cur_scale == 1.0
    w = engine.module.fc1.weight.detach().clone()
    _train(engine, 2)
    assert not torch.equal(w, engine.module.fc1.weight)  # it trained
    assert (engine.global_steps, engine.global_samples, engine.micro_steps) == (2, 8, 4)
    norm = engine.get_global_grad_norm()
    assert type(norm) is float and norm > 0 and engine.was_step_applied() is True
    assert engine.get_lr() == [1e-2] and type(engine.get_lr()[0]) is float
    assert engine.training is True  # the module's attribute, as DeepSpeed's engine forwards


def test_the_accumulation_boundary_is_deepspeeds_between_backward_and_step():
    engine, *_ = _engine()
    seen = []
    g = torch.Generator().manual_seed(0)
    for _ in range(4):
        engine.backward(engine(torch.randn(2, 12, generator=g)).sum())
        seen.append(engine.is_gradient_accumulation_boundary())
        engine.step()
    assert seen == [False, True, False, True] and engine.global_steps == 2


def test_initialize_leaves_the_global_rng_as_it_found_it():
    """At stage 1, and at stage 3 from a model built under zero.Init (whose shards are
    drawn at initialize): the next draw is the one the user's seed gives."""
    for config, init in ((DS, False), ({**DS, "zero_optimization": {"stage": 3}}, True)):
        torch.manual_seed(42)
        with deepspeed.zero.Init(enabled=init):
            net = Net()
        state = torch.get_rng_state()
        expected = torch.rand(3)
        torch.set_rng_state(state)
        deepspeed.initialize(model=net, config=config, mpu=ParallelState.single())
        assert torch.equal(torch.get_rng_state(), state), config
        assert torch.equal(torch.rand(3), expected)


def test_load_on_an_empty_or_missing_directory_is_none_none(tmp_path):
    engine, *_ = _engine()
    assert engine.load_checkpoint(str(tmp_path)) == (None, None)
    assert engine.load_checkpoint(str(tmp_path / "never_saved")) == (None, None)
    with pytest.raises(CheckpointError, match="tag='best'.*no checkpoint of that tag"):
        engine.load_checkpoint(str(tmp_path), tag="best")


@pytest.mark.parametrize("fmt", FOREIGN)
def test_load_on_another_framework_s_checkpoint_is_refused_by_name(tmp_path, fmt):
    """Not (None, None), which would train from the initial weights as if resumed."""
    write_foreign(tmp_path, FOREIGN[fmt])
    engine, *_ = _engine()
    with pytest.raises(CheckpointError) as e:
        engine.load_checkpoint(str(tmp_path))
    said = str(e.value)
    # each is read for real now (the peer import): the empty file met first is named
    shown = {"DeepSpeed": ("global_step4/mp_rank_00_model_states.pt", "empty file"),
             "Megatron-LM": ("iter_0000010/mp_rank_00/model_optim_rng.pt", "truncated"),
             "Megatron-LM torch_dist": ("iter_0000010/metadata.json", "version"),
             "torch.distributed.checkpoint (DCP)": (".metadata", "not a readable DCP")}
    path, why = shown[fmt]
    assert said.startswith(f"{tmp_path}/{path}: ") and why in said, said
    assert engine.global_steps == 0
    assert not any(n.startswith("hybrid_import") and os.listdir(tmp_path / n)
                   for n in os.listdir(tmp_path)), os.listdir(tmp_path)  # nothing imported


def test_a_string_tag_round_trips_and_latest_names_it(tmp_path):
    save = str(tmp_path)
    engine, *_ = _engine()
    _train(engine, 2)
    path = engine.save_checkpoint(save, tag="best", client_state={"epoch": 3})
    assert (tmp_path / "latest").read_text() == "best" and path.startswith(save + "/best/")
    saved = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    more = _train(engine, 2, seed=7)
    for tag in ("best", None):  # by name, and by latest
        fresh, *_ = _engine()
        got_path, client = fresh.load_checkpoint(save, tag=tag)
        assert got_path == path and client == {"epoch": 3}
        assert fresh.global_steps == 2 and fresh.global_samples == 8
        for n, p in fresh.module.named_parameters():
            assert torch.equal(p, saved[n]), n
        assert _train(fresh, 2, seed=7) == more  # the same run on from there
    engine.save_checkpoint(save)  # untagged: hybrid's iter_ name, and latest follows it
    assert (tmp_path / "latest").read_text() == "iter_0000004"
    fresh, *_ = _engine()
    assert fresh.load_checkpoint(save)[0] == save + "/iter_0000004"
    assert fresh.load_checkpoint(save, tag="global_step4")[0] == save + "/iter_0000004"
    assert fresh.load_checkpoint(save, tag="best")[0] == path
    fresh.save_checkpoint(save, tag=2.5, save_latest=False)  # a float (a loss) as a tag
    assert (tmp_path / "2.5").is_dir() and (tmp_path / "latest").read_text() == "iter_0000004"
    for bad in ("../x", "latest", "iter_3", ""):
        with pytest.raises(ValueError, match="a tag names one directory"):
            fresh.save_checkpoint(save, tag=bad)


def test_save_checkpoint_claims_its_directory_as_pretrain_gpt_does(tmp_path):
    """One owner per save directory through the API too: another run's checkpoints are
    refused (and kept) unless this engine resumed from them or overwrite=True; a
    directory a live job holds is refused, naming it."""
    save = str(tmp_path / "run")
    first, *_ = _engine()
    _train(first, 2)
    first.save_checkpoint(save)
    first.close()
    kept = (tmp_path / "run" / "iter_0000002" / "metadata.json").read_bytes()
    other, *_ = deepspeed.initialize(model=nn.Linear(3, 2), config=DS,
                                     mpu=ParallelState.single())  # another run, another model
    with pytest.raises(CheckpointError) as e:
        other.save_checkpoint(save)
    said = str(e.value)
    assert said.startswith(f"save_checkpoint({save!r}) already holds checkpoints of another run "
                           f"(iter_0000002, a run of host "), said
    numel = sum(p.numel() for p in Net().parameters())
    assert f"a different model: parameters {numel} there, 8 here, tensors 4 there, 2 here" \
        in said, said
    assert said.endswith(f"to continue that run call load_checkpoint({save!r}) before saving; "
                         f"to start over save to a new directory or pass save_checkpoint(..., "
                         f"overwrite=True) (which deletes them)"), said
    assert (tmp_path / "run" / "iter_0000002" / "metadata.json").read_bytes() == kept
    assert (tmp_path / "run" / "latest").read_text() == "iter_0000002"
    # resuming from it is allowed, and so is overwriting it when asked
    resumed, *_ = _engine()
    resumed.load_checkpoint(save)
    _train(resumed, 1)
    assert resumed.save_checkpoint(save).endswith("iter_0000003")
    # one claim held at a time (a Trainer's checkpoint-N directories): back in a directory
    # it let go and did not load from, the engine's own checkpoints there are its own
    elsewhere = str(tmp_path / "elsewhere")
    resumed.save_checkpoint(elsewhere)
    assert (tmp_path / "run" / ".lock").read_text() == ""  # let go
    _train(resumed, 1)
    resumed.save_checkpoint(save)
    assert (tmp_path / "elsewhere" / ".lock").read_text() == ""
    _train(resumed, 1)
    assert resumed.save_checkpoint(elsewhere).endswith("iter_0000005")
    resumed.close()
    other.save_checkpoint(save, overwrite=True)
    assert sorted(p.name for p in (tmp_path / "run").glob("iter_*")) == ["iter_0000000"]
    other.close()
    # a directory another job holds: its lock taken by another open file (another process's)
    held = tmp_path / "held"
    held.mkdir()
    fd = os.open(held / ".lock", os.O_RDWR | os.O_CREAT)
    try:
        os.write(fd, b'{"host": "node7", "pid": 4242, "started": 0}')
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        engine, *_ = _engine()
        with pytest.raises(CheckpointError, match=r"is in use by another job \(host node7, pid "
                                                  r"4242, started .*\): two jobs saving there"):
            engine.save_checkpoint(str(held))
        assert sorted(p.name for p in held.iterdir()) == [".lock"]
    finally:
        os.close(fd)


def test_legacy_zero_switch_and_the_schedulers_own_lengths():
    assert _engine({**DS, "zero_optimization": True})[0].zero_optimization_stage() == 1
    assert _engine({**DS, "zero_optimization": False})[0].zero_optimization_stage() == 0
    # the CIFAR tutorial's WarmupLR: 1000 steps, no longer capped by a default 200
    engine, _, _, sched = _engine({**DS, "scheduler": {"type": "WarmupLR", "params": {
        "warmup_min_lr": 0, "warmup_max_lr": 1e-3, "warmup_num_steps": 1000}}})
    assert (sched.sched.warmup, sched.sched.decay) == (1000, 1000)
    _train(engine, 3)  # the next step is the 4th: DeepSpeed's i = 2 (lr_schedule.deepspeed_lr)
    assert engine.get_lr()[0] == pytest.approx(1e-3 * math.log(3) / math.log(1000))
    assert sched.get_last_lr() == engine.get_lr()  # the next step's rate, as DeepSpeed's
    assert sched.lr_at(5000) == [1e-3]  # constant after the warmup
    # DeepSpeed's own default warmup, and WarmupDecayLR's lengths from its keys
    sched = _engine({**DS, "scheduler": {"type": "WarmupLR"}})[3]
    assert (sched.sched.warmup, sched.sched.decay) == (1000, 1000)
    sched = _engine({**DS, "scheduler": {"type": "WarmupDecayLR", "params": {
        "warmup_num_steps": 500, "total_num_steps": 5000}}})[3]
    assert (sched.sched.warmup, sched.sched.decay) == (500, 5000)


def test_add_config_arguments_and_args_deepspeed_config(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({**DS, "zero_optimization": {"stage": 2}}))
    parser = deepspeed.add_config_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", str(path)])
    assert args.deepspeed is True and args.deepscale is False
    torch.manual_seed(0)
    engine, *_ = deepspeed.initialize(args=args, model=Net(), mpu=ParallelState.single())
    assert engine.zero_optimization_stage() == 2
    engine, *_ = deepspeed.initialize(model=Net(), config_params=str(path),
                                      mpu=ParallelState.single())
    assert engine.zero_optimization_stage() == 2
    with pytest.raises(ConfigError, match=r"two configs \(config and args.deepspeed_config\)"):
        deepspeed.initialize(args=args, model=Net(), config=DS, mpu=ParallelState.single())


def test_training_data_gives_this_ranks_share_in_micro_batches():
    data = torch.utils.data.TensorDataset(torch.arange(10.0).reshape(10, 1).repeat(1, 12))
    engine, _, loader, _ = _engine(training_data=data)
    assert loader is engine.training_dataloader and len(loader) == 5
    order = torch.randperm(10, generator=torch.Generator().manual_seed(0))  # sampler seed 0
    got = [b[0][:, 0].long() for b in loader]
    assert torch.equal(torch.cat(got), order) and all(len(b) == 2 for b in got)
    assert torch.equal(torch.cat([b[0][:, 0].long() for b in loader]), order)  # every epoch


class _Blocks(nn.Module):
    def __init__(self, ckpt):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(2))
        self.ckpt = ckpt

    def forward(self, x):
        for b in self.blocks:
            x = deepspeed.checkpointing.checkpoint(b, x) if self.ckpt else b(x)
        return x.sum()


def test_checkpointing_recomputes_the_same_gradients():
    deepspeed.checkpointing.configure(None, partition_activations=False)
    assert deepspeed.checkpointing.is_configured()
    grads = []
    for ckpt in (False, True):
        torch.manual_seed(0)
        m = _Blocks(ckpt)
        m(torch.randn(3, 8)).backward()
        grads.append([p.grad for p in m.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))
    with pytest.raises(ConfigError, match="partition_activations is hybrid's ZeRO-R"):
        deepspeed.checkpointing.configure(None, partition_activations=True)
    with pytest.raises(ConfigError, match="cpu_checkpointing is hybrid's ZeRO-R"):
        deepspeed.checkpointing.configure(
            None, deepspeed_config={"activation_checkpointing": {"cpu_checkpointing": True}})


def test_accelerator_and_comm_in_one_process():
    acc = deepspeed.accelerator.get_accelerator()
    assert acc is deepspeed.accelerator.get_accelerator()
    assert (acc.device_name(), acc.current_device_name(), acc.current_device()) == ("cpu", "cpu", 0)
    assert acc.device_count() == 1 and acc.communication_backend_name() == "gloo"
    assert acc.is_bf16_supported() is True and acc.is_fp16_supported() is True
    assert type(acc.memory_allocated()) is int and acc.memory_allocated() > 0
    acc.synchronize()
    acc.manual_seed(3)
    assert torch.equal(torch.rand(2), (torch.manual_seed(3), torch.rand(2))[1])
    comm = deepspeed.comm
    assert (comm.get_rank(), comm.get_world_size(), comm.get_local_rank()) == (0, 1, 0)
    t = torch.ones(3)
    comm.all_reduce(t)
    comm.barrier()
    out = [torch.zeros(3)]
    comm.all_gather(out, t)
    assert torch.equal(t, torch.ones(3)) and torch.equal(out[0], t)
    assert comm.ReduceOp.SUM is torch.distributed.ReduceOp.SUM


@pytest.mark.parametrize("make,message", [  # make: initialize's arguments for a fresh Net
    (lambda n: dict(model=n, mpu=object()),
     r"deepspeed.initialize\(mpu=...\): hybrid takes its layout as a ParallelState"),
    (lambda n: dict(model=n, model_parameters=[n.fc1.weight]),
     r"model_parameters=...\): parameter fc1.bias requires grad but is not given: pass it, or "
     r"freeze it"),
    (lambda n: dict(model=n, optimizer=torch.optim.SGD(
        [n.fc1.weight, n.fc2.weight, n.fc2.bias], lr=0.1)),
     r"optimizer=...\): parameter fc1.bias requires grad but is in none of the optimizer's "
     r"param_groups"),
    (lambda n: dict(model=n, optimizer=torch.optim.SGD(
        list(n.parameters()) + [nn.Parameter(torch.zeros(3))], lr=0.1)),
     r"param_groups\[0\] holds a tensor of shape \(3,\) that is not a parameter of the model"),
    (lambda n: dict(model=n, lr_scheduler=torch.optim.lr_scheduler.StepLR(
        torch.optim.SGD(n.parameters(), lr=0.1), 1)),
     r"lr_scheduler=...\): the scheduler drives an optimizer initialize was not given"),
])
def test_what_hybrid_cannot_honour_is_one_error_naming_the_call(make, message):
    kwargs = make(Net())
    kwargs.setdefault("mpu", ParallelState.single())
    with pytest.raises(ConfigError, match=message):
        deepspeed.initialize(config=DS, **kwargs)


def test_two_backwards_before_a_step_with_the_optimizer_offloaded_are_refused():
    engine, *_ = _engine({**DS, "zero_optimization": {
        "stage": 2, "offload_optimizer": {"device": "cpu"}}})
    engine.backward(engine(torch.randn(2, 12)).sum())
    with pytest.raises(ConfigError, match=r"a second engine.backward\(\) before "
                                          r"engine.step\(\) with the optimizer offloaded"):
        engine.backward(engine(torch.randn(2, 12)).sum())


def test_misuse_and_missing_names_say_what_to_do_instead():
    engine, optimizer, *_ = _engine()
    with pytest.raises(ConfigError, match=r"engine.step\(\) without a backward since the last "
                                          r"step: call engine.backward\(loss\), or "
                                          r"loss.backward\(\) of a loss computed from the "
                                          r"engine's outputs"):
        engine.step()
    engine.module(torch.randn(2, 12)).sum().backward()  # past the engine: it cannot know
    with pytest.raises(ConfigError, match="without a backward since the last step"):
        engine.step()
    engine.backward(engine(torch.randn(2, 12)).sum())
    engine.backward(engine(torch.randn(2, 12)).sum())  # a second adds (DeepSpeed's GAN does)
    engine.step()
    engine.backward(engine(torch.randn(2, 12)).sum())  # (the window's second micro-batch)
    engine.step()
    engine(torch.randn(2, 12)).sum().backward()  # a plain backward, then the engine's
    with pytest.raises(ConfigError, match=r"engine.backward\(\) after a plain "
                                          r"loss.backward\(\) without engine.step"):
        engine.backward(engine(torch.randn(2, 12)).sum())
    engine.step()
    engine(torch.randn(2, 12)).sum().backward()  # (the plain window's second)
    engine.step()
    engine.backward(engine(torch.randn(2, 12)).sum())
    engine.step()
    engine.backward(engine(torch.randn(2, 12)).sum())  # (the next boundary)
    optimizer.param_groups[0]["weight_decay"] = 0.5  # hybrid's AdamW: refused, not ignored
    with pytest.raises(ConfigError, match=r"param_groups\[0\]\['weight_decay'\] was set to "
                                          r"0.5 .*pass a torch optimizer"):
        engine.step()
    with pytest.raises(ConfigError, match=r"call engine.step\(\)"):
        optimizer.step()
    with pytest.raises(AttributeError, match="hybrid's engine has no set_train_batch_size yet"):
        engine.set_train_batch_size(8)
    with pytest.raises(AttributeError, match="nor has its module Net"):
        engine.no_such_thing  # noqa: B018
    with pytest.raises(AttributeError, match="hybrid.deepspeed has no 'init_inference'"):
        deepspeed.init_inference  # noqa: B018
    with pytest.raises(AttributeError, match="hybrid.deepspeed.zero has no 'TiledLinear'"):
        deepspeed.zero.TiledLinear  # noqa: B018
    with pytest.raises(ConfigError, match=r"zero.Init\(module=...\)"):
        deepspeed.zero.Init(module=Net())
    assert deepspeed.zero is not __import__("hybrid.zero").zero  # DeepSpeed's names, not the engine


def test_a_plain_backward_under_fp16_needs_the_loss_scaled():
    engine, *_ = _engine({**DS, "gradient_accumulation_steps": 1, "train_batch_size": 2,
                          "fp16": {"enabled": True, "initial_scale_power": 4}})
    x = torch.randn(2, 12).half()
    engine(x).float().sum().backward()
    with pytest.raises(ConfigError, match=r"a plain loss.backward\(\) under fp16: the loss must "
                                          r"be scaled first; call engine.scale\(loss\).backward"):
        engine.step()
    w = engine.module.fc1.weight.detach().clone()
    engine.scale(engine(x).float().sum()).backward()
    engine.step()
    assert engine.was_step_applied() and not torch.equal(w, engine.module.fc1.weight)


def test_a_client_optimizer_state_a_checkpoint_cannot_hold_is_refused_at_the_save(tmp_path):
    net = Net()
    engine, *_ = deepspeed.initialize(model=net, optimizer=torch.optim.NAdam(net.parameters()),
                                      config=DS, mpu=ParallelState.single())
    _train(engine, 2)
    with pytest.raises(ConfigError, match="the optimizer keeps mu_product per parameter, which "
                                          "hybrid's checkpoints do not hold"):
        engine.save_checkpoint(str(tmp_path))
    assert [p.name for p in tmp_path.iterdir()] == [".lock"]  # nothing but the engine's claim
