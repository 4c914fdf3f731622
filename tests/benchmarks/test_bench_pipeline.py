"""benchmarks/bench_pipeline.py runs every schedule at PP 2 on a tiny GPT and prints its
records: the machine line, one record per schedule, the summary. What is exact is held
exactly, never a time: the p2p bytes a rank sends in a step are the formula's (one
``B * T * C`` fp32 tensor per micro-batch and stage boundary each way; interleaving's
two chunks per rank cross the ranks three times), the micro-batches whose saved
activations are alive at the peak, counted by the activation meter on the real run,
are the simulator's peak on every rank and stage (and 1F1B's ``p - s``), everything
saved is freed by the step's end, the timeline has one entry per action, and every
schedule computes the same losses. The records carry the simulator's prediction from
each stage's own measured times (and from their mean over the stages) beside the
measured idle fractions; only their shape is checked."""

from __future__ import annotations

import json

from benchmarks import bench_pipeline

M, B, T, C = 4, 2, 8, 32
ARGS = ["--layers", "4", "--hidden", str(C), "--heads", "4", "--seq", str(T), "--vocab", "64",
        "--micro-batch", str(B), "--m", str(M), "--warmup", "0", "--steps", "2"]
MESSAGE = B * T * C * 4  # one fp32 activation (or its gradient) between two stages


def test_the_bench_prints_its_records_and_the_exact_figures_hold(capsys):
    assert bench_pipeline.main(ARGS) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    head, *records, summary = lines
    assert head["bench"] == "pipeline" and {"torch", "python", "date"} <= set(head["machine"])
    by_name = {r["schedule"]: r for r in records}
    assert list(by_name) == list(bench_pipeline.SCHEDULES)
    held = {"gpipe": [M, M], "1f1b": [2, 1], "zb_h1": [2, 2],
            "interleaved_1f1b": [5, 3]}  # 2 (p - r - 1) + (v - 1) p + 1 chunks
    sent = {"gpipe": M * MESSAGE, "1f1b": M * MESSAGE, "zb_h1": M * MESSAGE,
            "interleaved_1f1b": 3 * M * MESSAGE}  # per rank
    for name, rec in by_name.items():
        v = rec["v"]
        assert (rec["p"], rec["m"], v) == (2, M, 2 if name == "interleaved_1f1b" else 1)
        assert len(rec["stages"]) == 2 * v and len(rec["ranks"]) == 2
        for r in rec["ranks"]:
            assert r["peak_held"] == r["peak_held_simulated"] == r["peak_held_formula"]
            assert r["peak_held"] == held[name][r["rank"]], name
            assert r["p2p_bytes_per_step"] == r["p2p_bytes_formula"] == sent[name], name
            assert r["p2p_bytes_same_every_step"] and r["activations_freed_after_step"]
            assert r["timeline_actions"] == r["list_actions"] > 0
            for key in ("idle_fraction", "idle_fraction_predicted",
                        "idle_fraction_predicted_uniform", "compute_s", "recv_wait_s"):
                assert isinstance(r[key], float), key
        if name == "1f1b":  # the rule: stage s holds p - s
            assert [r["peak_held"] for r in rec["ranks"]] == [2 - s for s in range(2)]
        for s in rec["stages"]:
            assert s["peak_held"] == s["peak_held_simulated"], (name, s["stage"])
            assert s["activation_bytes_per_microbatch"] > 0 and s["forward_s"] >= 0
            assert ("backward_input_s" in s) == (name == "zb_h1")
        # one stage per rank: the peak is that many micro-batches' saved bytes (not ZB-H1's:
        # a micro-batch waiting for its weight half holds its linears' inputs and output
        # gradients in the store, which the meter of saved tensors does not see)
        if v == 1 and name != "zb_h1":
            for r, s in zip(rec["ranks"], rec["stages"]):
                assert r["peak_activation_bytes"] == (
                    r["peak_held"] * s["activation_bytes_per_microbatch"])
        assert rec["p2p_bytes_per_step"] == rec["p2p_bytes_formula"] == (
            2 * (2 * v - 1) * M * MESSAGE)
        for key in ("step_s", "predicted_step_s", "predicted_step_s_uniform", "bubble",
                    "bubble_predicted", "bubble_predicted_uniform"):
            assert isinstance(rec[key], float), (name, key)
        # the prediction plays each virtual stage's own measured times, stage 0 first
        times = rec["times_for_simulator_s"]
        assert set(times) == {"forward", "backward_input", "backward_weight"}
        for kind, figures in times.items():
            assert len(figures) == 2 * v and all(x > 0 for x in figures), (name, kind)
        assert all(abs(x - s["forward_s"]) <= 1e-5  # (the stage rows round to 10 us)
                   for x, s in zip(times["forward"], rec["stages"])), name
    assert summary["summary"].keys() == by_name.keys()
    for name, row in summary["summary"].items():
        assert row["idle_fraction_predicted_per_rank"] == [
            r["idle_fraction_predicted"] for r in by_name[name]["ranks"]]
        assert len(row["idle_fraction_per_rank"]) == 2
    assert summary["all_exact"] and all(s["exact"] for s in summary["summary"].values())
    assert summary["loss_spread"] <= 1e-5  # the same model and data under every schedule
