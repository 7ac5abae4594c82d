"""Random paged layouts and a float64 reference: the conformance check every
attention backend runs (tests/backends/test_conformance.py), usable by a plugin's
own tests too: ``check_backend(MyBackend, seed=0, block_size=16, num_kv_heads=2)``.

Layouts are built directly as ``StepInputs`` (the hand-off the model runner gives a
metadata builder), so the check depends on the backend interface only.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, replace

import numpy as np
import torch

from tandem.core.attention import AttentionBackend, AttentionType, KVCacheSpec, StepInputs
from tandem.core.layers import Attention
from tandem.core.relative_position import RelativePositionBias

NUM_HEADS = 4
D = 8  # default head size
# float32 attention against float64 on the same (float32-representable) inputs,
# O(1) random: each output is a softmax-weighted mean of at most ~130 values
# (|v| < 5) after dot products of length <= 64. With float32's unit roundoff
# u = 6e-8, rounding errors add up like a random walk, ~sqrt(L) * u * max|v|
# ~ 3e-6 for L = 130; 2e-5 absolute (1e-4 relative for the rare large output)
# leaves room for a backend's own summation order. Observed: < 1e-6.
ATOL, RTOL = 2e-5, 1e-4
# And over the whole output, ||out - ref|| / ||ref|| < 1e-5 (the bar): the
# per-element errors above are ~u * sqrt(L) ~ 1e-6 relative, independent across
# elements, so the norm-wise ratio is of the same order. Observed ~1e-7.
REL_FP32 = 1e-5
# bfloat16 (u = 2^-9 = 2e-3): inputs are rounded to bf16 before both sides see
# them, so what remains is the backend's own rounding: the output stored in
# bf16 (relative 2^-9 each, RMS ~1.1e-3), and in flash-style kernels the
# softmax weights cast to bf16 before the P.V product (another ~2^-9 per weight,
# averaged over the keys). Norm-wise 1e-2 is ~4x the sum of both; per element
# 3e-2 absolute covers |out| up to ~4 at a few units of 2^-8 each.
ATOL_BF16, RTOL_BF16, REL_BF16 = 3e-2, 2e-2, 1e-2
# Kinds of decoder sequence a layout mixes.
PREFILL = "prefill"  # from position 0; 1 new token (start token only) or several
CHUNK = "chunk"  # several new tokens on top of cached ones (chunked prefill)
DECODE = "decode"  # one new token on top of cached ones
MIXES = {
    "mixed": (PREFILL, CHUNK, DECODE),
    "decodes": (DECODE,),
    "prefills": (PREFILL,),
}


@dataclass
class Seq:
    """One decoder sequence of a layout, in logical terms."""

    group: int
    ctx: int  # tokens already in the self cache
    q_len: int  # new tokens this step
    table: list[int]  # self block table
    enc_len: int  # encoder positions (its group's)
    cross: list[int]  # its group's cross block table
    run_encoder: bool  # its group's encoder runs this step (then ctx == 0)


def sdpa_family_backend(name: str) -> type[AttentionBackend]:
    """``torch_sdpa`` or ``cpu_paged`` (which shares its prefill path); skips the test
    where cpu_paged's C++ op cannot be built here."""
    if name == "cpu_paged":
        import pytest

        from tandem.backends.cpu_paged import CPUPagedBackend, ops

        try:
            ops.load()
        except ops.CPUOpUnavailable as e:
            pytest.skip(f"cpu_paged's C++ op is unavailable here: {e}")
        return CPUPagedBackend
    from tandem.backends.torch_sdpa import TorchSDPABackend

    return TorchSDPABackend


def _take_blocks(rng: random.Random, free: list[int], n: int, contiguous: bool) -> list[int]:
    if contiguous and n:
        avail = set(free)
        runs = sorted(b for b in avail if all(b + i in avail for i in range(n)))
        if runs:
            start = rng.choice(runs)
            for b in range(start, start + n):
                free.remove(b)
            return list(range(start, start + n))
    return [free.pop() for _ in range(n)]


