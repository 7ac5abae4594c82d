"""Tensor-parallel size and rank, and the two collectives the parallel layers need.

Layers capture a :class:`TensorParallelGroup` when they are built: the one given
to their constructor (``tp_size=``, ``tp_rank=``), else the one a surrounding
:func:`tensor_parallel` block sets, else size 1, rank 0. So a model's forward
never reads global state, and with size 1 the collectives are no-ops.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class TensorParallelGroup:
    """This rank's place in a tensor-parallel group.

    ``group`` is the ``torch.distributed`` process group the collectives run on;
    None means the default group, initialised by the caller when ``size > 1``.
    """

    size: int = 1
    rank: int = 0
    group: Any = None

    def __post_init__(self) -> None:
        if isinstance(self.size, bool) or not isinstance(self.size, int) or self.size < 1:
            raise ValueError(f"tp_size={self.size!r} must be a positive integer")
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or not 0 <= self.rank < self.size:
            raise ValueError(f"tp_rank={self.rank!r} must be an integer in [0, tp_size={self.size})")

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place."""
        if self.size > 1:
            self._dist().all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's ``x`` along ``dim``, in rank order."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        self._dist().all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)

    def _dist(self):
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                f"tp_size={self.size} needs torch.distributed initialised (init_process_group) "
                "before the first forward"
            )
        return dist


_SINGLE = TensorParallelGroup()
_current: TensorParallelGroup | None = None


def get_tp_group() -> TensorParallelGroup:
    """The group set by the enclosing :func:`tensor_parallel` block, else size 1, rank 0."""
    return _current if _current is not None else _SINGLE


@contextmanager
def tensor_parallel(size: int, rank: int, group: Any = None) -> Iterator[TensorParallelGroup]:
    """Build layers (a whole model) as rank ``rank`` of ``size``. Blocks do not nest."""
    global _current
    if _current is not None:
        raise RuntimeError(f"tensor_parallel blocks do not nest (already inside {_current})")
    _current = TensorParallelGroup(size, rank, group)
    try:
        yield _current
    finally:
        _current = None


def resolve_tp_group(tp_size: int | None, tp_rank: int | None) -> TensorParallelGroup:
    """The group a layer uses: its constructor arguments when given, else :func:`get_tp_group`."""
    current = get_tp_group()
    if tp_size is None and tp_rank is None:
        return current
    size = current.size if tp_size is None else tp_size
    rank = current.rank if tp_rank is None else tp_rank
    group = current.group if size == current.size else None
    return TensorParallelGroup(size, rank, group)


def divide(numerator: int, denominator: int, what: str) -> int:
    """``numerator // denominator``, raising ``ValueError`` naming ``what`` unless exact."""
    if numerator % denominator:
        raise ValueError(f"{what}={numerator} is not divisible by tp_size={denominator}")
    return numerator // denominator
