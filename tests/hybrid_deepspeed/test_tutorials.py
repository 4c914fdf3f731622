"""DeepSpeed scripts' inner loops, written the way DeepSpeed's tutorials write them, with
``import hybrid.deepspeed as deepspeed`` the only change, at 2 ranks (DP 2): the
getting-started tutorial (``--deepspeed_config`` through ``add_config_arguments``, the
legacy ``"zero_optimization": true``, fp16, a save tagged with the rank's own
``loss.item()``), the CIFAR-10 tutorial (``training_data=``, a ``requires_grad``
filter, WarmupLR over 1000 steps, stage 2) and HelloDeepSpeed (dict batches,
``engine.device``, the auto-resume idiom) in the ZeRO-3 tutorial's form
(``zero.Init``, ``checkpointing.checkpoint``, optimizer offload). Each trains: its
parameters change, and its losses are ``hybrid.initialize``'s on the same
initialization and data, micro-batch for micro-batch; a resume continues the run
exactly; initialize leaves the rank's RNG as it was."""

import argparse
import json
import math
import os

import torch
from torch import nn

from tests.helpers.harness import run_ranks

# -- the getting-started tutorial --------------------------------------------------------
GETTING_STARTED = {"train_batch_size": 8, "gradient_accumulation_steps": 1,
                   "optimizer": {"type": "Adam", "params": {"lr": 0.00015}},
                   "fp16": {"enabled": True}, "zero_optimization": True}


class Net(nn.Module):
    """The CIFAR tutorial's shape, tiny: a flattened image through two layers."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(12, 16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x.flatten(1))))


def _batches(n, rank, micro, seed):
    """This rank's ``n`` micro-batches (x, y), the same whichever door trains on them."""
    g = torch.Generator().manual_seed(seed + rank)
    return [(torch.randn(micro, 3, 2, 2, generator=g), torch.randint(0, 4, (micro,), generator=g))
            for _ in range(n)]


def _net():
    torch.manual_seed(0)
    return Net()


def _loop(engine, batches):
    """The tutorials' inner loop."""
    losses = []
    for x, y in batches:
        dtype = torch.half if engine.fp16_enabled() else torch.float32
        outputs = engine(x.to(engine.device, dtype=dtype))
        loss = nn.functional.cross_entropy(outputs.float(), y.to(engine.device))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses, loss


def _getting_started(ps, tmp):
    import hybrid
    from hybrid import deepspeed
    path = os.path.join(tmp, "ds_config.json")
    if ps.rank == 0:
        with open(path, "w") as f:
            json.dump(GETTING_STARTED, f)
    deepspeed.comm.barrier()
    parser = argparse.ArgumentParser(description="My training script.")
    parser.add_argument("--local_rank", type=int, default=-1)
    parser = deepspeed.add_config_arguments(parser)
    cmd_args = parser.parse_args(["--deepspeed", "--deepspeed_config", path])
    model = _net()
    before_rng = torch.get_rng_state()
    model_engine, optimizer, _, _ = deepspeed.initialize(
        args=cmd_args, model=model, model_parameters=model.parameters(), mpu=ps)
    rng_kept = torch.equal(before_rng, torch.get_rng_state())
    w0 = model.fc1.weight.detach().float().clone()
    batches = _batches(5, ps.dp_rank, model_engine.train_micro_batch_size_per_gpu(), 10)
    losses, loss = _loop(model_engine, batches[:3])
    client_sd = {"step": 3}
    ckpt_id = loss.item()  # each rank's own loss: rank 0's names the save
    saved = model_engine.save_checkpoint(tmp + "/gs", ckpt_id, client_state=client_sd)
    continued, _ = _loop(model_engine, batches[3:])
    changed = not torch.equal(w0, model.fc1.weight.detach().float())
    # the same run through hybrid.initialize
    ref, *_ = hybrid.initialize(model=_net(), config=GETTING_STARTED, parallel_state=ps)
    ref_losses, _ = _loop(ref, batches)
    # resumed from the tagged save
    fresh, *_ = deepspeed.initialize(args=cmd_args, model=_net(), mpu=ps)
    load_path, client = fresh.load_checkpoint(tmp + "/gs", ckpt_id)
    resumed, _ = _loop(fresh, batches[3:])
    return {"rng_kept": rng_kept, "stage": model_engine.zero_optimization_stage(),
            "losses": losses + continued, "ref": ref_losses, "changed": changed,
            "saved": saved, "load_path": load_path, "client": client, "continued": continued,
            "resumed": resumed, "scale": optimizer.cur_scale,
            "applied": model_engine.was_step_applied()}


