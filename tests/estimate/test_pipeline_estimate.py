"""The estimator with PP: each stage's parameters; its activations, the micro-batches its
schedule keeps in flight (the simulator's peak, and the activation meter's bytes on the
real stage modules); the p2p bytes per step and the predicted bubble, with equal stages
and with each stage's times from its FLOPs (worked by hand, against the split flags and
against the CPU bench's measured bubble); the script's
per-stage record; a bad split refused by the same message as the launcher's; and the
docs' worked example of what a rank costs: printed as the doc quotes it, and meeting the
doc's formulas in both of ZeRO 3's modes (the stage held through the step, or resharded
after every micro-batch), which at the shape the doc measured give its bytes."""

import io
import json
import pathlib
import re
import shlex
from contextlib import redirect_stdout
from dataclasses import replace
from fractions import Fraction

import pytest

from hybrid.config import build_config, parse_args
from hybrid.config.model import ModelConfig
from hybrid.estimate.memory import (
    activation_bytes,
    activation_bytes_per_layer,
    buffer_bytes,
    embedding_bytes,
    loss_bytes,
    traffic_bytes,
)
from hybrid.estimate.model_states import model_state_bytes
from hybrid.estimate.pipeline import (
    StageFlops,
    bubble as pipeline_bubble,
    flop_times,
    p2p_bytes_per_step,
    piece_layers,
    relative_flops,
    stage_flops,
    weighted_bubble,
    weighted_simulation,
)
from hybrid.estimate.workload import Workload, workload
from hybrid.pipeline.actions import Kind
from hybrid.pipeline.schedules import build_schedule
from hybrid.pipeline.simulator import simulate
from tests.helpers.launch import ROOT, script_module

MODEL = ["--num-layers", "8", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "32", "--micro-batch-size", "1"]


@pytest.mark.parametrize("untie", [False, True])
def test_the_stages_hold_the_model_once_and_a_tied_embedding_twice(untie):
    flags = MODEL + ["--untie-embeddings-and-output-weights"] * untie
    model = build_config(parse_args(flags), 1).model.with_vocab_size(257)
    stages = [model.stage_parameters(2, 2, s == 0, s == 3) for s in range(4)]
    tied_copy = 0 if untie else model.padded_vocab_size(2) * 64 // 2
    assert sum(stages) == model.num_parameters(2) + tied_copy
    assert model.stage_parameters(2, 8, True, True) == model.num_parameters(2)  # PP 1
    assert stages[1] == stages[2] == 2 * model.block_parameters(2)


def test_the_workload_describes_the_heaviest_stage():
    cfg = build_config(parse_args(MODEL + ["--pipeline-model-parallel-size", "4",
                                           "--decoder-first-pipeline-num-layers", "1",
                                           "--decoder-last-pipeline-num-layers", "1"]),
                       8, plan_only=True)
    w = workload(cfg, 257)
    assert (w.pp, w.stage_layers, w.stage, w.dp) == (4, (1, 3, 3, 1), 0, 2)
    heavy = w.heaviest_stage()
    assert heavy.stage == 1 and heavy.psi == 3 * cfg.model.block_parameters(1)
    one = workload(build_config(parse_args(MODEL), 2), 257)
    assert one.psi == one.model.num_parameters(1) and one.heaviest_stage() == one


def test_estimate_memory_plans_a_pipeline_run(capsys):
    script = script_module("estimate_memory")
    assert script.main(MODEL + ["--pipeline-model-parallel-size", "2",
                                "--virtual-pipeline-model-parallel-size", "2",
                                "--global-batch-size", "4", "--world-size", "4"]) == 0
    first = json.loads(capsys.readouterr().out.splitlines()[0])
    assert (first["pp"], first["vpp"], first["dp"], first["layers_per_stage"]) == (2, 2, 2, [4, 4])
    assert first["params_per_tp_rank"] == max(first["params_per_stage"])
    with pytest.raises(SystemExit) as e:
        script.main(MODEL + ["--num-layers", "30", "--pipeline-model-parallel-size", "4",
                             "--world-size", "8"])
    assert e.value.code == 2
    assert ("--num-layers 30 is not divisible by --pipeline-model-parallel-size 4"
            in capsys.readouterr().err)


# -- per stage under a schedule: activations in flight, p2p bytes, bubble ----------------------

