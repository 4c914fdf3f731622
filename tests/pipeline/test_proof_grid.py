"""Part of the pipeline's proof grid (tests/pipeline/proof_grid.py) in the suite: four
cells at PP 4 (one or two layers a stage, tied embeddings across the first and last
stage), each schedule once, each cell trained, evaluated and held to its PP 1 reference
within the grid's tolerance. Several features left out here run at PP 2 in other tests
(ZeRO 1 and resharding, partitioned and selective recompute, the host tier at ZeRO 2,
bf16: tests/scripts/test_pretrain_gpt.py, test_pipeline_precision.py); every cell is in
the whole grid (60 cells), ``python -m tests.pipeline.proof_grid``.

Here every run (the references too) trains 2 steps, not the grid's 3, and evaluates after
the second: the first step's loss and norm check the schedule's forward and backward,
the second's run on parameters the first update wrote on every stage, and the validation
loss on those of the second update, which used the first's Adam moments; a third step
adds no case, only a pipeline's worth of collective rounds on 8 ranks over 2 cores.
The split keeps no test documents, so a finished run skips the test-split evaluation no
assertion reads."""

from tests.pipeline.proof_grid import FEATURES, LOOSER, SCHEDULES, TOLERANCE, Cell, cells, run

SHORT = ("--train-iters", "2", "--eval-interval", "2", "--split", "949,50,0")

SUITE = [Cell("gpipe", "cp2"), Cell("1f1b", "zero2"), Cell("zb_h1", "fp16"),
         Cell("interleaved", "zero3")]


def test_the_grid_names_every_schedule_with_every_feature():
    grid = cells()
    assert len(grid) == len(SCHEDULES) * len(FEATURES) == len(set(grid))
    assert cells(["nvme"]) == [Cell(s, "nvme") for s in SCHEDULES]
    assert set(SUITE) <= set(grid)


def test_four_cells_of_the_grid_follow_one_stage(tmp_path):
    from hybrid.testing.pool import close_pools
    try:
        results = run(SUITE, str(tmp_path), common=SHORT)
    finally:
        close_pools(8)  # (besides the Mixtral script test, no test runs 8 ranks: memory back)
    assert len(results) == len(SUITE)
    assert sorted(r["schedule"] for r in results) == sorted(SCHEDULES)
    for r in results:
        worst = max(r["loss"], r["grad_norm"], r["valid_loss"])
        assert r["ok"] and worst <= LOOSER.get(r["feature"], TOLERANCE), r
