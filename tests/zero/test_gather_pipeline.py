"""Parameter all-gathers through two fixed staging buffers, asynchronous for any unit size."""

import torch

from hybrid.zero.gather_pipeline import GatherPipeline
from tests.helpers.harness import run_ranks

BUCKET = 1000


def _shard(rank, n, seed):
    return torch.arange(n, dtype=torch.float32) * 0.5 + 1000 * rank + seed


def _gathers(ps):
    dp = ps.dp_group
    pipe = GatherPipeline(dp, BUCKET, ps.device)
    sizes = [7, 2000, 250, 999, 4001]  # dp * S: fits, 8x the bucket, exactly 1000, ...
    out = {"rounds": []}
    buffers = None
    for rnd in range(2):
        ps.comm_stats.reset()
        fulls = [torch.full((dp.size * s,), -1.0) for s in sizes]
        jobs = [pipe.start(f, _shard(dp.rank, s, rnd)) for f, s in zip(fulls, sizes)]
        if rnd == 0:  # the large units did not complete inside start(): still in flight
            out["in_flight_after_start"] = len(pipe._inflight)
            out["left_after_start"] = jobs[1].left
        for j in reversed(jobs):  # out of order: each wait retires what came before it
            j.wait()
        pipe.wait_all()
        out["rounds"].append([f.clone() for f in fulls])
        out["max_message"] = max(ps.comm_stats.max_numel.values())
        ids = [id(b) for b in pipe._buffers]
        out["same_buffers"] = buffers is None or ids == buffers
        buffers = ids
    out["temp_bytes"] = pipe.temp_bytes()
    out["sizes"] = sizes
    return out


def test_pieces_are_exact_bounded_and_asynchronous():
    """DP4: every unit -- smaller than, equal to, many times the bucket -- gathers to
    the exact concatenation of the shards, rank-major; no message exceeds the
    bucket; the same two staging buffers serve every piece of every unit and
    round; and start() leaves a large unit's pieces in flight instead of
    gathering it on the spot."""
    res = run_ranks(_gathers, world_size=4, tp=1)
    for r in res:
        for rnd, fulls in enumerate(r["rounds"]):
            for f, s in zip(fulls, r["sizes"]):
                want = torch.cat([_shard(q, s, rnd) for q in range(4)])
                assert torch.equal(f, want), (rnd, s)
        assert r["max_message"] <= BUCKET
        assert r["same_buffers"]
        assert 0 < r["temp_bytes"] <= 2 * BUCKET * 4
        assert r["in_flight_after_start"] == 2 and r["left_after_start"] > 0
