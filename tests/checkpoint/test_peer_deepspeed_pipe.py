"""DeepSpeed 0.19.8 pipeline (PipelineModule) checkpoints into hybrid.deepspeed's
PipelineModule (hybrid/checkpoint/peers/deepspeed_pipe.py).

The fixtures under tests/fixtures/peers/deepspeed-0.19.8/pipe_* were written by DeepSpeed's
own PipelineEngine (benchmarks/peers/record_deepspeed_checkpoint.py: the recorder's
five-layer :func:`pipe_layers`, its first layer's weight tied to the last's, cut into 2
stages; ``train_batch`` for 3 steps, saved, 10 more losses in ``losses.json``): without
ZeRO (``pipe_zero0``) and at ZeRO 1 (``pipe_zero1``) on PP 2, and at ZeRO 1 on PP 2 x DP 2
(``pipe_dp2_zero1``). A script that builds the same PipelineModule under ``import
hybrid.deepspeed as deepspeed`` and calls ``engine.load_checkpoint(dir)`` continues them:
its next 10 losses equal DeepSpeed's within 2e-6 at DeepSpeed's layout (PP 2), at
another DP size (DP 2's save at DP 1) and at PP 1 with another ZeRO stage. The masters and
moments hybrid imported equal the values in DeepSpeed's files, read here with torch.load
rather than the reader. ``pipe_bf16``: the same model trained in bf16 without ZeRO
(BF16_Optimizer under the PipelineEngine, as Megatron-DeepSpeed trains), continued in
bf16. ``mds_gpt_zero1``: a PipelineModule with Megatron-DeepSpeed's GPTModelPipe layer
list and parameter names (read from its source; recorded by DeepSpeed's own engine, not
by Megatron-DeepSpeed) continued by ``pretrain_gpt.py --load``. Bad input is one
CheckpointError naming the file.
"""

from __future__ import annotations

import hashlib
import json
import os

import pytest
import torch

from hybrid.checkpoint import iter_full_params
from hybrid.errors import CheckpointError
from tests.checkpoint.test_peer_deepspeed import FIXTURES, TOLERANCE, _copy, _recorder
from tests.helpers.deepspeed_pickles import load as _load

# pipe_bf16 at PP 1: the tied weight's two uses' bf16 gradients are summed by autograd on
# one stage, where DeepSpeed's two stages each rounded their own and summed them after:
# other bf16 roundings, which move the 10 losses by 2.7e-4 (measured; at PP 2: equal).
BF16_PP1_TOLERANCE = 5e-4


def _after(name: str) -> list[float]:
    with open(os.path.join(FIXTURES, name, "losses.json")) as f:
        return json.load(f)["after"]


def _worst(got, want) -> float:
    assert len(got) == len(want) == 10
    return max(abs(a - b) for a, b in zip(got, want))


def _digest(path: str) -> dict[str, str]:
    out = {}
    for name in sorted(os.listdir(path)):
        with open(os.path.join(path, name), "rb") as f:
            out[name] = hashlib.sha256(f.read()).hexdigest()
    return out


def _continue(ps, load_dir: str, stage: int) -> list[float]:
    """A DeepSpeed pipeline script under hybrid: the recorder's PipelineModule at
    ``ps``'s PP size, load_checkpoint, 10 train_batch steps on this DP rank's
    micro-batches: the global losses. ``pipe_bf16`` (its name ends so) in bf16, its
    gradients accumulated in bf16 as DeepSpeed's BF16_Optimizer under a PipelineEngine
    did (``data_types.grad_accum_dtype``), its loss in fp32 of the bf16 outputs."""
    from hybrid import deepspeed
    rec = _recorder()
    bf16 = load_dir.rstrip(os.sep).endswith("bf16")
    torch.manual_seed(123)  # other initial weights: the load must replace them all
    net = deepspeed.pipe.PipelineModule(
        rec.pipe_layers(deepspeed.pipe.LayerSpec, deepspeed.pipe.TiedLayerSpec),
        num_stages=ps.pp_size, loss_fn=rec.pipe_bf16_loss if bf16 else rec.loss_of,
        partition_method="uniform", parallel_state=ps)
    config = ({**rec.pipe_bf16_config(), "zero_optimization": {"stage": stage},
               "data_types": {"grad_accum_dtype": "bf16"}} if bf16 else rec.pipe_config(stage))
    engine, *_ = deepspeed.initialize(model=net, model_parameters=list(net.parameters()),
                                      config=config)
    assert all((p.dtype == torch.bfloat16) == bf16 for p in net.parameters())
    path, _ = engine.load_checkpoint(load_dir)
    assert path.endswith(os.path.join("hybrid_import", "iter_0000003")), path
    assert (engine.global_steps, engine.global_samples) == (3, 24)
    assert engine.lr_scheduler.state_dict() == {"last_batch_iteration": 2}
    batches = rec.pipe_bf16_micro_batches if bf16 else rec.pipe_micro_batches
    losses = [float(engine.train_batch(iter(batches(step, ps.dp_rank, ps.dp_size))))
              for step in range(rec.SAVED_AT, rec.SAVED_AT + rec.CONTINUED)]
    engine.close()
    return losses


