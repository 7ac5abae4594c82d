"""Attention runs of a step as a few SDPA calls over padded batches (CPU).

A step of short requests holds hundreds of runs: 256 translations of 10-60
tokens are 256 encoder runs per layer, then 256 decoder prefills of two tokens
(``<DEC><BOS>``), each over its own causal self keys and its cross keys. One
SDPA call per run is ~30-80 us of dispatch and a fork/join of the intra-op
threads for a few microseconds of arithmetic (bart-base, 2 threads: 4,608 calls
in the first step of that workload), so runs are gathered into
``[runs, H, n, D]`` batches.

Which runs share a batch (:func:`plan_runs`): runs of one shape always do. With
:data:`PAD_MIXED_LENGTHS` (off by default: see it), runs of different lengths share one when their lengths round up to the same multiple
of :data:`PAD` (lengths under :data:`EXACT_BELOW` keep their own): each is padded
to that length, its padded keys masked out (its padded queries read clamped copies
of its last row and are dropped). PyTorch's CPU flash kernel costs per (batch
entry, head), and far more at some lengths than at the next multiple of 16
(one thread, 4 heads of 16: 4.8 us at 30 positions, 2.1 at 32; 3.1 at 24), so
padding 10-30 token runs to 16 or 32 made their attention 1.8x cheaper than a
call per length (128 runs: 1.36 -> 0.76 ms a layer), while padding them all to
the longest (30) made it 1.6x dearer; long runs (bart-base, 50-400 tokens) cost
the same either way (padding adds < 16 positions). A batch holds at most
:data:`MAX_BATCH_ELEMENTS` padded elements per tensor; more runs take more calls.

On CPU, runs of one shape whose queries are their keys (encoder runs, causal
prefills with nothing cached) come out bit-equal to a call per run: the kernel
computes each (batch entry, head, query block) alone, blocked by the lengths, not
the batch. A padded run, and one or two queries over a few dozen keys (a cross
prefill of ``<DEC><BOS>``), may differ in the last bits: masked keys change the
kernel's blocks, and with two or more threads the kernel sums such a call in
another order than a batch of them, as a call per run already differs between
one thread and two (tests/backends/test_sdpa_groups.py holds both to these bars
and to float64). CUDA kernels may split the keys by batch size, so other devices
keep a call per run.

A plan depends only on the runs, so a backend makes it once per step
(``SDPAMetadata.run_plan``) and every layer reuses its index tensors.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.nn.functional as F

# Lengths at or above EXACT_BELOW are padded up to a multiple of PAD (see the module),
# when PAD_MIXED_LENGTHS: off, since a padded call sums in another order than a call per
# run, and on the tiny test checkpoints (logits of O(100)) that put beam scores 2.3e-4
# (relative) off HF's, past tests/entrypoints/test_beam_search.py's 1e-4, for 4-12% of
# a first step (docs/performance.md, issue 49). Runs of one shape are batched either way.
PAD_MIXED_LENGTHS = False
PAD = 16
EXACT_BELOW = 8
# Elements (rows x heads x head size) a padded batch's query or key tensor may hold
# (64 MiB of float32); a bucket with more is split into several calls.
MAX_BATCH_ELEMENTS = 1 << 24


def can_group(device: torch.device) -> bool:
    """Whether runs on ``device`` may be stacked (bit-equal only on CPU: see above)."""
    return device.type == "cpu"


def padded_length(n: int) -> int:
    """The length a run of ``n`` is attended at when it shares a batch with others."""
    return n if not PAD_MIXED_LENGTHS or n < EXACT_BELOW else -(-n // PAD) * PAD


@dataclass
class _Call:
    runs: int
    q_len: int  # padded query length
    k_len: int  # padded key length
    mask: torch.Tensor | None  # [runs, 1, 1, k_len] bool, True where a key is real; None: all are


@dataclass
class RunPlan:
    """How :func:`attend_runs` attends a list of runs: which run alone through views,
    what rows each batch gathers and where each real output row goes."""

    alone: list[tuple[int, int, int, int]]  # runs attended alone through views
    calls: list[_Call]  # in the order of the gathered rows
    q_rows: torch.Tensor | None  # [Pq] query row of each padded query position
    k_rows: torch.Tensor | None  # [Pk] key row of each padded key position
    # Where the real output rows are: ``src[i]`` (a row of the calls' stacked outputs)
    # goes to query row ``dst[i]``; ``dst`` is None where the runs cover every query row
    # and ``src`` is ordered by query row (the output is then one gather, no scatter).
    src: torch.Tensor | None
    dst: torch.Tensor | None


def plan_runs(
    runs: list[tuple[int, int, int, int]],  # (query start, query length, key start, key length)
    *,
    num_queries: int,  # rows of the packed query the runs index
    per_key: int,  # elements of one key row (KV heads x head size)
    max_gather: int,
    causal: bool,
    device: torch.device,
) -> RunPlan:
    """Groups ``runs`` into padded batches (see the module). A run whose keys hold
    more than ``max_gather`` elements is attended alone through views: copying its K/V
    would cost more than the call it saves (Whisper's cross prefills: a few queries
    over 1,500 positions). ``causal`` runs have their queries as their keys."""
    if len(runs) <= 1:
        return RunPlan(list(runs), [], None, None, None, None)
    alone = [r for r in runs if r[3] * per_key > max_gather]
    buckets: dict[tuple[int, int], list[tuple[int, int, int, int]]] = defaultdict(list)
    pad_mixed = PAD_MIXED_LENGTHS
    for r in runs:
        if r[3] * per_key <= max_gather:
            buckets[(padded_length(r[1]), padded_length(r[3])) if pad_mixed else (r[1], r[3])].append(r)
    if not buckets:
        return RunPlan(alone, [], None, None, None, None)
    # The runs in call order, each with the lengths it is attended at; the index tensors
    # are then made for all of them at once (a few ops a step, not a dozen per call).
    ordered: list[tuple[int, int, int, int]] = []
    pads: list[tuple[int, int]] = []
    calls: list[_Call] = []
    masked: list[tuple[_Call, int]] = []  # calls with padded keys, and their first run in ``ordered``
    any_padded = False
    for (pq, pk), members in buckets.items():
        shape = (members[0][1], members[0][3])
        exact = not pad_mixed or all((r[1], r[3]) == shape for r in members)
        if exact:  # one shape: no padding
            pq, pk = shape
        else:
            any_padded = True
        per_call = max(1, MAX_BATCH_ELEMENTS // (max(pq, pk) * per_key))
        for i in range(0, len(members), per_call):
            chunk = members[i : i + per_call]
            call = _Call(len(chunk), pq, pk, None)
            # Causal runs need no mask: a real query sees only keys before it, all real.
            if not exact and not causal and any(r[3] != pk for r in chunk):
                masked.append((call, len(ordered)))
            calls.append(call)
            ordered.extend(chunk)
            pads.extend([(pq, pk)] * len(chunk))
    qs, ql, ks, kl = torch.tensor(ordered, dtype=torch.long).unbind(1)
    pq_t, pk_t = torch.tensor(pads, dtype=torch.long).unbind(1)
    q_rows, jq = _padded_rows(qs, ql, pq_t, any_padded)
    k_rows, _ = _padded_rows(ks, kl, pk_t, any_padded)
    for call, first in masked:
        lens = kl[first : first + call.runs]
        call.mask = (torch.arange(call.k_len)[None, :] < lens[:, None])[:, None, None, :].to(device)
    if not any_padded or bool((ql == pq_t).all()):  # no padded query: every stacked row is real
        src_t = torch.arange(q_rows.numel())
        dst_t = q_rows
    else:
        real = jq < ql.repeat_interleave(pq_t)
        src_t = real.nonzero().flatten()
        dst_t = (qs.repeat_interleave(pq_t) + jq)[real]
    if not alone and dst_t.numel() == num_queries:  # every row once: order src by row
        src_t = torch.empty_like(src_t).index_copy_(0, dst_t, src_t)
        dst_t = None
    return RunPlan(alone, calls, q_rows.to(device), k_rows.to(device), src_t.to(device),
                   None if dst_t is None else dst_t.to(device))


def _padded_rows(starts: torch.Tensor, lens: torch.Tensor, padded: torch.Tensor,
                 some_padded: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``starts[i] + min(j, lens[i] - 1)`` for ``j < padded[i]``, run after run (a padded
    position reads its run's last row), and each position's ``j``; ``some_padded``: False
    when no run is (``padded`` equals ``lens``)."""
    total = int(padded.sum())
    first = torch.cumsum(padded, 0) - padded  # each run's first position in the stack
    j = torch.arange(total) - first.repeat_interleave(padded, output_size=total)
    if not some_padded or bool((lens == padded).all()):
        return starts.repeat_interleave(padded, output_size=total) + j, j
    last = (lens - 1).repeat_interleave(padded, output_size=total)
    return starts.repeat_interleave(padded, output_size=total) + torch.minimum(j, last), j


