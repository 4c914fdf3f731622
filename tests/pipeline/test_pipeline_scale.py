"""Issue 40's scale check: one process as the last rank of a 1,024-rank world (torch's fake
process group: collectives and sends return at once), PP 8 x TP 8 x DP 16, builds its
groups and its stage's model under ZeRO and takes a pipeline step; its model-state bytes
are the estimator's to the byte, and so are the p2p bytes the step sends. The same rank
of world 64 (DP 1) for comparison. Timings are the bench's
(``python -m benchmarks.bench_pipeline_scale``), not asserted here."""

import math

import pytest
import torch.distributed as dist

from benchmarks.bench_pipeline_scale import last_rank


@pytest.mark.parametrize("world,zero_stage", [(1024, 1), (1024, 3), (64, 1)])
def test_the_last_rank_builds_and_steps_with_the_estimators_bytes(world, zero_stage):
    r = last_rank(world, zero_stage)
    assert not dist.is_initialized()  # left as found
    assert (r["rank"], r["pp_rank"], r["tp_rank"], r["dp"], r["is_last_stage"]) == (
        world - 1, 7, 7, world // 64, True)
    assert not r["skipped"] and all(math.isfinite(x) for x in r["losses"])
    # no ZeRO padding at these sizes, so the formula is exact: the stage's parameters
    # (one layer, the head's copy of the tied embedding, the final norm) ...
    assert r["params"] == r["params_padded"] == r["params_estimated"]
    # ... and the bytes of parameters, gradients and optimizer states on this rank
    assert r["model_state_bytes"] == r["model_state_bytes_estimated"]
    # the step sent 8 input gradients of (1, 16, 128) fp32 back to stage 6
    assert r["p2p_bytes_per_step"] == [r["p2p_bytes_estimated"]] == [8 * 16 * 128 * 4]
