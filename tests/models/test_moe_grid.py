"""Part of the MoE layout grid (tests/models/moe_grid.py) in the suite: :data:`DIAGONAL`,
nine cells (ZeRO 3 at DP 2, ZB-H1 at PP 2, full recompute, a capacity that drops, the
sigmoid router's expert bias; experts over EP 2 folded over TP 2 with drops at ZeRO 0,
at DP 4 ZeRO 3, at PP 2 with ZB-H1, and EP 4 over TP 2 x CP 2), each held to its
one-process reference: losses, grad norms, the validation loss and each MoE layer's aux
and z losses within the grid's tolerance, its token counts and drops the same. The
whole grid is ``python -m tests.models.moe_grid``."""

from tests.models.moe_grid import CELLS, DIAGONAL, TOLERANCE, run


def test_the_diagonal_is_cells_of_the_grid():
    assert set(DIAGONAL) <= set(CELLS)


def test_the_diagonal_trains_as_one_process(tmp_path):
    results = run(list(DIAGONAL), str(tmp_path))
    assert [r["cell"] for r in results] == list(DIAGONAL)
    for r in results:
        worst = max(r["loss"], r["grad_norm"], r["valid_loss"], r["moe_losses"])
        assert r["ok"] and worst <= TOLERANCE and r["moe_counts_differing"] == 0, r
