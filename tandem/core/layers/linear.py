"""Linear layers split across tensor-parallel ranks (Megatron style).

- :class:`ColumnParallelLinear` splits the *output* features: rank ``r`` keeps rows
  ``[r * out / tp, (r + 1) * out / tp)`` of the weight (and of the bias) and returns
  its slice of the output; concatenating the ranks' outputs gives the full one.
- :class:`RowParallelLinear` splits the *input* features: rank ``r`` keeps the same
  columns, takes its slice of the input (a column-parallel output) and returns a
  partial sum; the ranks' partial sums add up (``all_reduce``) to the full output.
  The bias is added once, on rank 0.
- :class:`MergedColumnParallelLinear` and :class:`QKVParallelLinear` are column-
  parallel layers fused from several checkpoint projections (``shard_id``): each
  rank holds its slice of every shard, back to back.

Weights are ``[out_features, in_features]`` as in ``nn.Linear``; with ``tp_size=1``
every layer computes exactly ``F.linear(x, weight, bias)``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tandem.core.layers.linear_kernels import DenseKernel, activate
from tandem.core.layers.parallel_state import TensorParallelGroup, divide, resolve_tp_group
from tandem.core.weight_loading import WeightLoaderModule, check_shape


class LinearBase(WeightLoaderModule):
    """This rank's ``weight`` ``[output_size, input_size]`` and optional ``bias`` ``[output_size]``."""

    def __init__(self, input_size: int, output_size: int, bias: bool, tp: TensorParallelGroup) -> None:
        super().__init__()
        self.tp = tp
        self.input_size, self.output_size = input_size, output_size
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
        else:
            self.register_parameter("bias", None)
        self.bind_weight_loaders()
        self.kernel = DenseKernel()
        # Per-request LoRA adapters (tandem.lora.layers.LinearLoRA), set by the worker's
        # adapter manager when enable_lora: ``lora.apply(y, x)`` adds the step's updates.
        self.lora = None

    def _gemm(self, x: torch.Tensor, bias: torch.Tensor | None, activation: str | None,
              residual: torch.Tensor | None = None) -> torch.Tensor:
        """The kernel's ``x W^T + bias``, plus the step's LoRA updates before the activation,
        plus ``residual`` (in the kernel's epilogue where it can)."""
        if self.lora is None or not self.lora.active:  # no adapter this step: the fused epilogues stay
            if residual is None:
                return self.kernel(self, x, bias, activation)
            return self.kernel(self, x, bias, activation, residual=residual)
        y = self.kernel(self, x, bias, None)
        self.lora.apply(y, x)
        y = activate(y, activation)
        return y if residual is None else residual + y

    def set_kernel(self, kernel) -> None:
        """Multiply with ``kernel`` from now on (``tandem.core.layers.linear_kernels``);
        a kernel other than dense holds its own copy of the weight, so the dense
        one is released."""
        self.kernel = kernel
        if not isinstance(kernel, DenseKernel):
            self.weight.data = torch.empty(0, dtype=self.weight.dtype, device=self.weight.device)

    @property
    def tp_size(self) -> int:
        return self.tp.size

    @property
    def tp_rank(self) -> int:
        return self.tp.rank

    def extra_repr(self) -> str:
        return (
            f"in_features={self.input_size}, out_features={self.output_size}, bias={self.bias is not None}, "
            f"tp_size={self.tp_size}, tp_rank={self.tp_rank}"
        )