def _blocks(n: int, block_size: int) -> int:
    return -(-n // block_size)


def random_layout(rng: random.Random, block_size: int, mix: str = "mixed") -> tuple[list[Seq], int]:
    """Groups of one or two decoder sequences (two share the group's encoder and
    cross table, as beams do), each sequence a prefill from 0, a chunk on top of
    cached tokens or a single-token decode; a prefill group's encoder runs now or
    ran earlier; tables scattered or one contiguous run. Every kind in ``mix``
    occurs at least once. Returns the sequences and the pool size."""
    kinds = list(MIXES[mix]) + [rng.choice(MIXES[mix]) for _ in range(rng.randint(0, 4))]
    rng.shuffle(kinds)
    groups = []  # (enc_len, run_encoder, [(ctx, q_len)])
    for kind in kinds:
        if kind == PREFILL:
            work = (0, rng.choice([1, rng.randint(2, 12)]))
        elif kind == CHUNK:
            work = (rng.randint(1, 40), rng.randint(2, 9))
        else:
            work = (rng.randint(1, 40), 1)
        if groups and rng.random() < 0.3 and (work[0] == 0) == (groups[-1][2][0][0] == 0):
            groups[-1][2].append(work)  # a second sequence of the same group
        else:
            run_encoder = work[0] == 0 and rng.random() < 0.7
            groups.append((rng.randint(1, 120), run_encoder, [work]))
    needed = sum(_blocks(e, block_size) + sum(_blocks(c + q, block_size) for c, q in w) for e, _, w in groups)
    num_blocks = 2 * needed + 8  # spare blocks, so unused ones can be checked untouched
    free = list(range(num_blocks))
    rng.shuffle(free)
    seqs = []
    for gi, (enc_len, run_encoder, work) in enumerate(groups):
        cross = _take_blocks(rng, free, _blocks(enc_len, block_size), rng.random() < 0.6)
        for ctx, q_len in work:
            table = _take_blocks(rng, free, _blocks(ctx + q_len, block_size), rng.random() < 0.4)
            seqs.append(Seq(gi, ctx, q_len, table, enc_len, cross, run_encoder))
    return seqs, num_blocks


def slots(table: list[int], positions: range, block_size: int) -> torch.Tensor:
    """Flat slot ``block * block_size + offset`` of each position."""
    pos = torch.tensor(positions, dtype=torch.long)
    return torch.tensor(table, dtype=torch.long)[pos // block_size] * block_size + pos % block_size


def _padded(tables: list[list[int]]) -> torch.Tensor:
    width = max(1, max(len(t) for t in tables))
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long)


def step_inputs(seqs: list[Seq], block_size: int) -> StepInputs:
    """The ``StepInputs`` the model runner would hand a metadata builder for ``seqs``."""
    q_lens = [s.q_len for s in seqs]
    query_start_loc = torch.zeros(len(seqs) + 1, dtype=torch.long)
    torch.cumsum(torch.tensor(q_lens), 0, out=query_start_loc[1:])
    encoders = {s.group: s for s in seqs if s.run_encoder}  # one encoder run per group
    empty = torch.zeros(0, dtype=torch.long)
    return StepInputs(
        input_ids=torch.zeros(sum(q_lens), dtype=torch.long),
        positions=torch.cat([torch.arange(s.ctx, s.ctx + s.q_len) for s in seqs]),
        slot_mapping=torch.cat([slots(s.table, range(s.ctx, s.ctx + s.q_len), block_size) for s in seqs]),
        query_lens=q_lens,
        seq_lens=[s.ctx + s.q_len for s in seqs],
        query_start_loc=query_start_loc,
        block_tables=_padded([s.table for s in seqs]),
        encoder_input_ids=torch.zeros(sum(s.enc_len for s in encoders.values()), dtype=torch.long),
        encoder_positions=torch.cat([empty] + [torch.arange(s.enc_len) for s in encoders.values()]),
        encoder_seq_lens=[s.enc_len for s in encoders.values()],
        cross_slot_mapping=torch.cat([empty] + [slots(s.cross, range(s.enc_len), block_size)
                                                for s in encoders.values()]),
        cross_seq_lens=[s.enc_len for s in seqs],
        cross_block_tables=_padded([s.cross for s in seqs]),
        logits_indices=query_start_loc[1:] - 1,
    )


# The relative position bias cases (``check_backend(..., bias=True)``): T5's bucketing
# with few buckets and a short max distance, so exact, log-spaced and clipped buckets all
# occur at the layouts' lengths (up to ~120).
BIAS_BUCKETS, BIAS_MAX_DISTANCE = 16, 24


def bucket_of(rel: int, bidirectional: bool, num_buckets: int, max_distance: int) -> int:
    """T5's bucket of one ``key_pos - query_pos``, written from Mesh TensorFlow's
    definition one scalar at a time (the log in float32, as T5 computes it)."""
    offset = 0
    if bidirectional:
        num_buckets //= 2
        offset = num_buckets if rel > 0 else 0
        n = abs(rel)
    else:
        n = max(-rel, 0)
    max_exact = num_buckets // 2
    if n < max_exact:
        return offset + n
    f32 = np.float32
    scaled = np.log(f32(n) / f32(max_exact)) / f32(math.log(max_distance / max_exact)) * f32(num_buckets - max_exact)
    return offset + min(max_exact + int(scaled), num_buckets - 1)


def reference_bias(table: torch.Tensor, q_pos: range, k_pos: range, bidirectional: bool) -> torch.Tensor:
    """``[H, q, k]`` float64 bias from ``table`` ``[num_buckets, H]``."""
    rows = [[bucket_of(k - q, bidirectional, table.shape[0], BIAS_MAX_DISTANCE) for k in k_pos] for q in q_pos]
    return table.double()[torch.tensor(rows, dtype=torch.long).reshape(len(q_pos), len(k_pos))].permute(2, 0, 1)


def reference(q, k, v, scale, causal_offset=None, bias=None):
    """float64 attention of q [q_len, H, D] over k, v [L, KVH, D] (KV heads repeated for GQA),
    ``bias`` [H, q_len, L] added to the scaled scores."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    if bias is not None:
        scores = scores + bias
    if causal_offset is not None:
        qpos = torch.arange(q.shape[0])[:, None] + causal_offset
        scores = scores.masked_fill(torch.arange(k.shape[0])[None, :] > qpos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def _changed_blocks(before: torch.Tensor, after: torch.Tensor, dim: int) -> set[int]:
    differs = (before != after).movedim(dim, 0).flatten(1).any(dim=1)
    return set(differs.nonzero().flatten().tolist())


def _check_write(backend, impl, before, after, key, value, slot_mapping, block_size) -> None:
    """``after`` is ``before`` with exactly ``key``/``value`` [n, KVH, D] at
    ``slot_mapping``: read back through the default layout where the backend
    uses it, and in any layout against the backend's own slot write; no block
    outside the written ones changed."""
    written = set((slot_mapping // block_size).tolist())
    assert _changed_blocks(before, after, backend.kv_cache_block_dim) <= written, "wrote outside the slots"
    expected = before.clone()
    impl.write_kv_cache(key, value, expected, slot_mapping)
    assert torch.equal(after, expected), "the cache differs from the new K/V written at their slots"
    num_blocks = before.shape[backend.kv_cache_block_dim]
    if tuple(after.shape) == AttentionBackend.get_kv_cache_shape(num_blocks, block_size, *key.shape[1:]):
        flat = after.view(2, -1, *key.shape[1:])  # [2, num_blocks * block_size, KVH, D]
        assert torch.equal(flat[0, slot_mapping], key) and torch.equal(flat[1, slot_mapping], value)


def to_device(inputs: StepInputs, device: torch.device | str) -> StepInputs:
    """``inputs`` with every tensor on ``device`` (lists stay lists)."""
    return StepInputs(**{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in vars(inputs).items()})


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want||, in float64."""
    got, want = got.double().cpu(), want.double().cpu()
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


def check_backend(
    backend: type[AttentionBackend],
    seed: int,
    block_size: int,
    num_kv_heads: int,
    head_size: int = D,
    mix: str = "mixed",
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    num_heads: int = NUM_HEADS,
    tolerances: tuple[float, float, float] | None = None,
    layout: tuple[list[Seq], int] | None = None,
    bias: bool = False,
) -> None:
    """Run the three attention kinds through ``backend`` (its metadata builder, its
    impl behind the ``Attention`` layer, one cache per layer from its own
    ``allocate_kv_cache``, shared by self- and cross-attention as in a model) on a
    random layout; compare the outputs with float64 computed from the dense K/V,
    and the cache afterwards with the new K/V at their slots. On ``device`` in
    ``dtype`` (inputs are rounded to ``dtype`` first; the reference is float64 on
    the rounded values). ``num_heads`` query heads; ``tolerances`` (absolute,
    relative, norm-wise) replace the float32 / bfloat16 bars; ``layout`` (sequences
    and pool size) replaces the random one. ``bias``: the ``"relative_position_bias"``
    feature too, a random table handed to the encoder (bidirectional) and decoder
    self-attention (causal) layers, none to cross attention."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    seqs, num_blocks = random_layout(rng, block_size, mix) if layout is None else layout
    dev = torch.device(device)
    builder = backend.get_metadata_builder_cls()(block_size, dev, KVCacheSpec(1, num_kv_heads, head_size))
    md = builder.build(to_device(step_inputs(seqs, block_size), dev))
    scale = head_size**-0.5
    layers = {t: Attention(num_heads, head_size, scale, backend, t, num_kv_heads) for t in AttentionType}
    impl = layers[AttentionType.DECODER].impl
    cache = backend.allocate_kv_cache(num_blocks, block_size, num_kv_heads, head_size, dtype, dev)
    assert backend.kv_cache_block_bytes(block_size, num_kv_heads, head_size, dtype) * num_blocks == (
        cache.numel() * cache.element_size()
    )
    atol, rtol, rel = tolerances or ((ATOL, RTOL, REL_FP32) if dtype == torch.float32 else
                                     (ATOL_BF16, RTOL_BF16, REL_BF16))

    def rand(n, heads):  # dtype values held in float64: backend and reference see the same inputs
        return torch.randn(n, heads, head_size, generator=g).to(dtype).double()

    table = torch.randn(BIAS_BUCKETS, num_heads, generator=g).to(dtype).double() if bias else None

    def bias_of(bidirectional):  # one per stack and step, as a model makes them
        if table is None:
            return None
        return RelativePositionBias(table.to(dev, dtype), BIAS_BUCKETS, BIAS_MAX_DISTANCE, bidirectional)

    def ref_bias(q_pos, k_pos, bidirectional):
        return None if table is None else reference_bias(table, q_pos, k_pos, bidirectional)

    def slots_on(table, positions):
        return slots(table, positions, block_size).to(dev)

    cross_done = set()
    qs, k_new, v_new, want_self, want_cross = [], [], [], [], []
    ck_new, cv_new, enc, want_enc = [], [], [], []
    for s in seqs:
        total = s.ctx + s.q_len
        k, v, q = rand(total, num_kv_heads), rand(total, num_kv_heads), rand(s.q_len, num_heads)
        # Tokens cached by earlier steps, through the backend's own slot write.
        impl.write_kv_cache(k[: s.ctx].to(dev, dtype), v[: s.ctx].to(dev, dtype), cache,
                            slots_on(s.table, range(s.ctx)))
        if s.group not in cross_done:  # one encoder, one cross table per group
            cross_done.add(s.group)
            ck, cv = rand(s.enc_len, num_kv_heads), rand(s.enc_len, num_kv_heads)
            if s.run_encoder:
                ck_new.append(ck), cv_new.append(cv)
                eq, ek, ev = rand(s.enc_len, num_heads), rand(s.enc_len, num_kv_heads), rand(s.enc_len, num_kv_heads)
                enc.append((eq, ek, ev))
                want_enc.append(reference(eq, ek, ev, scale,
                                          bias=ref_bias(range(s.enc_len), range(s.enc_len), True)))
            else:
                impl.write_kv_cache(ck.to(dev, dtype), cv.to(dev, dtype), cache, slots_on(s.cross, range(s.enc_len)))
        qs.append(q), k_new.append(k[s.ctx :]), v_new.append(v[s.ctx :])
        want_self.append(reference(q, k, v, scale, causal_offset=s.ctx,
                                   bias=ref_bias(range(s.ctx, total), range(total), False)))
        want_cross.append(reference(q, ck, cv, scale))

    def packed(ts):  # [n, heads, D] pieces -> dtype [N, heads, D] on the device
        return torch.cat(ts).to(dev, dtype)

    def check(layer_out, want):
        assert layer_out.dtype == dtype and layer_out.device.type == dev.type
        want = torch.cat(want).flatten(1)
        torch.testing.assert_close(layer_out.double().cpu(), want, atol=atol, rtol=rtol)
        err = relative_error(layer_out, want)
        assert err < rel, f"relative error {err:.2e} >= {rel:.0e}"

    q, k, v = packed(qs), packed(k_new), packed(v_new)
    before = cache.clone()
    decoder_bias = bias_of(False)
    check(layers[AttentionType.DECODER](q.flatten(1), k.flatten(1), v.flatten(1), cache, md,
                                        position_bias=decoder_bias), want_self)
    _check_write(backend, impl, before, cache, k, v, md.slot_mapping, block_size)

    before = cache.clone()
    ck = packed(ck_new) if ck_new else None
    cv = packed(cv_new) if cv_new else None
    got = layers[AttentionType.ENCODER_DECODER](
        q.flatten(1), None if ck is None else ck.flatten(1), None if cv is None else cv.flatten(1), cache, md
    )
    check(got, want_cross)
    if ck is None:
        assert torch.equal(cache, before), "cross-attention without an encoder run wrote the cache"
    else:
        _check_write(backend, impl, before, cache, ck, cv, md.cross_slot_mapping, block_size)
        # A later step with the same decoder work: no encoder runs, the cross K/V
        # come from the cache alone.
        later = builder.build(to_device(step_inputs([replace(s, run_encoder=False) for s in seqs], block_size), dev))
        before = cache.clone()
        check(layers[AttentionType.ENCODER_DECODER](q.flatten(1), None, None, cache, later), want_cross)
        assert torch.equal(cache, before), "cross-attention without new K/V wrote the cache"

    if enc:
        eq, ek, ev = (packed([e[i] for e in enc]).flatten(1) for i in range(3))
        before = cache.clone()
        check(layers[AttentionType.ENCODER](eq, ek, ev, None, md, position_bias=bias_of(True)), want_enc)
        assert torch.equal(cache, before), "encoder self-attention wrote the cache"
    # The decoder again over the same step: it reads back what it wrote (and, with a bias,
    # a second layer of the stack reads the same bias object).
    check(layers[AttentionType.DECODER](q.flatten(1), k.flatten(1), v.flatten(1), cache, md,
                                        position_bias=decoder_bias), want_self)