# -- the CIFAR-10 tutorial ------------------------------------------------------------------
def _cifar_config(stage):
    return {"train_batch_size": 16, "steps_per_print": 2000,
            "optimizer": {"type": "Adam", "params": {"lr": 0.001, "betas": [0.8, 0.999],
                                                     "eps": 1e-8, "weight_decay": 3e-7}},
            "scheduler": {"type": "WarmupLR", "params": {
                "warmup_min_lr": 0, "warmup_max_lr": 0.001, "warmup_num_steps": 1000}},
            "gradient_clipping": 1.0, "prescale_gradients": False,
            "bf16": {"enabled": False}, "fp16": {"enabled": False},
            "wall_clock_breakdown": False,
            "zero_optimization": {"stage": stage, "allgather_partitions": True,
                                  "reduce_scatter": True, "allgather_bucket_size": 50000000,
                                  "reduce_bucket_size": 50000000, "overlap_comm": True,
                                  "contiguous_gradients": True, "cpu_offload": False}}


def _trainset():
    g = torch.Generator().manual_seed(3)
    return torch.utils.data.TensorDataset(torch.randn(40, 3, 2, 2, generator=g),
                                          torch.randint(0, 4, (40,), generator=g))


def _cifar(ps):
    import hybrid
    from hybrid import deepspeed
    net, trainset = _net(), _trainset()
    parameters = filter(lambda p: p.requires_grad, net.parameters())
    model_engine, optimizer, trainloader, __ = deepspeed.initialize(
        model=net, model_parameters=parameters, training_data=trainset,
        config=_cifar_config(2), mpu=ps)
    w0 = net.fc2.weight.detach().clone()
    criterion = nn.CrossEntropyLoss()
    seen, losses = [], []
    for _epoch in range(2):
        for _i, data in enumerate(trainloader):
            inputs, labels = data[0].to(model_engine.device), data[1].to(model_engine.device)
            seen.append(inputs)
            outputs = model_engine(inputs)
            loss = criterion(outputs, labels)
            model_engine.backward(loss)
            model_engine.step()
            losses.append(loss.item())
    # hybrid.initialize on the same samples, picked by DistributedSampler's rule itself
    order = torch.randperm(40, generator=torch.Generator().manual_seed(0))[ps.dp_rank::2]
    mine = [order[i:i + 8] for i in range(0, 20, 8)] * 2
    ref, *_ = hybrid.initialize(model=_net(), config=_cifar_config(2), parallel_state=ps)
    ref_losses = []
    for idx in mine:
        loss = criterion(ref(trainset.tensors[0][idx]), trainset.tensors[1][idx])
        ref.backward(loss)
        ref.step()
        ref_losses.append(loss.item())
    return {"len": len(trainloader), "sizes": [len(x) for x in seen],
            "same_samples": all(torch.equal(x, trainset.tensors[0][i])
                                for x, i in zip(seen, mine, strict=True)),
            "losses": losses, "ref": ref_losses, "lr": model_engine.get_lr(),
            "steps": model_engine.global_steps, "samples": model_engine.global_samples,
            "changed": not torch.equal(w0, net.fc2.weight)}


# -- HelloDeepSpeed, in the ZeRO-3 tutorial's form ------------------------------------------
VOCAB = 32
HELLO = {"train_micro_batch_size_per_gpu": 2,
         "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
         "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                               "offload_optimizer": {"device": "cpu"}}}


class TinyLM(nn.Module):
    """A masked-LM stand-in: embedding, two blocks (each recomputed in backward through
    deepspeed.checkpointing when ``ckpt``), a head; takes a dict batch, returns the loss."""

    def __init__(self, ckpt):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16), nn.GELU())
                                    for _ in range(2))
        self.head = nn.Linear(16, VOCAB)
        self.ckpt = ckpt

    def forward(self, input_ids, labels):
        from hybrid import deepspeed
        x = self.embed(input_ids)
        for block in self.blocks:
            x = deepspeed.checkpointing.checkpoint(block, x) if self.ckpt else block(x)
        return nn.functional.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())


def _hello_batches(rank, n):
    g = torch.Generator().manual_seed(20 + rank)
    return [{"input_ids": torch.randint(0, VOCAB, (2, 6), generator=g),
             "labels": torch.randint(0, VOCAB, (2, 6), generator=g)} for _ in range(n)]


def _hello_loop(model, batches):
    losses = []
    for batch in batches:
        on_device = {k: v.to(model.device) for k, v in batch.items()}
        loss = model(**on_device)
        model.backward(loss)
        model.step()
        losses.append(loss.item())
    return losses


