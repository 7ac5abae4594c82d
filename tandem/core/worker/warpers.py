"""The sampling distribution of each sampled row, and a draw from it.

HF ``generate`` turns processed scores into the distribution it samples from
with its warpers, in this order (``GenerationMixin._get_logits_processor``):

1. temperature: ``scores / temperature``;
2. top-k: drop every score below the k-th largest (ties with it stay);
3. top-p on what top-k kept: sort ascending, softmax, cumulative sum, drop the
   tokens whose cumulative mass is ``<= 1 - top_p`` (the largest always stays),
   so the nucleus is taken from the renormalised top-k distribution;
4. min-p on what top-p kept: drop tokens whose probability is below
   ``min_p * max probability``;

then ``softmax`` and a draw. :func:`sampling_probs` does the same for a batch
whose rows each carry their own values, with one tensor operation per stage
over all rows. vLLM's sampler orders temperature, min-p, then top-k and top-p;
its min-p commutes with top-k (both keep a prefix of the sorted scores) but
not with top-p, and there tandem follows HF, the project's oracle.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tandem.core.sampling_params import SamplingParams
from tandem.core.worker.reductions import argmax_rows

NEG_INF = -float("inf")
# Candidates top-p looks at before it sorts a whole row (see _top_p).
TOP_P_CANDIDATES = 256


def sampling_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """float32 ``[S, vocab]`` processed scores -> ``[S, vocab]`` probabilities, row ``i``
    warped with ``params[i]``'s temperature, ``top_k``, ``top_p`` and ``min_p``."""
    dev, dt = logits.device, logits.dtype
    rows, vocab = logits.shape
    temps = [p.temperature for p in params]
    if any(t != 1.0 for t in temps):
        logits = logits / torch.tensor(temps, dtype=dt, device=dev)[:, None]

    ks = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]  # 0: off for the row
    if any(ks):
        kth = logits.topk(max(ks), dim=-1).values  # [S, k_max], descending
        pick = torch.tensor([max(k, 1) - 1 for k in ks], device=dev)[:, None]
        threshold = kth.gather(1, pick)
        if not all(ks):
            threshold.masked_fill_(torch.tensor([k == 0 for k in ks], device=dev)[:, None], NEG_INF)
        logits = logits.masked_fill(logits < threshold, NEG_INF)

    ps = [p.top_p for p in params]
    if any(p < 1.0 for p in ps):
        logits = _top_p(logits, ps)

    probs = logits.softmax(dim=-1)
    mins = [p.min_p for p in params]
    if any(m > 0.0 for m in mins):
        floor = torch.tensor(mins, dtype=dt, device=dev)[:, None] * probs.amax(dim=-1, keepdim=True)
        # min_p <= 1, so the most probable token is never below its floor.
        probs = logits.masked_fill(probs < floor, NEG_INF).softmax(dim=-1)
    return probs


def _top_p(logits: torch.Tensor, ps: list[float]) -> torch.Tensor:
    """HF's top-p: keep a token while the mass of the tokens more probable than it is
    below ``top_p`` (HF's ``cumsum ascending > 1 - top_p``, summed from the other end).

    A full sort of the vocabulary costs ~2 ms a row at 50K tokens on CPU (25x a
    top-k of 256), and the nucleus is usually far smaller: the rows whose
    ``TOP_P_CANDIDATES`` most probable tokens already hold ``top_p`` of the mass
    are decided from those; only the others are sorted whole."""
    top_p = torch.tensor(ps, dtype=logits.dtype, device=logits.device)[:, None]
    probs = logits.softmax(dim=-1)
    vals, idx = probs.topk(min(logits.shape[1], TOP_P_CANDIDATES), dim=-1)  # descending
    cum = vals.cumsum(dim=-1)
    drop = torch.ones_like(probs, dtype=torch.bool).scatter_(1, idx, (cum - vals) >= top_p)
    drop.scatter_(1, idx[:, :1], False)  # the most probable token always stays (HF's min_tokens_to_keep)
    wide = ((cum[:, -1:] < top_p) & (idx.shape[1] < logits.shape[1])).flatten().nonzero().flatten()
    if wide.numel():  # the nucleus reaches past the candidates: sort those rows whole
        sorted_probs, order = probs.index_select(0, wide).sort(dim=-1, descending=True)
        sorted_cum = sorted_probs.cumsum(dim=-1)
        wide_drop = (sorted_cum - sorted_probs) >= top_p.index_select(0, wide)
        wide_drop[:, 0] = False
        drop[wide] = wide_drop.scatter(1, order, wide_drop)
    drop &= top_p < 1.0  # rows without top-p drop nothing
    return logits.masked_fill(drop, NEG_INF)


def draw(probs: torch.Tensor, generators: Sequence[torch.Generator | None], default: torch.Generator) -> torch.Tensor:
    """One token per row of ``probs`` ``[S, vocab]``: ``argmax(p / q)`` with ``q ~ Exp(1)``
    drawn from the row's generator (None: ``default``), which picks token ``j`` with
    probability ``p_j`` (the first of independent exponential clocks with rates ``p``)."""
    q = torch.empty_like(probs)
    unseeded = [i for i, g in enumerate(generators) if g is None]
    if len(unseeded) == len(generators):
        q.exponential_(generator=default)
    elif unseeded:
        shape = (len(unseeded), probs.shape[1])
        q[unseeded] = torch.empty(shape, dtype=probs.dtype, device=probs.device).exponential_(generator=default)
    for i, g in enumerate(generators):
        if g is not None:  # a seeded request's own stream, on the CPU where it lives
            q[i] = torch.empty(probs.shape[1], dtype=probs.dtype).exponential_(generator=g).to(probs.device)
    # An exponential may come out as exactly 0; 0 / 0 would be NaN, which argmax
    # counts as the maximum and so would pick a token of probability 0.
    q.clamp_(min=torch.finfo(q.dtype).tiny)
    return argmax_rows(probs / q)
