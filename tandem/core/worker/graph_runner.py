"""Static-buffer runners for the pieces of a piecewise decode step (issue 40).

A CUDA graph replays the kernels it recorded on the addresses it recorded:
every tensor a piece reads must sit at the address it had at capture, and
what the piece returns is the same memory each replay, overwritten by the
next. :class:`StaticPieceRunner` holds that plumbing, device-independent:

- warm-up: the first ``warmup`` calls run the piece as it is (the inner
  compiler compiles on the first, lazy allocations settle);
- capture: the next call copies each input into a buffer of its own (model
  parameters and buffers, whose addresses never move, are read in place),
  records the piece on those buffers, then replays once: recording computes
  nothing;
- replay: later calls copy the inputs into the static buffers (the shapes
  must be the captured ones: a bucket fixes them) and replay; the outputs
  returned ARE the static output buffers, valid until the piece's next replay.

How to record and replay is the subclass's: :class:`CUDAGraphRunner` with a
``torch.cuda.CUDAGraph`` (every piece of a step in one shared memory pool, as
vLLM does), :class:`StandInRunner` on any device, which records by allocating
the output buffers (filled with NaN: a step that read them before replaying
would show it) and replays by running the piece on the static inputs and
copying its results into them. The stand-in is what CPU tests run, so the
copy-in, the aliasing and the padded rows are tested without a GPU.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass
class GraphStats:
    """Counts over every piece of a step (tests and the GPU plan read them)."""

    warmups: int = 0
    captures: int = 0
    replays: int = 0


def _tensors(out) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    return [t for t in out if isinstance(t, torch.Tensor)]


class StaticPieceRunner:
    """One piece of one bucket's graph, run through static buffers (see the module doc)."""

    def __init__(self, fn: Callable, stats: GraphStats, static_ptrs: frozenset[int], warmup: int = 1) -> None:
        self.fn = fn
        self.stats = stats
        self.static_ptrs = static_ptrs  # addresses read in place (the model's parameters and buffers)
        self.warmup = warmup
        self.calls = 0
        self.inputs: list | None = None  # the captured arguments: static buffers, parameters, non-tensors
        self.copy_in: set[int] = set()  # which of them are ours, refilled before each replay
        self.outputs = None  # the static outputs, as the piece returns them

    def __call__(self, *args):
        self.calls += 1
        if self.calls <= self.warmup:
            self.stats.warmups += 1
            return self.fn(*args)
        if self.inputs is None:
            self._take_inputs(args)
            self.outputs = self._capture(self.inputs)
            self.stats.captures += 1
        else:
            self._fill(args)
        self._replay()
        self.stats.replays += 1
        return self.outputs

    def _take_inputs(self, args) -> None:
        self.inputs = []
        for i, a in enumerate(args):
            if isinstance(a, torch.Tensor) and a.data_ptr() not in self.static_ptrs:
                a = a.clone()
                self.copy_in.add(i)
            self.inputs.append(a)

    def _fill(self, args) -> None:
        if len(args) != len(self.inputs):
            raise ValueError(f"a captured piece got {len(args)} arguments, captured with {len(self.inputs)}")
        for i, (a, s) in enumerate(zip(args, self.inputs)):
            if i in self.copy_in:
                if a.shape != s.shape or a.dtype != s.dtype:
                    raise ValueError(f"a captured piece's input {i} is {tuple(a.shape)} {a.dtype}, "
                                     f"captured as {tuple(s.shape)} {s.dtype}")
                if a.data_ptr() != s.data_ptr():
                    s.copy_(a)
            elif isinstance(s, torch.Tensor):
                if a.data_ptr() != s.data_ptr():
                    raise ValueError(f"a captured piece's input {i} (a parameter) moved")
            elif a != s:
                raise ValueError(f"a captured piece's input {i} is {a!r}, captured as {s!r}")

    def _capture(self, inputs: list):
        """Record the piece on ``inputs``; return its static outputs (not yet computed)."""
        raise NotImplementedError

    def _replay(self) -> None:
        raise NotImplementedError


class StandInRunner(StaticPieceRunner):
    """Records by allocating the output buffers, replays by computing into them."""

    def _capture(self, inputs: list):
        out = self.fn(*inputs)
        # An output that is a view of an input is that input's buffer: left as it is.
        held = {t.untyped_storage().data_ptr() for t in inputs if isinstance(t, torch.Tensor)}
        for t in _tensors(out):
            if t.untyped_storage().data_ptr() not in held:
                t.fill_(float("nan")) if t.is_floating_point() else t.fill_(-1)
        return out

    def _replay(self) -> None:
        for static, fresh in zip(_tensors(self.outputs), _tensors(self.fn(*self.inputs))):
            static.copy_(fresh)


class CUDAGraphRunner(StaticPieceRunner):
    """A ``torch.cuda.CUDAGraph`` per piece and bucket, all in ``pool``."""

    def __init__(self, fn: Callable, stats: GraphStats, static_ptrs: frozenset[int], warmup: int = 1,
                 pool=None) -> None:
        super().__init__(fn, stats, static_ptrs, warmup)
        self.pool = pool
        self.graph: torch.cuda.CUDAGraph | None = None

    def _capture(self, inputs: list):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = self.fn(*inputs)
        self.graph = graph
        return out

    def _replay(self) -> None:
        self.graph.replay()
