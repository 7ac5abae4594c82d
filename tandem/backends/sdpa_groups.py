"""Attention runs of one shape as one SDPA call (CPU).

A step of short requests holds hundreds of runs: 256 translations of 10-60
tokens are 256 encoder runs per layer, then 256 decoder prefills of two tokens
(``<DEC><BOS>``), each over its own causal self keys and its cross keys. One
SDPA call per run is ~30-80 us of dispatch and a fork/join of the intra-op
threads for a few microseconds of arithmetic (bart-base, 2 threads: 4,608 calls
in the first step of that workload). Runs that share a query and key length are
gathered into ``[runs, H, n, D]`` and attended in one call.

On CPU, runs whose queries are their keys (encoder runs, causal prefills with
nothing cached) come out bit-equal to a call per run: PyTorch's CPU
flash-attention kernel computes each (batch entry, head, query block) alone,
blocked by the lengths, not the batch. One or two queries over a few dozen keys
(a cross prefill of ``<DEC><BOS>``) may differ in the last bit: with two or more
threads the kernel sums such a call in another order than a batch of them, as
a call per run already differs between one thread and two
(tests/backends/test_sdpa_groups.py holds both to these bars and to float64).
CUDA kernels may split the keys by batch size, so other devices keep a call
per run.
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.nn.functional as F


def can_group(device: torch.device) -> bool:
    """Whether runs on ``device`` may be stacked (bit-equal only on CPU: see above)."""
    return device.type == "cpu"


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
) -> None:
    """SDPA of each run's queries over its keys, written into ``out``; ``causal``
    (top-left) is meant for runs whose queries are all their keys. A run whose
    keys hold more than ``max_gather`` elements (length x KV heads x head size) is
    attended alone through views: copying its K/V would cost more than the call
    it saves (Whisper's cross prefills: a few queries over 1,500 positions).

    The runs' rows are gathered once, ordered by shape, so each shape's runs are
    one slice of the copies; the outputs go back with one ``index_copy_``. A step's
    few large ops, not one per shape: each op is a fork/join of the intra-op
    threads, and on a machine other jobs share a join waits for a descheduled
    thread."""
    per_key = key.shape[1] * key.shape[2]
    alone = [r for r in runs if r[3] * per_key > max_gather] if len(runs) > 1 else runs
    for q_start, q_len, k_start, k_len in alone:  # views, no copy
        o = F.scaled_dot_product_attention(
            _heads_first(query[q_start : q_start + q_len]), _heads_first(key[k_start : k_start + k_len]),
            _heads_first(value[k_start : k_start + k_len]), is_causal=causal, scale=scale, enable_gqa=gqa)
        out[q_start : q_start + q_len] = o[0].transpose(0, 1)
    groups: dict[tuple[int, int], list[tuple[int, int]]] = defaultdict(list)
    for q_start, q_len, k_start, k_len in runs:
        if len(runs) > 1 and k_len * per_key <= max_gather:
            groups[(q_len, k_len)].append((q_start, k_start))
    if not groups:
        return
    q_rows = _rows([(s, q) for (q, _), g in groups.items() for s, _ in g], query.device)
    k_rows = _rows([(s, k) for (_, k), g in groups.items() for _, s in g], key.device)
    # Gathered as [rows, H * D]: index_select's row copy (a 3-D strided source, such as
    # the q/k/v split of one projection, takes a per-element path 4-20x slower).
    qs = query.flatten(1).index_select(0, q_rows).view(-1, *query.shape[1:])
    ks = key.flatten(1).index_select(0, k_rows).view(-1, *key.shape[1:])
    vs = value.flatten(1).index_select(0, k_rows).view(-1, *value.shape[1:])
    outs, qi, ki = [], 0, 0
    for (q_len, k_len), g in groups.items():
        b = len(g)
        q = qs[qi : qi + b * q_len].view(b, q_len, *qs.shape[1:]).transpose(1, 2)
        k = ks[ki : ki + b * k_len].view(b, k_len, *ks.shape[1:]).transpose(1, 2)
        v = vs[ki : ki + b * k_len].view(b, k_len, *vs.shape[1:]).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=gqa)
        outs.append(o.transpose(1, 2).reshape(b * q_len, *out.shape[1:]))
        qi, ki = qi + b * q_len, ki + b * k_len
    out.index_copy_(0, q_rows, torch.cat(outs) if len(outs) > 1 else outs[0])


def _rows(spans: list[tuple[int, int]], device: torch.device) -> torch.Tensor:
    """Rows ``s..s+n-1`` of each ``(s, n)``, in order."""
    starts = torch.tensor([s for s, _ in spans], dtype=torch.long)
    lens = torch.tensor([n for _, n in spans], dtype=torch.long)
    offsets = torch.arange(int(lens.sum())) - torch.repeat_interleave(torch.cumsum(lens, 0) - lens, lens)
    return (torch.repeat_interleave(starts, lens) + offsets).to(device)


def _heads_first(x: torch.Tensor) -> torch.Tensor:
    """``[L, H, D] -> [1, H, L, D]`` as a view."""
    return x.transpose(0, 1).unsqueeze(0)
