"""A sent tensor is let go once a later receive proves the peer took it (the executor's
[Note: releasing what was sent]): under 1F1B with 8 micro-batches no rank holds more
sends per peer than the p micro-batches in flight at any action (two at PP 2; the
first stage every one of the 8 until END without the schedule's lists), and every
schedule gives the same losses and gradients either way."""

import pytest
import torch

from hybrid.pipeline.actions import Kind
from hybrid.pipeline.executor import sends_received
from hybrid.pipeline.schedules import build_schedule
from tests.helpers.harness import run_ranks

M, SHAPE = 8, (2, 4, 8)


def _run(ps, name, v, release):
    from hybrid.pipeline import executor
    pp = ps.world_group
    p, r = pp.size, pp.rank
    stages = p * v
    schedule = build_schedule(name, p, M, v)
    g = torch.Generator().manual_seed(7)
    weights = {s: (1.0 + 0.1 * torch.randn(SHAPE[-1], generator=g)).requires_grad_()
               for s in range(stages)}
    data = [torch.randn(SHAPE, generator=g) for _ in range(M)]

    def forward(s, j, x):
        out = (data[j] if x is None else x) * weights[s]
        return out.pow(2).mean() / M if s == stages - 1 else torch.tanh(out)

    held: list[int] = []
    orig = executor._Run.do

    def do(self, a, sync):
        orig(self, a, sync)
        if a.kind is not Kind.END:
            held.append(max((len(h) for h in self.sends.values()), default=0))

    executor._Run.do = do
    try:
        losses = executor.run_actions(
            schedule.ranks[r], forward, {s: [weights[s]] for s in range(r, stages, p)}, pp,
            shape=SHAPE, dtype=torch.float32, device=torch.device("cpu"), stages=stages,
            peers=schedule.ranks if release else None)
    finally:
        executor._Run.do = orig
    return {"losses": {j: float(x) for j, x in losses.items()}, "held": max(held),
            "grads": {s: weights[s].grad.clone() for s in range(r, stages, p)}}


@pytest.mark.parametrize("name,p,v", [("1f1b", 2, 1), ("1f1b", 3, 1), ("gpipe", 2, 1),
                                      ("zb_h1", 3, 1), ("interleaved_1f1b", 2, 2)])
def test_sends_are_let_go_once_received_with_the_same_numbers(name, p, v):
    kept = run_ranks(_run, world_size=p, args=(name, v, False))
    freed = run_ranks(_run, world_size=p, args=(name, v, True))
    for a, b in zip(kept, freed):
        assert a["losses"] == b["losses"]
        for s, grad in a["grads"].items():
            assert torch.equal(grad, b["grads"][s]), (name, s)
    if name == "1f1b":
        assert kept[0]["held"] == M * v  # the first stage, its sends held until END
        # at most the micro-batches in flight, p, whatever m: two at PP 2
        assert all(res["held"] <= p for res in freed), [res["held"] for res in freed]
        assert p != 2 or [res["held"] for res in freed] == [2, 2]


def test_what_a_receive_proves_received():
    """1F1B at PP 2: when rank 0 receives micro-batch j's gradient, rank 1 had received
    activations 0..j; when rank 1 receives activation j, rank 0 had received the
    gradients of micro-batches 0..j-2."""
    ranks = build_schedule("1f1b", 2, M).ranks
    got0, got1 = sends_received(ranks, 0), sends_received(ranks, 1)
    assert [got0[a] for a in ranks[0] if a.kind is Kind.RECV_GRAD] == list(range(1, M + 1))
    assert [got1[a] for a in ranks[1] if a.kind is Kind.RECV_ACT] == [0] + list(range(M - 1))
