"""Part of the MoE layout grid (tests/models/moe_grid.py) in the suite: :data:`DIAGONAL`,
nine cells (ZeRO 3 at DP 2, ZB-H1 at PP 2, full recompute, a capacity that drops, the
sigmoid router's expert bias; experts over EP 2 folded over TP 2 with drops at ZeRO 0,
at DP 4 ZeRO 3, at PP 2 with ZB-H1, and EP 4 over TP 2 x CP 2), each held to its
one-process reference: losses, grad norms, the validation loss and each MoE layer's aux
and z losses within the grid's tolerance, its token counts and drops the same. The
whole grid is ``python -m tests.models.moe_grid``.

Here every run (the references too) trains 2 steps, not the grid's 3, and evaluates at the
second: the second step already runs on the first's Adam moments and expert bias, and a
third adds no layout case, only a second of the suite's time. The split keeps no test
documents, so a finished run skips the test-split evaluation no assertion reads.

The two cells whose attention splits the tokens over TP (with SP) and CP leave DP 1, so
a rank ran all 4 micro-batches of a step, each one ~100 collectives of the TP group
(sequence parallelism's gathers and reductions, one all-reduce per norm and bias
gradient, the MoE losses' sums over the token split): half their collectives are gone
at a global batch of 4: 2 micro-batches a step, still accumulated over, each of 2
sequences as before (as many tokens a micro-batch: the capacity and its drops decided on
the same numbers). Their reference runs the same flags (one more one-process run, a
fifth of a second)."""

from tests.models.moe_grid import CELLS, DIAGONAL, TOLERANCE, run

SHORT = ("--train-iters", "2", "--eval-interval", "2", "--split", "949,50,0")
# the DP 1 cells' own global batch (the one in moe_grid.MOE is 8)
DP1 = {name: ("--global-batch-size", "4") for name in ("tp2_ep2_capacity", "tp2_cp2_ep4")}


def test_the_diagonal_is_cells_of_the_grid():
    assert set(DIAGONAL) <= set(CELLS) and set(DP1) <= set(DIAGONAL)


def test_the_diagonal_trains_as_one_process(tmp_path):
    results = run(list(DIAGONAL), str(tmp_path), common=SHORT, extra=DP1)
    assert [r["cell"] for r in results] == list(DIAGONAL)
    for r in results:
        worst = max(r["loss"], r["grad_norm"], r["valid_loss"], r["moe_losses"])
        assert r["ok"] and worst <= TOLERANCE and r["moe_counts_differing"] == 0, r
