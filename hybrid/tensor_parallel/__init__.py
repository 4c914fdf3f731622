"""Tensor (intra-layer) model parallelism: Megatron's layers and the ops joining them.

* :mod:`.layers`            Megatron's tensor-parallel layers, each taking the TP group
* :mod:`.mappings`          the communication ops that join TP regions, as autograd Functions
* :mod:`.column_linear`     the column-parallel matmul with its TP collective overlapped in
                            backward
* :mod:`.cross_entropy`     cross-entropy over logits split by vocabulary across TP ranks
* :mod:`.sharding`          which slice of a full tensor a TP rank holds (:class:`ShardSpec`)
* :mod:`.init`              layout-independent initialization that can draw any slice of a
                            parameter alone
* :mod:`.random`            RNG for dropout under tensor parallelism
* :mod:`.weight_grad`       deferred weight gradients: the linears' half of a zero-bubble
                            pipeline's split backward
* :mod:`.context_parallel`  context parallelism's arithmetic: which tokens a CP rank holds,
                            which blocks of causal attention it computes
* :mod:`.cp_attention`      ``ContextParallel``: what a model needs to run on one CP rank's
                            share of each sequence
* :mod:`.ring_attention`    causal attention over a sequence split across the CP group, block
                            by block
* :mod:`.ulysses_attention` all-to-all context parallelism (DeepSpeed-Ulysses): the sequence
                            split traded for a head split around attention
* :mod:`.experts`           an MoE layer's experts split over the EP group: assignments to
                            their expert's rank by all-to-all, and back (and over ETP)
* :mod:`.token_split`       the ranks holding parts of one micro-batch's tokens (SP, CP): the
                            MoE layers' statistics summed or gathered over them
"""

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
