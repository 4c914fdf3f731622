"""Issue 47's scale check: one process as the last rank of a 1,024-rank MoE run (torch's
fake process group), DeepSeek-V3's layout, EP 64 x PP 16 (DP 64, one expert an EP rank):
it builds its groups, expert ones included, and its stage's MoE layer under ZeRO and
takes a 1F1B step over 16 micro-batches; its model-state bytes are the estimator's to the
byte, and the all-to-all bytes the step sends are the estimator's uniform-routing
expectation within 3% (the routed truth of one batch: rows to other ranks' experts, and
the counts exchanged first). The same rank of world 64 (EP 4) for comparison. Timings
are the bench's (``python -m benchmarks.bench_moe_scale``), not asserted here."""

import math

import pytest
import torch.distributed as dist

from benchmarks.bench_moe_scale import last_rank


@pytest.mark.parametrize("world,zero_stage", [(1024, 1), (1024, 3), (64, 1)])
def test_the_last_rank_of_an_ep_64_pp_16_run_builds_and_steps(world, zero_stage):
    r = last_rank(world, zero_stage)
    assert not dist.is_initialized()  # left as found
    ep = world // 16
    assert (r["rank"], r["pp_rank"], r["dp"], r["ep"], r["ep_rank"], r["edp"]) == (
        world - 1, 15, ep, ep, ep - 1, 1)
    assert r["experts"] == ep and r["local_experts"] == [(1, 128, 128)]
    assert r["micro_batches"] == 16
    assert not r["skipped"] and all(math.isfinite(x) for x in r["losses"])
    assert r["model_state_bytes"] == r["model_state_bytes_estimated"]
    got, want = r["all_to_all_bytes_per_step"][0], r["all_to_all_bytes_estimated"]
    assert abs(got - want) <= 0.03 * want, (got, want)