def _hello(ps, tmp):
    import hybrid
    from hybrid import deepspeed
    exp_dir = os.path.join(tmp, "hello")
    deepspeed.checkpointing.configure(None, deepspeed_config=HELLO)
    torch.manual_seed(0)  # zero.Init keeps the constructors' draws: the same on each rank
    with deepspeed.zero.Init():
        model = TinyLM(ckpt=True)
    model, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                          config=HELLO, mpu=ps)
    start = model.load_checkpoint(load_dir=exp_dir)  # nothing saved yet: start fresh
    held = model.zero.model_state_bytes()["params"]
    batches = _hello_batches(ps.dp_rank, 5)
    with deepspeed.zero.GatheredParameters(model.module.head.weight):
        w0 = model.module.head.weight.detach().clone()
    gathers = ps.comm_stats.calls["all_gather"]
    losses = _hello_loop(model, batches[:3])
    gathers = ps.comm_stats.calls["all_gather"] - gathers
    model.save_checkpoint(save_dir=exp_dir, client_state={"checkpoint_step": 3})
    continued = _hello_loop(model, batches[3:])
    with deepspeed.zero.GatheredParameters(model.module.head.weight):
        changed = not torch.equal(w0, model.module.head.weight)
    # hybrid.initialize, the same init, no recompute
    torch.manual_seed(0)
    with hybrid.zero_init():
        plain = TinyLM(ckpt=False)
    ref, *_ = hybrid.initialize(model=plain, config=HELLO, parallel_state=ps)
    ref_gathers = ps.comm_stats.calls["all_gather"]
    ref_losses = _hello_loop(ref, batches[:3])
    ref_gathers = ps.comm_stats.calls["all_gather"] - ref_gathers
    ref_losses += _hello_loop(ref, batches[3:])
    # the auto-resume idiom
    with deepspeed.zero.Init():
        again = TinyLM(ckpt=True)
    again, *_ = deepspeed.initialize(model=again, config=HELLO, mpu=ps)
    _, client_state = again.load_checkpoint(load_dir=exp_dir)
    resumed = _hello_loop(again, batches[3:])
    sums = torch.tensor([float(ps.rank + 1)])
    deepspeed.comm.all_reduce(sums)
    for e in (model, ref, again):
        e.close()
    return {"start": start, "held": held, "losses": losses + continued, "ref": ref_losses,
            "changed": changed, "client": client_state, "continued": continued,
            "resumed": resumed, "rank": deepspeed.comm.get_rank(),
            "world": deepspeed.comm.get_world_size(), "sum": float(sums[0]),
            "gathers": (gathers, ref_gathers),
            "numel": sum(p.numel() for p in model.module.parameters())}


def _scripts(ps, tmp):
    return {"getting_started": _getting_started(ps, tmp), "cifar": _cifar(ps),
            "hello": _hello(ps, tmp)}


def test_deepspeed_tutorial_loops_train_as_hybrid_initialize_at_dp2(tmp_path):
    out = run_ranks(_scripts, world_size=2, args=(str(tmp_path),))
    for rank, got in enumerate(out):
        gs = got["getting_started"]
        assert gs["rng_kept"] and gs["stage"] == 1 and gs["changed"] and gs["applied"]
        assert gs["losses"] == gs["ref"], (rank, gs["losses"], gs["ref"])
        assert gs["scale"] == 2.0 ** 16  # fp16's dynamic scale, no overflow here
        # rank 0's loss.item() named the one save both ranks wrote, and loaded
        tag = f"{out[0]['getting_started']['losses'][2]!r}"
        assert gs["saved"] == f"{tmp_path}/gs/{tag}/iter_0000003", (gs["saved"], tag)
        assert gs["load_path"] == gs["saved"] and gs["client"] == {"step": 3}
        assert gs["resumed"] == gs["continued"]

        cifar = got["cifar"]
        # 20 samples per rank in micro-batches of 8 (the last 4), two epochs, same order
        assert cifar["len"] == 3 and cifar["sizes"] == [8, 8, 4] * 2 and cifar["same_samples"]
        assert cifar["losses"] == cifar["ref"], (rank, cifar["losses"], cifar["ref"])
        assert cifar["changed"] and (cifar["steps"], cifar["samples"]) == (6, 96)
        # the log warmup over 1000 steps, at step 7 next: DeepSpeed's i = 5
        assert cifar["lr"][0] == 0.001 * math.log(6) / math.log(1000)

        hello = got["hello"]
        assert hello["start"] == (None, None) and hello["changed"]
        # each rank holds its half of the fp32 parameters (3 units, each padded to DP 2)
        assert hello["held"] <= 4 * (hello["numel"] // 2 + 3), (hello["held"], hello["numel"])
        # the recompute's gather is backward's: no more gathers than without recompute
        assert hello["gathers"][0] == hello["gathers"][1] > 0, hello["gathers"]
        for a, b in zip(hello["losses"], hello["ref"], strict=True):
            assert abs(a - b) <= 1e-6 * abs(b), (rank, hello["losses"], hello["ref"])
        assert hello["client"] == {"checkpoint_step": 3} and hello["resumed"] == hello["continued"]
        assert (hello["rank"], hello["world"], hello["sum"]) == (rank, 2, 3.0)
    # DP 2 really split the data: the ranks saw different batches, so different losses
    assert out[0]["cifar"]["losses"] != out[1]["cifar"]["losses"]
