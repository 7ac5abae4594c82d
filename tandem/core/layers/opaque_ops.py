"""The paged attention call and the pre-packed linear kernels as opaque ops, for
compiled steps.

``torch.compile`` must not trace into a backend: its metadata is Python lists
and dataclasses that change every step (Dynamo would guard on them and
recompile), and its kernels (the cpu_paged C++ op, SDPA loops) gain nothing
from tracing. So, while Dynamo traces, :class:`~tandem.core.layers.Attention`
calls ``torch.ops.tandem.paged_attention`` instead of the backend: a custom op
that takes only tensors and ints, and finds the step's metadata and the layer's
impl in the :func:`opaque_context` the caller of the compiled graph holds
(vLLM's ``unified_attention`` does the same with its forward context).

The linear layers' pre-packed kernels (oneDNN blocked weights, int8 packed
params) go through ``torch.ops.tandem.packed_linear`` the same way: inductor
lowers ``mkldnn._linear_pointwise`` only on weights it froze itself, and a graph
holding oneDNN (mkldnn) tensors cannot enter inductor's FX graph cache; behind the
op the graph holds no packed weight at all, so it caches, and int8 compiles too.

The attention op may get more query rows than the step has (a compiled graph runs on a
batch padded to a shape bucket): only the first ``num_decoder_tokens`` rows
reach the backend, so padded rows write no K/V, and their output rows are zero.

The op is declared as mutating nothing, though it writes the new K/V into
``kv_cache``: the graph never reads a cache except through this op, and the
rows a layer's self-attention writes (its own slots) are never the ones its
cross-attention reads (the cross table, written at prefill), so no ordering
of the graph's ops can observe the write. Declaring it would have AOTAutograd
functionalize the cache (a copy of each layer's whole KV pool) unless inductor
re-inplaced it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from tandem.core.attention import AttentionMetadata
from tandem.core.relative_position import RelativePositionBias


@dataclass
class OpaqueContext:
    """What the opaque ops read during one compiled call: the step's metadata, the
    compiled model's attention layers and its packed linear kernels (each indexed by
    its ``opaque_index``)."""

    metadata: AttentionMetadata
    layers: Sequence[torch.nn.Module]
    kernels: Sequence
    # One RelativePositionBias per (table, direction) per step, so its memo is shared
    # by every layer of a stack as in eager steps.
    biases: dict = field(default_factory=dict)


_current: OpaqueContext | None = None


@contextlib.contextmanager
def opaque_context(metadata: AttentionMetadata, layers: Sequence[torch.nn.Module],
                   kernels: Sequence) -> Iterator[OpaqueContext]:
    """Make these what the ops read, for the ``with`` body; no nesting."""
    global _current
    if _current is not None:
        raise RuntimeError("opaque_context is already active: compiled steps do not nest")
    _current = OpaqueContext(metadata, layers, kernels)
    try:
        yield _current
    finally:
        _current = None


def _context() -> OpaqueContext:
    if _current is None:
        raise RuntimeError("an opaque tandem op ran outside opaque_context()")
    return _current


@torch.library.custom_op("tandem::paged_attention", mutates_args=())
def paged_attention(
    query: torch.Tensor,  # [T_padded, H, D]
    key: torch.Tensor | None,  # [T_padded, H_kv, D] (None: cross-attention on a step with no encoder)
    value: torch.Tensor | None,
    kv_cache: torch.Tensor,
    layer_index: int,
    bias_table: torch.Tensor | None,  # [num_buckets, H]: relative position bias (T5), else None
    bias_num_buckets: int,
    bias_max_distance: int,
    bias_bidirectional: bool,
) -> torch.Tensor:
    ctx = _context()
    layer = ctx.layers[layer_index]
    md = ctx.metadata
    n = md.num_decoder_tokens
    if key is not None:
        key, value = key[:n], value[:n]
    kwargs = {}
    if bias_table is not None:
        memo_key = (bias_table.data_ptr(), bias_bidirectional)
        pb = ctx.biases.get(memo_key)
        if pb is None:
            pb = ctx.biases[memo_key] = RelativePositionBias(
                bias_table, bias_num_buckets, bias_max_distance, bias_bidirectional
            )
        kwargs["position_bias"] = pb
    real = layer.impl.forward(query[:n], key, value, kv_cache, md, layer.attn_type, **kwargs)
    if n == query.shape[0]:
        return real.contiguous()
    out = query.new_zeros(query.shape)
    out[:n] = real
    return out


@paged_attention.register_fake
def _(query, key, value, kv_cache, layer_index, bias_table, bias_num_buckets, bias_max_distance, bias_bidirectional):
    return torch.empty_like(query)


@torch.library.custom_op("tandem::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, bias: torch.Tensor | None, kernel_index: int, activation: str) -> torch.Tensor:
    ctx = _context()
    kernel = ctx.kernels[kernel_index]
    n = ctx.metadata.num_decoder_tokens
    if x.shape[0] == n:
        return kernel(None, x, bias, activation or None)
    # Only the real rows: int8 quantizes activations per tensor, so padded rows would
    # move the real rows' scale (and their results) away from an eager step's.
    y = kernel(None, x[:n], bias, activation or None)
    out = y.new_zeros((x.shape[0], y.shape[1]))
    out[:n] = y
    return out


@packed_linear.register_fake
def _(x, bias, kernel_index, activation):
    # The context is active while Dynamo traces (the compiled call runs inside it).
    return x.new_empty((*x.shape[:-1], _context().kernels[kernel_index].out_features))
