"""The decode step split at its attention calls, each piece between them run
through a static-buffer runner: CUDA graphs on a GPU (issue 40; vLLM's
piecewise design).

A CUDA graph cannot hold the attention call: it reads the step's metadata
(block tables, sequence lengths: Python lists that change every step) and its
kernels pick work by them. Everything else in a decode step (embeddings, the
projections, layer norms, the MLPs, the LM head) has fixed shapes per batch
bucket. So :class:`PiecewiseBackend`, given to ``torch.compile`` as its
backend, takes Dynamo's graph of the step (one per bucket: ``dynamic=False``),
cuts it before and after every ``tandem::paged_attention`` call
(``torch.fx.passes.split_module``), compiles each piece between them with the
inner backend (inductor; aot_eager or eager in tests) the first time it runs,
and wraps it in a runner (``graph_runner.py``) that captures it once and
replays it on every later step of that bucket. The attention pieces run eager
between them, reading the step's metadata from ``opaque_context``, so nothing
of the metadata needs a static buffer.

What leaves the graph is cloned: a runner's outputs are its static buffers,
which the next step's replay overwrites, and the logits are read after the
step (sampling, logprobs) and may be kept by the caller.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch.fx.passes.split_module import split_module

from tandem.core.layers import opaque_ops  # noqa: F401 - registers torch.ops.tandem.paged_attention
from tandem.core.worker.graph_runner import GraphStats, StaticPieceRunner

logger = logging.getLogger(__name__)

_ATTENTION = torch.ops.tandem.paged_attention


def is_attention(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and node.target in (_ATTENTION, _ATTENTION.default)


@dataclass
class SplitGraph:
    """One Dynamo graph cut at its attention calls: the submodules' names, in order."""

    module: torch.fx.GraphModule
    compute: list[str] = field(default_factory=list)  # pieces between attention calls
    attention: list[str] = field(default_factory=list)  # one attention call each


def split_at_attention(gm: torch.fx.GraphModule) -> SplitGraph:
    """``gm`` cut so that each attention call is a submodule of its own and the nodes
    between two of them another; the order of the nodes is kept."""
    part, parts = 0, {}
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if is_attention(node):
            part += 1
            parts[node] = part
            part += 1
        else:
            parts[node] = part
    # tuple_return: AOTAutograd takes only pieces that return tuples.
    split = split_module(gm, None, lambda n: parts[n], keep_original_order=True, tuple_return=True)
    out = SplitGraph(split)
    for node in split.graph.nodes:
        if node.op != "call_module":
            continue
        sub = getattr(split, node.target)
        kind = out.attention if any(is_attention(n) for n in sub.graph.nodes) else out.compute
        kind.append(node.target)
    return out


class _LazyCompiled:
    """A piece compiled by ``inner`` on its first call, with that call's arguments."""

    def __init__(self, piece: torch.fx.GraphModule, inner: Callable) -> None:
        self.piece = piece
        self.inner = inner
        self.fn = None

    def __call__(self, *args):
        if self.fn is None:
            self.fn = self.inner(self.piece, list(args))
        return self.fn(*args)


def _clone_out(out):
    if isinstance(out, torch.Tensor):
        return out.clone()
    if isinstance(out, (tuple, list)):
        return type(out)(t.clone() if isinstance(t, torch.Tensor) else t for t in out)
    return out


class PiecewiseBackend:
    """A ``torch.compile`` backend: each graph split at its attention calls, the pieces
    between them compiled by ``inner`` (a backend name or callable) and run by
    ``runner(fn, stats, static_ptrs)`` (a :class:`StaticPieceRunner`)."""

    def __init__(self, inner: str | Callable, runner: Callable[..., StaticPieceRunner],
                 static_tensors: list[torch.Tensor]) -> None:
        if isinstance(inner, str):
            from torch._dynamo.backends.registry import lookup_backend

            inner = lookup_backend(inner)
        self.inner = inner
        self.runner = runner
        self.static_ptrs = frozenset(t.data_ptr() for t in static_tensors)
        self.stats = GraphStats()
        self.graphs: list[SplitGraph] = []  # every graph Dynamo handed over (one per bucket)

    def __call__(self, gm: torch.fx.GraphModule, example_inputs) -> Callable:
        split = split_at_attention(gm)
        for name in split.compute:
            piece = getattr(split.module, name)
            # The GraphModule's code calls self.<name>(...); an instance attribute comes
            # before the registered submodule, and need not be a Module (vLLM does the same).
            split.module.__dict__[name] = self.runner(_LazyCompiled(piece, self.inner), self.stats, self.static_ptrs)
        self.graphs.append(split)
        logger.debug("decode graph split into %d pieces around %d attention calls", len(split.compute),
                     len(split.attention))
        module = split.module

        def run(*args):
            return _clone_out(module(*args))

        return run


def piecewise_decode_step(model: torch.nn.Module, device: torch.device, runner: Callable[..., StaticPieceRunner], *,
                          inner: str | Callable | None = None, **kwargs):
    """A :class:`CompiledDecodeStep` whose graphs run piecewise through ``runner``;
    ``step.piecewise`` is the backend (its split graphs and its :class:`GraphStats`)."""
    from tandem.core.worker import compiled_step

    backend = PiecewiseBackend(inner or compiled_step.COMPILER_BACKEND, runner,
                               [*model.parameters(), *model.buffers()])
    step = compiled_step.CompiledDecodeStep(model, device, backend=backend, **kwargs)
    step.piecewise = backend
    return step


def cuda_graph_decode_step(model: torch.nn.Module, device: torch.device, **kwargs):
    """The piecewise step with each piece a CUDA graph, every piece in one memory pool."""
    from functools import partial

    from tandem.core.worker.graph_runner import CUDAGraphRunner

    return piecewise_decode_step(model, device, partial(CUDAGraphRunner, pool=torch.cuda.graph_pool_handle()),
                                 **kwargs)
