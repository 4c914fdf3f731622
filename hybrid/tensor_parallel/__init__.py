"""Tensor (intra-layer) model parallelism: Megatron's layers and the ops joining them."""

from hybrid.tensor_parallel.column_linear import column_parallel_linear
from hybrid.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from hybrid.tensor_parallel.init import Init, InitValues, init_parameters
from hybrid.tensor_parallel.layers import (
                                           ColumnParallelLinear,
                                           LayerNorm,
                                           RMSNorm,
                                           RowParallelLinear,
                                           VocabParallelEmbedding,
)
from hybrid.tensor_parallel.mappings import (
                                           copy_to_tp,
                                           gather_from_sequence,
                                           gather_from_tp,
                                           reduce_from_tp,
                                           reduce_scatter_to_sequence,
                                           scatter_to_sequence,
                                           scatter_to_tp,
                                           sequence_parallel_param,
)
from hybrid.tensor_parallel.random import TPRNGTracker, seed_all
from hybrid.tensor_parallel.sharding import ShardSpec, full_shape, is_tp_split, shard_of, unshard

__all__ = [
    "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding",
    "vocab_parallel_cross_entropy", "copy_to_tp", "reduce_from_tp", "scatter_to_tp",
    "gather_from_tp", "scatter_to_sequence", "gather_from_sequence",
    "reduce_scatter_to_sequence", "sequence_parallel_param", "column_parallel_linear",
    "LayerNorm", "RMSNorm", "TPRNGTracker", "seed_all", "ShardSpec", "full_shape",
    "Init", "InitValues", "init_parameters", "is_tp_split", "shard_of", "unshard",
]
