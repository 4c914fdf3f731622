"""The estimator knows experts: with an MoE model's experts over EP, this rank's model
states are the dense parameters' over DP and its experts' (``1 / EP`` of them) over the
expert DP group, and its step's traffic adds the experts' reduction over that group and
the tokens' all-to-all. Held to what a run measures (its log line's ``model_state_bytes``
and ``comm_bytes``) at EP 2 of DP 4, ZeRO 1 and 3."""

import pytest

from hybrid.config import build_config, parse_args
from hybrid.estimate.memory import expert_exchange_bytes, peak_memory, traffic_bytes
from hybrid.estimate.workload import workload
from tests.helpers.launch import TINY, pretrain, read_json_log
from tests.models.moe_grid import MOE

EP = ["--expert-model-parallel-size", "2"]


@pytest.mark.parametrize("stage", [1, 3])
def test_expert_states_and_traffic_follow_the_run(tmp_path, stage):
    # (no persistent small units at stage 3: the formula shards every parameter)
    flags = [*TINY, *MOE, *EP, "--zero-stage", str(stage), "--train-iters", "1",
             "--zero-param-persistence-threshold", "0"]
    path = str(tmp_path / "log.jsonl")
    r = pretrain(4, [*flags, "--log-json", path])
    assert r.returncode == 0, r.stderr[-3000:]
    measured = read_json_log(path)[0]
    w = workload(build_config(parse_args(flags), 4), vocab_size=257, device="cpu")
    assert w.ep == 2 and w.expert_shard_ranks == 2 and w.expert_psi > 0
    est = peak_memory(w)["model_states"]
    got = measured["model_state_bytes"]["total"]
    assert abs(got - est) <= 1e-3 * est, (got, est)  # (units pad to a multiple of N)
    traffic = traffic_bytes(w)
    for kind in ("reduce_scatter", "all_gather"):
        assert abs(measured["comm_bytes"][kind] - traffic[kind]) <= 1e-3 * traffic[kind], kind
    # the tokens' exchange: an expectation under uniform routing, near the routed truth
    a2a = measured["comm_bytes"]["all_to_all"]
    assert traffic["ep_bytes_per_step"] == expert_exchange_bytes(w) == 131072
    assert abs(a2a - 131072) <= 0.05 * 131072, a2a


def test_without_ep_the_experts_are_dense_states():
    flags = [*TINY, *MOE, "--zero-stage", "1"]
    w = workload(build_config(parse_args(flags), 4), vocab_size=257, device="cpu")
    assert w.ep == 1 and w.expert_shard_ranks == w.shard_ranks == 4
    assert "ep_bytes_per_step" in traffic_bytes(w) and expert_exchange_bytes(w) == 0