def _cases(ps, cases):
    return [_continue(ps, d, stage) for d, stage in cases]


def test_a_deepspeed_pipeline_checkpoint_continues_at_pp2(tmp_path):
    """One 2-rank launch at PP 2 (DeepSpeed's layout): the stage-0 save and the ZeRO 1
    one at their stages, the PP 2 x DP 2 save at DP 1 (its two DP partitions of each
    stage joined), and the bf16 one (BF16_Optimizer without ZeRO, as Megatron-DeepSpeed
    trains) in bf16 without ZeRO: every rank's 10 losses within 2e-6 of DeepSpeed's
    (bf16's measured: equal; its gradients accumulated in fp32 instead move them by
    3.5e-4, a weight rounded to another bf16 value by about 1e-4); DeepSpeed's files
    are left as they were."""
    from tests.helpers.harness import run_ranks
    cases = [(_copy("pipe_zero0", tmp_path / "a"), 0), (_copy("pipe_zero1", tmp_path / "b"), 1),
             (_copy("pipe_dp2_zero1", tmp_path / "c"), 1),
             (_copy("pipe_bf16", tmp_path / "d"), 0)]
    before = {d: _digest(os.path.join(d, "global_step3")) for d, _ in cases}
    out = run_ranks(_cases, world_size=2, pp=2, args=(cases,))
    assert out[0] == out[1]  # (train_batch's loss: the same on every stage)
    for (d, stage), got in zip(cases, out[0]):
        want = _after(os.path.basename(d))
        assert _worst(got, want) <= TOLERANCE, (d, stage, got, want)
        assert _digest(os.path.join(d, "global_step3")) == before[d]