def attend_runs(
    query: torch.Tensor,  # [Tq, H, D] packed query rows
    key: torch.Tensor,  # [Tk, H_kv, D] rows the runs' keys are read from
    value: torch.Tensor,  # [Tk, H_kv, D]
    runs: list[tuple[int, int, int, int]],  # (query start, query length, key start, key length)
    out: torch.Tensor,  # [Tq, H, D], each run's query rows written
    *,
    scale: float,
    causal: bool,
    gqa: bool,
    max_gather: int,
    plan: RunPlan | None = None,
) -> None:
    """SDPA of each run's queries over its keys, written into ``out``; ``causal``
    (top-left) is meant for runs whose queries are all their keys. ``plan``: what
    :func:`plan_runs` returns for these arguments (made here where not given).

    The runs' rows are gathered once, ordered by batch, so each batch is one slice of
    the copies; the outputs go back with one gather (or, where the runs do not cover
    every row of ``out``, one ``index_copy_``). A step's few large ops, not one per
    batch: each op is a fork/join of the intra-op threads, and on a machine other
    jobs share a join waits for a descheduled thread."""
    if plan is None:
        plan = plan_runs(runs, num_queries=query.shape[0], per_key=key.shape[1] * key.shape[2],
                         max_gather=max_gather, causal=causal, device=query.device)
    for q_start, q_len, k_start, k_len in plan.alone:  # views, no copy
        o = F.scaled_dot_product_attention(
            _heads_first(query[q_start : q_start + q_len]), _heads_first(key[k_start : k_start + k_len]),
            _heads_first(value[k_start : k_start + k_len]), is_causal=causal, scale=scale, enable_gqa=gqa)
        out[q_start : q_start + q_len] = o[0].transpose(0, 1)
    if not plan.calls:
        return
    # Gathered as [rows, H * D]: index_select's row copy (a 3-D strided source, such as
    # the q/k/v split of one projection, takes a per-element path 4-20x slower).
    qs = query.flatten(1).index_select(0, plan.q_rows)  # [Pq, H * D], contiguous
    ks = key.flatten(1).index_select(0, plan.k_rows)
    vs = value.flatten(1).index_select(0, plan.k_rows)
    (hq, dq), (hk, dk), (hv, dv) = query.shape[1:], key.shape[1:], value.shape[1:]
    outs, qi, ki = [], 0, 0
    for c in plan.calls:
        # Each call's [b, H, n, D] as one strided view of the gathered rows (the view that
        # slicing rows, viewing them [b, n, H, D] and swapping n and H makes, in one op:
        # ~90 calls a step).
        b, lq, lk = c.runs, c.q_len, c.k_len
        q = qs.as_strided((b, hq, lq, dq), (lq * hq * dq, dq, hq * dq, 1), qi * hq * dq)
        k = ks.as_strided((b, hk, lk, dk), (lk * hk * dk, dk, hk * dk, 1), ki * hk * dk)
        v = vs.as_strided((b, hv, lk, dv), (lk * hv * dv, dv, hv * dv, 1), ki * hv * dv)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=c.mask, is_causal=causal, scale=scale,
                                           enable_gqa=gqa)
        outs.append(o.transpose(1, 2).reshape(b * lq, -1))  # [b * q_len, H * D]
        qi, ki = qi + b * lq, ki + b * lk
    stacked = torch.cat(outs) if len(outs) > 1 else outs[0]
    flat = out.view(out.shape[0], -1) if out.is_contiguous() else None
    if plan.dst is None and flat is not None:
        torch.index_select(stacked, 0, plan.src, out=flat)  # a gather: ~4x cheaper than a scatter on CPU
    elif plan.dst is None:
        out.copy_(stacked.index_select(0, plan.src).view(out.shape))
    else:
        out.index_copy_(0, plan.dst, stacked.index_select(0, plan.src).view(-1, *out.shape[1:]))


def _heads_first(x: torch.Tensor) -> torch.Tensor:
    """``[L, H, D] -> [1, H, L, D]`` as a view."""
    return x.transpose(0, 1).unsqueeze(0)