class ColumnParallelLinear(LinearBase):
    """``input_size -> output_size``, output features split across ranks.

    Returns this rank's ``[..., output_size / tp_size]`` slice, or the full output
    (gathered across ranks) with ``gather_output=True``.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = True,
        gather_output: bool = False,
        tp_size: int | None = None,
        tp_rank: int | None = None,
    ) -> None:
        tp = resolve_tp_group(tp_size, tp_rank)
        super().__init__(input_size, divide(output_size, tp.size, "output_size"), bias, tp)
        self.gather_output = gather_output

    @torch.no_grad()
    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None) -> None:
        if shard_id is not None:
            raise ValueError(f"shard_id={shard_id!r} given to {type(self).__name__}, which is not packed")
        rows = self.output_size
        check_shape(loaded_weight, (rows * self.tp_size, *param.shape[1:]))
        param.data.copy_(loaded_weight.narrow(0, self.tp_rank * rows, rows))

    def forward(self, x: torch.Tensor, activation: str | None = None) -> torch.Tensor:
        """``activation`` ("gelu" exact, "relu"): applied to the output, fused into the
        GEMM where the layer's kernel can."""
        y = self._gemm(x, self.bias, activation)  # [..., output_size / tp]
        return self.tp.all_gather(y, dim=-1) if self.gather_output else y


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input in one GEMM, e.g. a
    cross-attention's K and V: ``output_sizes=[d, d]``, checkpoint shards 0 and 1.

    This rank's output is ``[..., sum(output_partition_sizes)]``: its slice of shard
    0, then of shard 1, ... (``split(self.output_partition_sizes, -1)`` takes them apart).
    """

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        bias: bool = True,
        gather_output: bool = False,
        tp_size: int | None = None,
        tp_rank: int | None = None,
    ) -> None:
        tp = resolve_tp_group(tp_size, tp_rank)
        self.output_sizes = list(output_sizes)
        self.output_partition_sizes = [
            divide(n, tp.size, f"output_sizes[{i}]") for i, n in enumerate(output_sizes)
        ]
        if gather_output and len(output_sizes) > 1 and tp.size > 1:
            raise ValueError("gather_output=True would interleave the shards of the ranks; split first")
        super().__init__(input_size, sum(self.output_sizes), bias, gather_output, tp.size, tp.rank)

    @torch.no_grad()
    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None) -> None:
        if shard_id is None:
            # An unsplit checkpoint tensor (one fused projection, in shard order).
            check_shape(loaded_weight, (sum(self.output_sizes), *param.shape[1:]))
            for i, size in enumerate(self.output_sizes):
                start = sum(self.output_sizes[:i])
                self.weight_loader(param, loaded_weight.narrow(0, start, size), i)
            return
        valid = isinstance(shard_id, int) and not isinstance(shard_id, bool)
        if not valid or not 0 <= shard_id < len(self.output_sizes):
            raise ValueError(f"shard_id={shard_id!r} is not one of 0..{len(self.output_sizes) - 1}")
        rows = self.output_partition_sizes[shard_id]
        check_shape(loaded_weight, (self.output_sizes[shard_id], *param.shape[1:]))
        offset = sum(self.output_partition_sizes[:shard_id])
        param.data.narrow(0, offset, rows).copy_(loaded_weight.narrow(0, self.tp_rank * rows, rows))


class QKVParallelLinear(ColumnParallelLinear):
    """Q, K and V of self-attention in one GEMM, split across ranks by heads.

    ``total_num_kv_heads`` may be smaller than ``total_num_heads`` (GQA/MQA). With fewer
    KV heads than ranks, each KV head is replicated on ``tp_size / total_num_kv_heads``
    ranks. This rank's output is ``[..., q_size + 2 * kv_size]``:
    ``split([self.q_size, self.kv_size, self.kv_size], -1)`` gives its Q, K, V of
    ``num_heads`` / ``num_kv_heads`` heads. Checkpoint shards: ``"q"``, ``"k"``, ``"v"``
    (or 0, 1, 2).
    """

    SHARDS = ("q", "k", "v")

    def __init__(
        self,
        hidden_size: int,
        head_size: int,
        total_num_heads: int,
        total_num_kv_heads: int | None = None,
        bias: bool = True,
        tp_size: int | None = None,
        tp_rank: int | None = None,
    ) -> None:
        tp = resolve_tp_group(tp_size, tp_rank)
        total_num_kv_heads = total_num_kv_heads or total_num_heads
        if total_num_heads % total_num_kv_heads:
            raise ValueError(
                f"total_num_heads={total_num_heads} is not a multiple of total_num_kv_heads={total_num_kv_heads}"
            )
        self.head_size = head_size
        self.total_num_heads, self.total_num_kv_heads = total_num_heads, total_num_kv_heads
        self.num_heads = divide(total_num_heads, tp.size, "total_num_heads")
        if total_num_kv_heads >= tp.size:
            self.num_kv_heads = divide(total_num_kv_heads, tp.size, "total_num_kv_heads")
            self.num_kv_head_replicas = 1
        else:
            self.num_kv_heads = 1
            self.num_kv_head_replicas = divide(tp.size, total_num_kv_heads, "tp_size")
        self.q_size = self.num_heads * head_size
        self.kv_size = self.num_kv_heads * head_size
        # The output size every rank's slices add up to (KV counted once per replica).
        output_size = (self.num_heads + 2 * self.num_kv_heads) * head_size * tp.size
        super().__init__(hidden_size, output_size, bias, False, tp.size, tp.rank)

    @torch.no_grad()
    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None) -> None:
        if shard_id is None:
            # An unsplit checkpoint tensor: Q rows, then K rows, then V rows.
            q, kv = self.total_num_heads * self.head_size, self.total_num_kv_heads * self.head_size
            check_shape(loaded_weight, (q + 2 * kv, *param.shape[1:]))
            for name, start, size in (("q", 0, q), ("k", q, kv), ("v", q + kv, kv)):
                self.weight_loader(param, loaded_weight.narrow(0, start, size), name)
            return
        if isinstance(shard_id, int) and not isinstance(shard_id, bool) and 0 <= shard_id < 3:
            shard_id = self.SHARDS[shard_id]
        if shard_id == "q":
            offset, rows, total_heads, index = 0, self.q_size, self.total_num_heads, self.tp_rank
        elif shard_id in ("k", "v"):
            offset = self.q_size + (self.kv_size if shard_id == "v" else 0)
            rows, total_heads = self.kv_size, self.total_num_kv_heads
            index = self.tp_rank // self.num_kv_head_replicas
        else:
            raise ValueError(f"shard_id={shard_id!r} is not one of 'q', 'k', 'v' (or 0, 1, 2)")
        check_shape(loaded_weight, (total_heads * self.head_size, *param.shape[1:]))
        param.data.narrow(0, offset, rows).copy_(loaded_weight.narrow(0, index * rows, rows))


class RowParallelLinear(LinearBase):
    """``input_size -> output_size``, input features split across ranks.

    Takes this rank's ``[..., input_size / tp_size]`` slice of the input (what a
    column-parallel layer returns) and returns the full ``[..., output_size]``,
    summed across ranks, or this rank's partial sum with ``reduce_results=False``.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = True,
        reduce_results: bool = True,
        tp_size: int | None = None,
        tp_rank: int | None = None,
    ) -> None:
        tp = resolve_tp_group(tp_size, tp_rank)
        super().__init__(divide(input_size, tp.size, "input_size"), output_size, bias, tp)
        self.reduce_results = reduce_results

    @torch.no_grad()
    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None) -> None:
        if shard_id is not None:
            raise ValueError(f"shard_id={shard_id!r} given to {type(self).__name__}, which is not packed")
        if param.dim() == 1:  # the bias: whole on every rank
            check_shape(loaded_weight, param.shape)
            param.data.copy_(loaded_weight)
            return
        cols = self.input_size
        check_shape(loaded_weight, (param.shape[0], cols * self.tp_size))
        param.data.copy_(loaded_weight.narrow(1, self.tp_rank * cols, cols))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """``residual`` ``[..., output_size]``: added to the (reduced) output, in the GEMM's
        epilogue where the kernel can and nothing is left to sum across ranks; the result
        equals ``residual + self(x)``."""
        bias = self.bias if self.tp_rank == 0 else None  # added once, not tp_size times
        if self.tp_size == 1 and residual is not None:
            return self._gemm(x, bias, None, residual=residual)
        y = self._gemm(x, bias, None)  # [..., output_size], this rank's partial sum
        y = self.tp.all_reduce(y) if self.reduce_results else y
        if residual is not None:
            if not self.reduce_results:
                raise ValueError("RowParallelLinear: a residual needs reduce_results=True when tp_size > 1")
            y = residual + y
        return y
