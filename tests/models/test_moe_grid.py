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
documents, so a finished run skips the test-split evaluation no assertion reads."""

from tests.models.moe_grid import CELLS, DIAGONAL, TOLERANCE, run

SHORT = ("--train-iters", "2", "--eval-interval", "2", "--split", "949,50,0")


def test_the_diagonal_is_cells_of_the_grid():
    assert set(DIAGONAL) <= set(CELLS)


def test_the_diagonal_trains_as_one_process(tmp_path):
    results = run(list(DIAGONAL), str(tmp_path), common=SHORT)
    assert [r["cell"] for r in results] == list(DIAGONAL)
    for r in results:
        worst = max(r["loss"], r["grad_norm"], r["valid_loss"], r["moe_losses"])
        assert r["ok"] and worst <= TOLERANCE and r["moe_counts_differing"] == 0, r