def _deepspeed_values(tag_dir: str) -> dict[str, dict[str, torch.Tensor]]:
    """Each parameter's master and moments as DeepSpeed's files hold them, the tied
    weight from stage 0's: without ZeRO, the layer files' weights (the recorder's
    layers: 0 the tied module, 1 and 3 linears) and each stage's torch optimizer state
    by position in its module's parameters; at ZeRO 1, each stage's DP partitions joined
    in rank order, cut by its param_shapes."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    for stage in (1, 0):  # (stage 0's tied weight last: it wins)
        ms = _load(os.path.join(tag_dir, f"mp_rank_{stage:02d}_model_states.pt"))
        if ms["optimizer"] is not None and "state" in ms["optimizer"]:  # (a torch one's)
            layers = {0: ["tied_modules.embed.weight", "1.weight", "1.bias"],
                      1: ["tied_modules.embed.weight", "3.weight", "3.bias"]}[stage]
            state = ms["optimizer"]["state"]
            for i, name in enumerate(layers):
                idx, attr = (0, "weight") if name.startswith("tied") else name.split(".")
                master = _load(os.path.join(tag_dir, f"layer_{int(idx):02d}-model_states.pt"))
                out[name] = {"master": master[attr], "exp_avg": state[i]["exp_avg"],
                             "exp_avg_sq": state[i]["exp_avg_sq"]}
            continue
        files = sorted(f for f in os.listdir(tag_dir)
                       if f.endswith(f"mp_rank_{stage:02d}_optim_states.pt"))
        states = [_load(os.path.join(tag_dir, f))["optimizer_state_dict"] for f in files]
        flat = {"master": torch.cat([s["single_partition_of_fp32_groups"][0] for s in states])}
        for k in ("exp_avg", "exp_avg_sq"):
            flat[k] = torch.cat([s["base_optimizer_state"]["state"][0][k] for s in states])
        if ms["param_shapes"] is None:  # BF16_Optimizer's (one rank): its slice mappings
            (state,) = states
            for name, addr in state["param_slice_mappings"][0].items():
                idx, attr = (0, "weight") if name.startswith("tied") else name.split(".")
                shape = _load(os.path.join(tag_dir, f"layer_{int(idx):02d}-model_states."
                                                    f"pt"))[attr].shape
                out[name] = {k: v[addr.start:addr.start + addr.numel].view(shape)
                             for k, v in flat.items()}
            continue
        at = 0
        for name, shape in ms["param_shapes"][0].items():
            n = shape.numel()
            out[name] = {k: v[at:at + n].view(shape) for k, v in flat.items()}
            at += n
    return out


def _one_rank(load_dir: str, stage: int) -> list[float]:
    from hybrid.parallel.state import ParallelState
    return _continue(ParallelState.single(), load_dir, stage)


@pytest.mark.parametrize("fixture,stage", [("pipe_zero0", 1), ("pipe_dp2_zero1", 0),
                                           ("pipe_bf16", 1)])
def test_pp1_continues_and_imports_deepspeed_s_values(tmp_path, fixture, stage):
    """At PP 1 on one rank (another pipeline depth, DP size and ZeRO stage than
    DeepSpeed's): the same 10 losses; the imported masters, moments and step are the
    values in DeepSpeed's files, the tied weight stage 0's (equal to stage 1's); bf16's
    masters BF16_Optimizer's fp32 partitions (not the layer files' bf16 weights), its
    losses within :data:`BF16_PP1_TOLERANCE`."""
    d = _copy(fixture, tmp_path)
    got = _one_rank(d, stage)
    bound = BF16_PP1_TOLERANCE if fixture == "pipe_bf16" else TOLERANCE
    assert _worst(got, _after(fixture)) <= bound, got
    want = _deepspeed_values(os.path.join(d, "global_step3"))
    meta, params = iter_full_params(os.path.join(d, "hybrid_import", "iter_0000003"))
    seen = dict(params)
    assert sorted(seen) == sorted(want) == ["1.bias", "1.weight", "3.bias", "3.weight",
                                            "tied_modules.embed.weight"]
    for n, values in want.items():
        for k, v in values.items():
            assert torch.equal(seen[n][k], v), (n, k)
    assert (meta["step"], meta["iteration"], meta["consumed_samples"]) == (3, 3, 24)
    assert meta["imported_from"]["format"] == (
        "DeepSpeed pipeline bf16 BF16_Optimizer (PP 2)" if fixture == "pipe_bf16" else
        f"DeepSpeed pipeline ZeRO {fixture[-1]} (PP 2)")
    if fixture == "pipe_bf16":
        layer = _load(os.path.join(d, "global_step3", "layer_01-model_states.pt"))["weight"]
        assert layer.dtype == torch.bfloat16
        assert torch.equal(want["1.weight"]["master"].bfloat16(), layer)
        assert not torch.equal(want["1.weight"]["master"], layer.float())


def _open(d: str):
    from hybrid.checkpoint.peers import deepspeed_pipe
    from hybrid.deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
    from hybrid.parallel.state import ParallelState
    rec = _recorder()
    net = PipelineModule(rec.pipe_layers(LayerSpec, TiedLayerSpec), num_stages=1,
                         parallel_state=ParallelState.single())
    peer = deepspeed_pipe.open(d, deepspeed_pipe.layer_prefixes(net))
    for name in peer.shapes:
        peer.read(name)
    peer.close()


def test_bad_pipeline_checkpoints_are_one_error_naming_the_file(tmp_path):
    """A missing layer file, a stage's missing optimizer partition (ZeRO 1's, bf16's
    BF16_Optimizer's), a tensor-parallel
    (``model`` axis) save, the layers of another model (two layer files swapped), a tied
    weight whose stages' copies differ, a stage's buffer: one CheckpointError each, naming
    the file; the reader without a module (``--load``'s) and a module that is not a
    PipelineModule refuse it by name."""
    from hybrid import deepspeed
    from hybrid.parallel.state import ParallelState
    d = _copy("pipe_zero0", tmp_path / "a")
    os.remove(os.path.join(d, "global_step3", "layer_03-model_states.pt"))
    with pytest.raises(CheckpointError, match=r"layer_03-model_states.pt: missing: layer 3"):
        _open(d)
    d = _copy("pipe_dp2_zero1", tmp_path / "b")
    os.remove(os.path.join(d, "global_step3", "zero_pp_rank_1_mp_rank_01_optim_states.pt"))
    with pytest.raises(CheckpointError, match=r"zero_pp_rank_1_mp_rank_01_optim_states.pt: "
                                              r"missing: stage 1's optimizer partition"):
        _open(d)
    d = _copy("pipe_bf16", tmp_path / "bf16")
    os.remove(os.path.join(d, "global_step3", "bf16_zero_pp_rank_0_mp_rank_01_optim_states.pt"))
    with pytest.raises(CheckpointError, match=r"bf16_zero_pp_rank_0_mp_rank_01_optim_states.pt"
                                              r": missing: stage 1's optimizer partition"):
        _open(d)
    d = _copy("pipe_zero1", tmp_path / "c")
    tag = os.path.join(d, "global_step3")
    os.rename(os.path.join(tag, "layer_01-model_states.pt"),
              os.path.join(tag, "layer_01-model_00-model_states.pt"))
    with pytest.raises(CheckpointError, match=r"layer_01-model_00-model_states.pt: a DeepSpeed "
                                              r"pipeline checkpoint with a model"):
        _open(d)
    d = _copy("pipe_zero0", tmp_path / "d")  # layers 1 and 3 swapped: stage 0 holds 9x9
    tag = os.path.join(d, "global_step3")
    os.rename(os.path.join(tag, "layer_00-model_states.pt"), os.path.join(tag, "x"))
    os.rename(os.path.join(tag, "layer_01-model_states.pt"),
              os.path.join(tag, "layer_00-model_states.pt"))
    os.rename(os.path.join(tag, "x"), os.path.join(tag, "layer_01-model_states.pt"))
    with pytest.raises(CheckpointError, match=r"no cut of the PipelineModule's 5 layers into "
                                              r"2 stages"):
        _open(d)
    d = _copy("pipe_zero0", tmp_path / "f")  # stage 1's copy of the tied weight moved
    path = os.path.join(d, "global_step3", "mp_rank_01_model_states.pt")
    ms = torch.load(path, weights_only=True)
    ms["optimizer"]["state"][0]["exp_avg"][0, 0] += 1e-3
    torch.save(ms, path)
    with pytest.raises(CheckpointError, match=r"mp_rank_01_model_states.pt: the exp_avg of the "
                                              r"tied tied_modules.embed.weight on stage 1"):
        _open(d)
    d = _copy("pipe_zero0", tmp_path / "g")  # a stage with a buffer (a BatchNorm's)
    path = os.path.join(d, "global_step3", "mp_rank_01_model_states.pt")
    ms = torch.load(path, weights_only=True)
    ms["buffer_names"] = ["3.running_mean"]
    torch.save(ms, path)
    with pytest.raises(CheckpointError, match=r"mp_rank_01_model_states.pt: buffers "
                                              r"\(3.running_mean\) on pipeline stage 1"):
        _open(d)
    from hybrid.checkpoint.peers import deepspeed as ds
    with pytest.raises(CheckpointError, match=r"layer_00-model_states.pt: a DeepSpeed pipeline "
                                              r"\(PipelineModule\) checkpoint: hybrid reads it "
                                              r"with engine.load_checkpoint"):
        ds.open(d)  # (the --load route: no module to name the layer files' entries)
    rec = _recorder()
    net = rec.Net()
    engine = deepspeed.initialize(model=net, model_parameters=net.parameters(),
                                  config=rec.config(1), mpu=ParallelState.single())[0]
    with pytest.raises(CheckpointError, match=r"global_step3: a DeepSpeed pipeline "
                                              r"\(PipelineModule\) checkpoint"):
        engine.load_checkpoint(_copy("pipe_zero1", tmp_path / "e"))
    engine.close()


# Megatron-DeepSpeed's GPT: mds_gpt_zero1 is a PipelineModule with GPTModelPipe's layer
# list and parameter names (as read from Megatron-DeepSpeed's source: the recorder's
# mds_layers) for GPT_ARGS' model, trained by DeepSpeed 0.19.8's own PipelineEngine at
# PP 2 ZeRO 1 on pretrain_gpt.py's batches -- not by Megatron-DeepSpeed, which needs CUDA;
# mds_gpt_bf16 the same in bf16 without ZeRO (BF16_Optimizer: BLOOM's setting).
# mds_gpt_bf16 continued in bf16: the recorder's forward is plain torch in bf16, not
# hybrid's bf16 GPT (whose norms, softmax and loss keep other precisions): the first loss,
# before any step, already differs by 4.9e-5; the 10 differ by up to 1.1e-4 (measured).
GPT_BF16_TOLERANCE = 5e-4


@pytest.mark.parametrize("fixture,layout", [
    ("mds_gpt_zero1", ["--pipeline-model-parallel-size", "2"]),
    ("mds_gpt_zero1", ["--tensor-model-parallel-size", "2"]),
    ("mds_gpt_zero0", ["--tensor-model-parallel-size", "2"]),
    ("mds_gpt_bf16", ["--pipeline-model-parallel-size", "2", "--bf16",
                      "--no-accumulate-allreduce-grads-in-fp32"])])
def test_pretrain_gpt_continues_a_gptmodelpipe_checkpoint(tmp_path, fixture, layout):
    """``pretrain_gpt.py --load`` detects GPTModelPipe's layer files and continues
    DeepSpeed's next 10 losses within 2e-6 at PP 2 (DeepSpeed's layout) and at TP 2
    (measured 9.5e-7 each; the save without ZeRO at TP 2 too); the bf16 save (gradients
    accumulated in bf16, as DeepSpeed's BF16_Optimizer under a PipelineEngine did) within
    :data:`GPT_BF16_TOLERANCE`. The
    import's values are the files': the per-head QKV as it is, the position embeddings
    stage 0's (the head stage's copy, which its forward never uses, stayed at its initial
    value), the masters and moments the fp32 partitions (bf16's: not the layer files'
    bf16 weights)."""
    from tests.helpers.launch import pretrain, read_json_log
    rec = _recorder()
    d = _copy(fixture, tmp_path)
    log, save = str(tmp_path / "log.json"), tmp_path / "save"
    r = pretrain(2, [*rec.GPT_ARGS, *layout, "--load", d, "--save", str(save),
                     "--log-json", log])
    assert r.returncode == 0, r.stderr[-3000:]
    lines = read_json_log(log)
    assert [m["iteration"] for m in lines] == list(range(4, 14))
    bound = GPT_BF16_TOLERANCE if fixture.endswith("bf16") else TOLERANCE
    assert _worst([m["loss"] for m in lines], _after(fixture)) <= bound, lines
    meta, params = iter_full_params(str(save / "iter_0000003"))
    seen = dict(params)
    assert meta["imported_from"]["format"] == (
        "DeepSpeed pipeline (GPTModelPipe) bf16 BF16_Optimizer (PP 2)"
        if fixture.endswith("bf16") else
        f"DeepSpeed pipeline (GPTModelPipe) ZeRO {fixture[-1]} (PP 2)")
    assert (meta["step"], meta["iteration"], meta["consumed_samples"]) == (3, 3, 12)
    tag = os.path.join(d, "global_step3")
    want = _deepspeed_gpt_values(tag)
    pairs = (("wpe.weight", "tied_modules.embed.position_embeddings.weight"),
             ("blocks.0.attn.qkv.weight", "2.self_attention.query_key_value.weight"),
             ("blocks.1.mlp.fc.bias", "3.mlp.dense_h_to_4h.bias"), ("ln_f.weight", "4.weight"))
    for hybrid_name, ds_name in pairs:
        for k, v in want[ds_name].items():
            assert torch.equal(seen[hybrid_name][k].reshape(-1), v), (hybrid_name, k)
    first = _load(os.path.join(tag, "layer_01-model_states.pt"))["position_embeddings.weight"]
    unused = want["stage1.position_embeddings"]
    assert unused is not None
    if fixture == "mds_gpt_zero0":  # (no file holds stage 1's copy: its moments differ)
        assert not torch.equal(unused["exp_avg_sq"],
                               want["tied_modules.embed.position_embeddings.weight"]["exp_avg_sq"])
    else:
        assert not torch.equal(unused["master"], first.reshape(-1))
    qkv = _load(os.path.join(tag, "layer_02-model_states.pt"))[
        "self_attention.query_key_value.weight"]
    if fixture.endswith("bf16"):  # (the layer files' weights: the masters' rounding)
        assert qkv.dtype == torch.bfloat16
        assert torch.equal(seen["blocks.0.attn.qkv.weight"]["master"].bfloat16(), qkv)
        assert not torch.equal(seen["blocks.0.attn.qkv.weight"]["master"], qkv.float())


def _deepspeed_gpt_values(tag_dir: str) -> dict[str, dict[str, torch.Tensor]]:
    """A GPTModelPipe fixture's values by the module's names, flat: each stage's one
    partition (DP 1) cut by its param_shapes (ZeRO 1) or its param_slice_mappings
    (BF16_Optimizer), stage 0's winning; the head stage's position embeddings as
    ``stage1.position_embeddings``."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    for stage in (1, 0):
        ms = _load(os.path.join(tag_dir, f"mp_rank_{stage:02d}_model_states.pt"))
        if ms["param_shapes"] is None and "state" in ms["optimizer"]:  # ZeRO 0
            # the stage module's parameters in order (tied module first), masters from
            # the layer files (stage 0's), moments by position in its torch optimizer
            files = {0: [1, 2], 1: [1, 3, 4]}[stage]
            names = [(i, k) for i in files
                     for k in _load(os.path.join(tag_dir, f"layer_{i:02d}-model_states.pt"))]
            state = ms["optimizer"]["state"]
            for j, (i, k) in enumerate(names):
                n = f"tied_modules.embed.{k}" if i == 1 else f"{i}.{k}"
                master = _load(os.path.join(tag_dir, f"layer_{i:02d}-model_states.pt"))[k]
                out[n] = {"master": master.reshape(-1),
                          **{m: state[j][m].reshape(-1) for m in ("exp_avg", "exp_avg_sq")}}
            if stage == 1:
                out["stage1.position_embeddings"] = out[
                    "tied_modules.embed.position_embeddings.weight"]
            continue
        (name,) = [f for f in os.listdir(tag_dir)
                   if f.endswith(f"zero_pp_rank_0_mp_rank_{stage:02d}_optim_states.pt")]
        o = _load(os.path.join(tag_dir, name))["optimizer_state_dict"]
        flat = {"master": o["single_partition_of_fp32_groups"][0],
                **{k: o["base_optimizer_state"]["state"][0][k] for k in ("exp_avg", "exp_avg_sq")}}
        if ms["param_shapes"] is None:
            places = [(n, a.start, a.numel) for n, a in o["param_slice_mappings"][0].items()]
        else:
            places, at = [], 0
            for n, shape in ms["param_shapes"][0].items():
                places.append((n, at, shape.numel()))
                at += shape.numel()
        for n, at, size in places:
            out[n] = {k: v[at:at + size] for k, v in flat.items()}
        if stage == 1:
            out["stage1.position_embeddings"] = out["tied_modules.embed.position_embeddings.weight"]
    return out


def test_a_gptmodelpipe_save_missing_a_layer_file_is_one_error_naming_it(tmp_path):
    """The --load route's reader (detected, no module): a transformer layer's, the final
    norm's or the embedding's layer file missing is one CheckpointError naming that file;
    a name GPTModelPipe's GELU GPT has no place for, and --swiglu, are refused by name."""
    from hybrid.checkpoint.peers import open_peer
    for i, what in ((3, r"missing: layer 3 \(3\)"), (4, r"missing: GPTModelPipe's final norm"),
                    (1, r"missing: GPTModelPipe's embedding")):
        d = _copy("mds_gpt_zero1", tmp_path / str(i))
        os.remove(os.path.join(d, "global_step3", f"layer_{i:02d}-model_states.pt"))
        with pytest.raises(CheckpointError, match=rf"layer_{i:02d}-model_states.pt: {what}"):
            open_peer(d).close()
    d = _copy("mds_gpt_zero1", tmp_path / "other")  # a parameter of another name
    path = os.path.join(d, "global_step3", "layer_02-model_states.pt")
    sd = torch.load(path, weights_only=True)
    sd["input_layernorm.scale"] = sd.pop("input_layernorm.bias")
    torch.save(sd, path)
    path = os.path.join(d, "global_step3", "mp_rank_00_model_states.pt")
    ms = _load(path)
    ms["param_shapes"] = [{k.replace("2.input_layernorm.bias", "2.input_layernorm.scale"): v
                           for k, v in g.items()} for g in ms["param_shapes"]]
    torch.save(ms, path)
    with pytest.raises(CheckpointError, match=r"layer_02-model_states.pt: 2.input_layernorm."
                                              r"scale has no place in hybrid's GPT"):
        open_peer(d).close()
    peer = open_peer(_copy("mds_gpt_zero1", tmp_path / "swiglu"))
    with pytest.raises(CheckpointError, match=r"loaded with --swiglu"):
        peer.configure({"swiglu": True})
    peer.close()
