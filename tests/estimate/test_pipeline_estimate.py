"""The estimator with PP (a first cut): each stage's parameters, the run's figures those of
the stage with the most, and a bad split refused by the same message as the launcher's."""

import json

import pytest

from hybrid.config import build_config, parse_args
from hybrid.estimate.workload import workload
from tests.helpers.launch import script_module

MODEL = ["--num-layers", "8", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "32", "--micro-batch-size", "1"]


@pytest.mark.parametrize("untie", [False, True])
def test_the_stages_hold_the_model_once_and_a_tied_embedding_twice(untie):
    flags = MODEL + ["--untie-embeddings-and-output-weights"] * untie
    model = build_config(parse_args(flags), 1).model.with_vocab_size(257)
    stages = [model.stage_parameters(2, 2, s == 0, s == 3) for s in range(4)]
    tied_copy = 0 if untie else model.padded_vocab_size(2) * 64 // 2
    assert sum(stages) == model.num_parameters(2) + tied_copy
    assert model.stage_parameters(2, 8, True, True) == model.num_parameters(2)  # PP 1
    assert stages[1] == stages[2] == 2 * model.block_parameters(2)


def test_the_workload_describes_the_heaviest_stage():
    cfg = build_config(parse_args(MODEL + ["--pipeline-model-parallel-size", "4",
                                           "--decoder-first-pipeline-num-layers", "1",
                                           "--decoder-last-pipeline-num-layers", "1"]),
                       8, plan_only=True)
    w = workload(cfg, 257)
    assert (w.pp, w.stage_layers, w.stage, w.dp) == (4, (1, 3, 3, 1), 0, 2)
    heavy = w.heaviest_stage()
    assert heavy.stage == 1 and heavy.psi == 3 * cfg.model.block_parameters(1)
    one = workload(build_config(parse_args(MODEL), 2), 257)
    assert one.psi == one.model.num_parameters(1) and one.heaviest_stage() == one


def test_estimate_memory_plans_a_pipeline_run(capsys):
    script = script_module("estimate_memory")
    assert script.main(MODEL + ["--pipeline-model-parallel-size", "2",
                                "--virtual-pipeline-model-parallel-size", "2",
                                "--global-batch-size", "4", "--world-size", "4"]) == 0
    first = json.loads(capsys.readouterr().out.splitlines()[0])
    assert (first["pp"], first["vpp"], first["dp"], first["layers_per_stage"]) == (2, 2, 2, [4, 4])
    assert first["params_per_tp_rank"] == max(first["params_per_stage"])
    with pytest.raises(SystemExit) as e:
        script.main(MODEL + ["--num-layers", "30", "--pipeline-model-parallel-size", "4",
                             "--world-size", "8"])
    assert e.value.code == 2
    assert ("--num-layers 30 is not divisible by --pipeline-model-parallel-size 4"
            in capsys.readouterr().err)
