"""Building blocks for model authors."""

from tandem.core.layers.attention import Attention
from tandem.core.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from tandem.core.layers.linear import (
    ColumnParallelLinear,
    LinearBase,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from tandem.core.layers.parallel_state import TensorParallelGroup, get_tp_group, tensor_parallel

__all__ = [
    "Attention",
    "ColumnParallelLinear",
    "LinearBase",
    "MergedColumnParallelLinear",
    "ParallelLMHead",
    "QKVParallelLinear",
    "RowParallelLinear",
    "TensorParallelGroup",
    "VocabParallelEmbedding",
    "get_tp_group",
    "tensor_parallel",
]