def _piped(schedule, p=4, m=8, v=1, layers=8, **kw):
    """A Workload of ``layers`` even layers over p ranks of v chunks (fp32, CPU kernels)."""
    model = ModelConfig(vocab_size=V, num_layers=layers, hidden_size=C, num_attention_heads=4,
                        ffn_hidden_size=4 * C, seq_length=T, max_position_embeddings=T,
                        hidden_dropout=0.0, attention_dropout=0.0)
    per = layers // (p * v)
    return Workload(model=model, micro_batch_size=B, pp=p, micro_batches=m, device="cpu",
                    stage_layers=(per * v,) * p, chunk_layers=((per,) * v,) * p,
                    schedule=schedule, **kw)


V, C, T, B = 256, 32, 16, 2
HELD = {"gpipe": [8] * 4, "1f1b": [4, 3, 2, 1], "zb_h1": [4] * 4,  # p - r under 1F1B
        "interleaved_1f1b": [11, 9, 7, 5]}  # chunk activations (the docs' grid)


@pytest.mark.parametrize("schedule", list(HELD))
def test_a_stage_holds_the_simulators_peak_of_micro_batches(schedule):
    v = 2 if schedule == "interleaved_1f1b" else 1
    w = _piped(schedule, v=v)
    sim = simulate(build_schedule(schedule, 4, 8, v))
    layer = activation_bytes_per_layer(w)
    per_chunk = (8 // (4 * v)) * layer
    for r in range(4):
        a = activation_bytes(replace(w, stage=r))
        assert a["held"] == a["peak_held"] == sim.peak_held[r] == HELD[schedule][r]
        assert a["layers"] == a["held"] * per_chunk  # equal chunks: count x one chunk
        assert a["outputs"] <= a["held"] * B * T * C * 4  # the last stage's output: the loss
        if v == 1:
            assert a["outputs"] == (0 if r == 3 else a["held"] * B * T * C * 4)
            ends = (embedding_bytes(w) if r == 0 else 0) + (loss_bytes(w) if r == 3 else 0)
            assert a["head"] == a["held"] * ends
    assert pipeline_bubble(w) == sim.bubble


def test_uneven_chunks_weigh_the_walk_by_their_layers():
    """Interleaved at p 2, m 4, rank 0's chunks of 1 and 3 layers: the peak is the heaviest
    moment of the walk, not the count times an average chunk. Rank 0 runs F0a F1a F0b
    F1b F2a (1 + 1 + 3 + 3 + 1 = 9 layers, 5 chunk activations), B0b, F3a, B1b, F2b,
    B0a, F3b (9 again), ...: 9 layers at its peak of 5, where 5 average chunks are 10."""
    w = replace(_piped("interleaved_1f1b", p=2, m=4, v=2), stage_layers=(4, 4),
                chunk_layers=((1, 3), (3, 1)))
    a = activation_bytes(w)
    sim = simulate(build_schedule("interleaved_1f1b", 2, 4, 2))
    layer = activation_bytes_per_layer(w)
    assert a["peak_held"] == sim.peak_held[0] and a["held"] <= a["peak_held"]
    assert a["per_micro_batch"] == [layer + embedding_bytes(w), 3 * layer]
    assert (a["held"], a["peak_held"], a["layers"]) == (5, 5, 9 * layer)


def test_the_bubble_is_the_formulas():
    assert pipeline_bubble(_piped("1f1b")) == pipeline_bubble(_piped("gpipe")) == Fraction(3, 11)
    assert pipeline_bubble(_piped("interleaved_1f1b", v=2)) == Fraction(3, 19)
    assert pipeline_bubble(_piped("zb_h1")) == Fraction(1, 9)


def test_p2p_bytes_per_boundary_crossed():
    msg = B * T * C * 4
    one = p2p_bytes_per_step(_piped("1f1b"))
    assert one == {"message": msg, "ranks": [8 * msg, 16 * msg, 16 * msg, 8 * msg],
                   "total": 2 * 3 * 8 * msg}
    # interleaved at p 2, v 2: 3 boundaries, each rank sending 3 m messages (the bench's)
    two = p2p_bytes_per_step(_piped("interleaved_1f1b", p=2, m=4, v=2))
    assert two["ranks"] == [3 * 4 * msg] * 2 and two["total"] == 2 * 3 * 4 * msg
    sp = p2p_bytes_per_step(_piped("1f1b", tp=2, sequence_parallel=True, cp=2))
    assert sp["message"] == B * (T // 4) * C * 4  # (B, T / (cp tp), C)


def test_a_stages_saved_bytes_per_micro_batch_are_the_meters():
    """One micro-batch through the real stage modules of a 4-layer GPT at PP 2 (the
    first: embedding and layers 0-1; the last: layers 2-3, head and loss), each under
    the activation meter: what they save is the estimator's per-micro-batch figure."""
    import torch

    from hybrid.parallel.state import ParallelState
    from hybrid.tensor_parallel import seed_all
    from hybrid.train.activation_meter import SavedActivationMeter
    from models.gpt import GPT

    w = _piped("1f1b", p=2, m=2, layers=4)
    ps = ParallelState.single()
    rng = seed_all(1, 0, 0, ps.device)
    first = GPT(w.model, ps.tp_group, rng=rng, layers=range(0, 2), post_process=False)
    last = GPT(w.model, ps.tp_group, rng=rng, layers=range(2, 4), pre_process=False)
    g = torch.Generator().manual_seed(0)
    tokens, labels = (torch.randint(0, V, (B, T), generator=g) for _ in range(2))
    with SavedActivationMeter() as m0:
        out = first(tokens)
    x = out.detach().requires_grad_()
    with SavedActivationMeter() as m1:
        loss = last(hidden=x, labels=labels)
    got = [m0.held(), m1.held()]
    del out, loss
    want = [activation_bytes(replace(w, stage=s))["per_micro_batch"][0] for s in range(2)]
    assert got == want
    ps.close()


def test_estimate_memory_prints_every_pipeline_stage(capsys):
    script = script_module("estimate_memory")
    assert script.main(MODEL + ["--pipeline-model-parallel-size", "4",
                                "--global-batch-size", "8", "--world-size", "8"]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    pl = next(x["pipeline"] for x in lines if "pipeline" in x)
    assert (pl["schedule"], pl["pp"], pl["micro_batches"]) == ("1f1b", 4, 4)
    assert pl["bubble_fraction"] == "3/7" and len(pl["stages"]) == 4
    assert [s["micro_batches_held"] for s in pl["stages"]] == [4, 3, 2, 1]
    assert pl["p2p_bytes_per_step"]["total"] == 2 * 3 * 4 * 1 * 32 * 64 * 4
    first = lines[0]  # the ZeRO records describe the stage with the highest peak
    assert first["stage"] == max(pl["stages"], key=lambda s: s["peak_bytes"])["stage"]


# -- docs/pipeline-parallelism.md, "What a rank costs" --------------------------------------

DOC = pathlib.Path(ROOT) / "docs" / "pipeline-parallelism.md"
COMMAND = "$ python scripts/estimate_memory.py "


def _cost_blocks() -> list[tuple[list[str], str]]:
    """(arguments, printed text) of each estimate_memory.py block in the doc's section."""
    text = DOC.read_text(encoding="utf-8")
    section = text[text.index("\n## What a rank costs\n"):]
    section = section[:section.index("\n## ", 1)]
    blocks = re.findall(r"```text\n(.*?)```", section, re.S)
    return [(shlex.split(b.split("\n", 1)[0][len(COMMAND):]), b.split("\n", 1)[1])
            for b in blocks if b.startswith(COMMAND)]


def test_the_docs_worked_example_is_what_the_estimator_prints(capsys):
    blocks = _cost_blocks()
    assert len(blocks) == 1
    script = script_module("estimate_memory")
    for args, printed in blocks:
        assert script.main(args) == 0
        assert capsys.readouterr().out == printed, "docs/pipeline-parallelism.md"


def _records(script, args: list[str]) -> list[dict]:
    out = io.StringIO()
    with redirect_stdout(out):
        assert script.main(args) == 0
    return [json.loads(x) for x in out.getvalue().splitlines()]


def test_the_worked_example_meets_the_docs_formulas():
    """The cost tables' formulas on the example's stage 0 (bf16, fp32 gradients: e_p 2,
    e_g 4, K 12; N 8, m 8, f 7/8); at ZeRO 3 the default's one gather a step with the
    whole stage held, and --pipeline-reshard-after-micro-batch's 2m gathers with the
    stage's root unit and two blocks whole."""
    (args, _), = _cost_blocks()
    script = script_module("estimate_memory")
    args = [a for a in args if a not in ("--format", "text")]
    lines = _records(script, args)
    zero = {r["zero_stage"]: r for r in lines if "selected" in r}
    pl = next(r["pipeline"] for r in lines if "pipeline" in r)
    psi, n, m, f = zero[1]["params_per_stage"][0], 8, 8, Fraction(7, 8)
    assert zero[1]["stage"] == 0 and psi == zero[1]["params_per_tp_rank"] == 409_366_528
    sh = Fraction(psi, n)
    for stage, (params, grads) in enumerate([(2 * psi, 4 * psi), (2 * psi, 4 * psi),
                                             (2 * psi, 4 * sh), (2 * sh, 4 * sh)]):
        optim = 12 * (psi if stage == 0 else sh)
        assert zero[stage]["model_states"] == {"params": params, "grads": grads,
                                               "optimizer": optim,
                                               "total": params + grads + optim}
    gather = 2 * psi * f
    dp = {0: {"all_reduce": 2 * 4 * psi * f}, 1: {"reduce_scatter": 4 * psi * f,
                                                  "all_gather": gather},
          2: {"reduce_scatter": m * 4 * psi * f, "all_gather": gather},
          3: {"reduce_scatter": m * 4 * psi * f, "all_gather": gather}}  # held
    for stage, kinds in dp.items():
        traffic = zero[stage]["traffic_bytes_per_step"]
        assert {k: traffic[k] for k in kinds} == kinds
        assert traffic["total"] == sum(kinds.values())
    model = build_config(parse_args(["--num-layers", "24", "--hidden-size", "2048",
                                     "--num-attention-heads", "16", "--seq-length", "2048",
                                     "--micro-batch-size", "1"]), 1).model
    model = model.with_vocab_size(50257)
    root, block = model.stage_parameters(1, 0, True, False), model.block_parameters(1)
    assert zero[3]["buffers"]["gathered"] == 2 * psi  # the whole stage, held
    rungs = [r for r in lines if "offload_rung" in r and r["param"]]
    assert len(rungs) == 3  # ladders 3-5: the shard goes up, and comes off disk, once
    for r in rungs:
        assert r["pcie_bytes_per_step"]["param_gathers_up"] == 2 * sh
        assert r["disk_bytes_per_step"]["param_read"] == (2 * sh if r["param"] == "nvme"
                                                          else 0)
    reshard = _records(script, args + ["--zero-stage", "3",
                                       "--pipeline-reshard-after-micro-batch"])
    z3 = next(r for r in reshard if r.get("zero_stage") == 3 and "selected" in r)
    assert z3["stage"] == 0
    assert z3["traffic_bytes_per_step"]["all_gather"] == 2 * m * gather
    assert z3["buffers"]["gathered"] == 2 * (root + 2 * block) < 2 * psi
    message = 1 * 2048 * 2048 * 2
    assert pl["p2p_bytes_per_step"]["ranks"] == [8 * message, 16 * message, 16 * message,
                                                 8 * message]
    for s in pl["stages"]:  # H_r (A_s + M), no M on the last stage
        acts, held = s["activations"], 4 - s["stage"]
        assert s["micro_batches_held"] == held
        out = message if s["stage"] < 3 else 0
        assert acts["layers"] + acts["head"] + acts["outputs"] == held * (
            acts["per_micro_batch"][0] + out)


@pytest.mark.parametrize("reshard", [False, True])
def test_zero3_under_a_pipeline_is_what_the_doc_measured(reshard):
    """docs/pipeline-parallelism.md, "ZeRO-3's gathers under a schedule": PP 2 x DP 2,
    ZeRO 3, 8 layers of hidden size 32, fp32, m = 4 (384-token untied vocabulary): each
    stage's all-gather bytes a step and its peak held parameters (shard + gathered), as
    measured on the ranks, by default and with --pipeline-reshard-after-micro-batch."""
    flags = ["--num-layers", "8", "--hidden-size", "32", "--num-attention-heads", "4",
             "--seq-length", "32", "--micro-batch-size", "1", "--global-batch-size", "8",
             "--pipeline-model-parallel-size", "2", "--zero-stage", "3",
             "--untie-embeddings-and-output-weights"]
    flags += ["--pipeline-reshard-after-micro-batch"] * reshard
    w = workload(build_config(parse_args(flags), 4, plan_only=True), 384)
    assert (w.dp, w.micro_batches, w.holds_stage) == (2, 4, not reshard)
    measured = {False: [(256_512, 128_256, 384_768), (252_672, 126_336, 379_008)],
                True: [(256_512, 1_026_048, 283_136), (252_672, 1_010_688, 277_376)]}
    for stage, (p, gathered, held) in enumerate(measured[reshard]):
        ws = replace(w, stage=stage)
        shard = model_state_bytes(ws.psi, ws.shard_ranks, 3, ws.params_dtype)["params"]
        assert 4 * ws.psi == p
        assert traffic_bytes(ws)["all_gather"] == gathered
        assert shard + buffer_bytes(ws)["gathered"] == held


# -- the bubble with each stage's times from its FLOPs ----------------------------------------

def _planned(flags: list[str], world: int, vocab: int) -> Workload:
    """The Workload of a command line, split as the run splits it (hybrid/config/stage_split.py)."""
    return workload(build_config(parse_args(flags), world, plan_only=True), vocab)


# Hidden 64, sequence 64: one layer's forward is M + A = 24 C^2 + 4 T C = 114,688 FLOPs a
# token, the head's 2 C V: one layer's at V = 896, three layers' at V = 2688 (both already
# multiples of 128, so unpadded). Stage 0: the embedding and layers 0-1; stage 1: layer 2
# and the head.
SMALL = ["--num-layers", "3", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "64", "--micro-batch-size", "1", "--global-batch-size", "3",
         "--pipeline-model-parallel-size", "2", "--decoder-first-pipeline-num-layers", "2"]


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_the_flop_weighted_bubble_by_hand(schedule):
    """p = 2, m = 3, a layer's forward u = 114,688 FLOPs a token and a whole backward 2u
    (a matmul's input and weight gradients each cost its forward; the head's too).

    The head one layer's worth (V = 896): both stages compute 2u forward and 4u backward,
    so the weighted play is the equal one scaled: the bubble is (p-1)/(m+p-1) = 1/4.

    The head three layers' worth (V = 2688): stage 0 F0 = 2u, B0 = 4u; stage 1 F1 = 4u,
    B1 = 8u, the bottleneck. Under 1F1B rank 1 starts when F0 of micro-batch 0 ends (2u)
    and then computes F1 B1 three times without waiting (stage 0's next forward is ready
    long before), ending at 2 + 3 x 12 = 38u; rank 0's last backward needs that gradient:
    step T = F0 + m (F1 + B1) + B0 = 2 + 36 + 4 = 42u. GPipe's order ends the same: rank
    1's forwards end at 14u, its backwards at 38u. Busy: rank 0 m (F0 + B0) = 18u, rank 1
    36u; idle (42 - 18) + (42 - 36) = 30u of 2 x 42: bubble 30/84 = 5/14, where equal
    stages say 1/4."""
    even = _planned(SMALL + ["--pipeline-schedule", schedule], 2, 896)
    assert (even.stage_layers, even.micro_batches) == ((2, 1), 3)
    u = 24 * 64 ** 2 + 4 * 64 * 64
    f = stage_flops(even)
    assert [(x.forward, x.input_grad + x.weight_grad) for x in f] == [(2 * u, 4 * u)] * 2
    assert pipeline_bubble(even) == weighted_bubble(even) == Fraction(1, 4)
    heavy = _planned(SMALL + ["--pipeline-schedule", schedule], 2, 2688)
    f = stage_flops(heavy)
    assert [(x.forward, x.input_grad + x.weight_grad) for x in f] == [(2 * u, 4 * u),
                                                                      (4 * u, 8 * u)]
    sim = weighted_simulation(heavy)
    assert sim.step_time == 42 * u and sim.busy == (18 * u, 36 * u)
    assert weighted_bubble(heavy) == Fraction(5, 14) > pipeline_bubble(heavy) == Fraction(1, 4)


def test_zb_h1_weighs_the_halves_apart():
    """The attention scores have no weights: their backward is all input gradient. So
    under ZB-H1 stage 1 of the V = 896 case above (one layer + a head of one layer's
    FLOPs) has a lighter input half than stage 0 (two layers), and the weighted bubble
    differs from the equal one (1/10) though each stage's forward and whole backward
    are the same."""
    w = _planned(SMALL + ["--pipeline-schedule", "zb_h1"], 2, 896)
    a = 4 * 64 * 64
    f = stage_flops(w)
    assert f[0].input_grad - f[1].input_grad == a == f[1].weight_grad - f[0].weight_grad
    assert (pipeline_bubble(w), weighted_bubble(w)) == (Fraction(1, 10), Fraction(8, 71))


# GPT-2's vocabulary (50,304 rows padded) at hidden 256: the head's forward, 2 C V =
# 25.8M FLOPs a token, is 15.1 layers' (24 C^2 + 4 T C = 1.70M at T = 128).
GPT2 = ["--hidden-size", "256", "--num-attention-heads", "4", "--seq-length", "128",
        "--micro-batch-size", "1", "--global-batch-size", "8"]


def test_a_last_stage_holding_the_head_idles_the_pipeline_more():
    """PP 4, 8 layers (2 a stage), m = 8, 1F1B: the last stage's 2 layers and head are
    17.1 layers' FLOPs against 2 on the others (2.96x the mean stage): the weighted
    bubble is 1257/1858 = 0.677, where equal stages say 3/11 = 0.273."""
    w = _planned(GPT2 + ["--num-layers", "8", "--pipeline-model-parallel-size", "4"], 4, 50257)
    assert (w.stage_layers, w.micro_batches) == ((2, 2, 2, 2), 8)
    assert relative_flops(w) == (Fraction(208, 601),) * 3 + (Fraction(1780, 601),)
    assert pipeline_bubble(w) == Fraction(3, 11)
    assert weighted_bubble(w) == Fraction(1257, 1858)


def test_moving_layers_off_the_last_stage_lowers_the_weighted_bubble():
    """The run's split flags reach the estimate: the same 7 layers at PP 4 (m = 8) as
    --account-for-loss-in-pipeline-split's [2, 2, 2, 1] and
    --decoder-first-pipeline-num-layers 1's [1, 2, 2, 2] have one equal-stage bubble,
    3/11, but the weighted one is lower with the layer off the last stage: 0.672 against
    0.688. And 8 layers at PP 2: even [4, 4] 0.411, --decoder-last-pipeline-num-layers 2
    (or the layout Etttttt|ttL, the same split) [6, 2] 0.353; equal stages say 1/9 for
    all three. (The head is 15 layers' FLOPs here: --account-for-loss counts it as one.)"""
    seven = GPT2 + ["--num-layers", "7", "--pipeline-model-parallel-size", "4"]
    loss_off = _planned(seven + ["--account-for-loss-in-pipeline-split"], 4, 50257)
    first_off = _planned(seven + ["--decoder-first-pipeline-num-layers", "1"], 4, 50257)
    assert (loss_off.stage_layers, first_off.stage_layers) == ((2, 2, 2, 1), (1, 2, 2, 2))
    assert pipeline_bubble(loss_off) == pipeline_bubble(first_off) == Fraction(3, 11)
    assert weighted_bubble(loss_off) == Fraction(1179, 1754)
    assert weighted_bubble(first_off) == Fraction(254, 369)
    eight = GPT2 + ["--num-layers", "8", "--pipeline-model-parallel-size", "2"]
    even = _planned(eight, 2, 50257)
    last = _planned(eight + ["--decoder-last-pipeline-num-layers", "2"], 2, 50257)
    layout = _planned(eight + ["--pipeline-model-parallel-layout", "Etttttt|ttL"], 2, 50257)
    assert (even.stage_layers, last.stage_layers, layout.stage_layers) == ((4, 4), (6, 2),
                                                                           (6, 2))
    assert pipeline_bubble(even) == pipeline_bubble(last) == Fraction(1, 9)
    assert weighted_bubble(even) == Fraction(419, 1020)
    assert weighted_bubble(last) == weighted_bubble(layout) == Fraction(328, 929)


def test_the_stage_flops_are_the_models_count():
    """Each virtual stage's forward + input + weight FLOPs, summed over a rank's chunks,
    are ModelConfig.stage_flops_per_token of the rank (what the training log's TFLOP/s
    reads), and all stages' the model's flops_per_token: interleaved, TP 2 (the head
    over the vocabulary padded for TP 2), uneven chunks from
    --decoder-first/last-pipeline-num-layers; an empty chunk left by the layout
    computes nothing, and is played as 1 FLOP. Recompute adds its rerun to the input
    half only."""
    flags = MODEL + ["--num-layers", "12", "--pipeline-model-parallel-size", "2",
                     "--virtual-pipeline-model-parallel-size", "2",
                     "--decoder-first-pipeline-num-layers", "4",
                     "--tensor-model-parallel-size", "2", "--global-batch-size", "4"]
    w = _planned(flags + ["--pipeline-schedule", "interleaved_1f1b"], 4, 50257)
    assert piece_layers(w) == (2, 4, 2, 4)
    f = stage_flops(w)
    for rank in range(2):
        assert f[rank].total + f[rank + 2].total == w.model.stage_flops_per_token(
            2, w.stage_layers[rank], last=rank == 1)
    assert sum(x.total for x in f) == w.model.flops_per_token(2)
    assert sum(relative_flops(w)) == 4
    layer = w.model.stage_flops_per_token(2, 1, last=False) // 3
    full = _planned(flags + ["--recompute-granularity", "full", "--recompute-method", "block",
                             "--recompute-num-layers", "3"], 4, 50257)
    for x, y, n in zip(f, stage_flops(full), piece_layers(w)):
        assert (y.forward, y.weight_grad) == (x.forward, x.weight_grad)
        assert y.input_grad - x.input_grad == min(n, 3) * layer
    empty = _planned(MODEL + ["--num-layers", "2", "--pipeline-model-parallel-size", "3",
                              "--pipeline-model-parallel-layout", "Et||tL",
                              "--global-batch-size", "3"], 3, 257)
    f = stage_flops(empty)
    assert f[1] == StageFlops(0, 0, 0)
    times = flop_times(empty)
    assert times.of(Kind.FORWARD, 1) == times.of(Kind.BACKWARD, 1) / 2 == 1
    assert Fraction(0) < weighted_bubble(empty) < 1


BENCH = {"gpipe": (1, Fraction(45, 181), 0.25), "1f1b": (1, Fraction(45, 181), 0.25),
         "zb_h1": (1, Fraction(109, 517), 0.21),
         "interleaved_1f1b": (2, Fraction(77, 349), 0.23)}


@pytest.mark.parametrize("schedule", list(BENCH))
def test_the_flops_predict_the_cpu_benchs_bubble(schedule):
    """benchmarks/bench_pipeline.py's model (8 layers x 256, sequence 128, vocabulary 8192
    untied, PP 2, m = 8): the head is 2.46 layers' FLOPs, the last stage 1.62x stage 0
    (the bench measured 1.58x; its last chunk of four 2.23x, measured 2.2x). The weighted
    bubble is within 0.02 of the bubble measured there (docs/pipeline-parallelism.md,
    "Measured"), where equal stages say a third to a fifth of it."""
    v, want, measured = BENCH[schedule]
    model = ModelConfig(vocab_size=8192, num_layers=8, hidden_size=256, num_attention_heads=4,
                        seq_length=128, max_position_embeddings=128,
                        untie_embeddings_and_output_weights=True)
    per = 4 // v
    w = Workload(model=model, micro_batch_size=4, pp=2, micro_batches=8, stage_layers=(4, 4),
                 chunk_layers=((per,) * v,) * 2, schedule=schedule)
    f = stage_flops(w)
    assert round(f[-1].total / f[0].total, 2) == (1.62 if v == 1 else 2.23)
    assert weighted_bubble(w) == want and abs(float(want) - measured) < 0.02
    assert pipeline_bubble(w) < measured / 2


def test_estimate_memory_prints_both_bubbles(capsys):
    script = script_module("estimate_memory")
    args = GPT2 + ["--num-layers", "8", "--pipeline-model-parallel-size", "4",
                   "--world-size", "4", "--tokenizer-type", "gpt2bpe"]
    assert script.main(args) == 0
    pl = next(r["pipeline"] for r in map(json.loads, capsys.readouterr().out.splitlines())
              if "pipeline" in r)
    assert (pl["bubble_fraction"], pl["bubble_flop_weighted_fraction"]) == ("3/11", "1257/1858")
    assert pl["bubble_flop_weighted"] == 1257 / 1858
    assert pl["relative_flops"] == [0.3461] * 3 + [2.9617]
    assert script.main(args + ["--format", "text"]) == 0
    assert ("predicted bubble 3/11 = 0.2727 (equal stages), 0.6765 (stages weighted by their "
            "FLOPs: 0.35, 0.35, 0.35, 2.96 of the mean)") in capsys.readouterr().out
