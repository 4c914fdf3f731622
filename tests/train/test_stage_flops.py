"""TFLOP/s per rank counts only the rank's own pipeline stage: the stage FLOPs per token
(its chunks' layers, the output layer on the stage with the loss) sum over the pipeline
ranks to the whole model's, for even, uneven, interleaved and layout splits."""

import pytest

from hybrid.config.model import ModelConfig
from hybrid.config.stage_split import split_layers
from hybrid.train.metrics import stage_flops_per_token

SPLITS = {"even": dict(num_layers=8, pp=4),
          "uneven": dict(num_layers=30, pp=4, first=6, last=8),
          "interleaved": dict(num_layers=8, pp=2, vpp=2),
          "layout": dict(num_layers=5, pp=2, layout="Et|tt|t|tL")}


@pytest.mark.parametrize("name", list(SPLITS))
@pytest.mark.parametrize("tp", [1, 2])
def test_stage_flops_sum_to_the_whole_model(name, tp):
    kw = dict(SPLITS[name])
    model = ModelConfig(num_layers=kw["num_layers"], hidden_size=64, num_attention_heads=4,
                        max_position_embeddings=32, seq_length=32).with_vocab_size(1000)
    split = split_layers(**kw)
    per_rank = [stage_flops_per_token(model, tp, split, r) for r in range(split.pp)]
    assert sum(per_rank) == model.flops_per_token(tp)
    head = 3 * 2 * 64 * model.padded_vocab_size(tp)  # the output layer's, on the last rank
    block = (model.flops_per_token(tp) - head) / kw["num_layers"]
    for r, f in enumerate(per_rank):
        assert f == split.rank_layers(r) * block + head * (r == split.pp - 1), (name, r)
    assert stage_flops_per_token(model, tp, None, 0) == model.flops_per_token(tp)  # PP 1
