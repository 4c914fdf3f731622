"""A diagonal of the pipeline's proof grid (tests/pipeline/proof_grid.py) in the suite:
every feature once, the schedules taking turns, so each schedule meets three or four
features at PP 4 (one or two layers a stage, tied embeddings across the first and last
stage) and each cell trains, evaluates and is held to its PP 1 reference within the
grid's tolerance. The whole grid (60 cells) is ``python -m tests.pipeline.proof_grid``."""

from tests.pipeline.proof_grid import FEATURES, LOOSER, SCHEDULES, TOLERANCE, Cell, cells, run


def test_the_grid_names_every_schedule_with_every_feature():
    grid = cells()
    assert len(grid) == len(SCHEDULES) * len(FEATURES) == len(set(grid))
    assert cells(["nvme"]) == [Cell(s, "nvme") for s in SCHEDULES]


def test_a_diagonal_of_the_grid_follows_one_stage(tmp_path):
    diagonal = [Cell(SCHEDULES[i % len(SCHEDULES)], f) for i, f in enumerate(FEATURES)]
    results = run(diagonal, str(tmp_path))
    assert len(results) == len(FEATURES)
    assert {r["schedule"] for r in results} == set(SCHEDULES)
    for r in results:
        worst = max(r["loss"], r["grad_norm"], r["valid_loss"])
        assert r["ok"] and worst <= LOOSER.get(r["feature"], TOLERANCE), r
