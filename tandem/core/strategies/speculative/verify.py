"""Acceptance of draft tokens from the target model's scores (worker side).

A sequence verified with ``k`` draft tokens ``x_1..x_k`` has ``k + 1`` rows of
processed scores: row ``j`` scores the token after ``x_1..x_j`` (row 0: after
its last sampled token), each row processed with the history it would have
had (``x_1..x_j`` accepted), so every row is exactly the distribution plain
decoding would sample from at that point, given that prefix.

- Greedy: ``x_{j+1}`` is accepted while it equals row ``j``'s argmax; the first
  row where it does not (or row ``k``) gives its argmax. The emitted tokens are
  the argmaxes of rows ``0..a``: what plain greedy decoding emits, one per step.
- Sampled: rejection sampling with a deterministic (point-mass) draft ``q``:
  ``x_{j+1}`` is accepted with probability ``min(1, p_j(x)/q(x)) = p_j(x)``; on
  its rejection the token comes from ``max(0, p_j - q)`` normalised, which is
  ``p_j`` with ``x`` taken out; after ``k`` acceptances row ``k`` is sampled.
  The token at each position is then distributed as ``p_j`` (P(x) = p(x) from
  acceptance; P(y != x) = (1 - p(x)) p(y) / (1 - p(x))), so the output is
  distributed as the target's (Leviathan et al. 2023, Chen et al. 2023).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.core.sampling_params import SamplingParams
from tandem.core.worker.reductions import argmax_rows
from tandem.core.worker.warpers import draw, sampling_probs


@dataclass
class Verified:
    """One sequence's step: the tokens it emits (accepted drafts, then the target's),
    their log-probabilities when asked for, and how many drafts were accepted."""

    token_ids: list[int]
    accepted: int
    logprobs: list[float | None]
    top_logprobs: list[dict[int, float]] | None
    # The row after the emitted tokens had every token banned: the sequence ends there.
    no_token: bool = False
    error: str | None = None


def verify(
    scores: torch.Tensor, rows: list[int], drafts: list[list[int]], params: SamplingParams,
    generators: list[torch.Generator | None] | None, default: torch.Generator,
) -> list[Verified]:
    """``scores``: processed float32 ``[R, vocab]``; ``rows``: the group's rows, each
    sequence's ``len(drafts[i]) + 1`` in order; ``generators``: each row's seeded stream,
    its sequence's (None, or None for a row: ``default``, the engine's stream)."""
    dev = scores.device
    x = scores.index_select(0, torch.tensor(rows, device=dev))  # [R, vocab]
    starts, pos = [], 0
    for d in drafts:
        starts.append(pos)
        pos += len(d) + 1
    if pos != len(rows):
        raise RuntimeError(f"{len(rows)} score rows for drafts needing {pos}")
    out = []
    if params.greedy:
        target = argmax_rows(x).tolist()
        for s, d in zip(starts, drafts):
            a = 0
            while a < len(d) and d[a] == target[s + a]:
                a += 1
            out.append((s, a, target[s:s + a + 1]))
    else:
        gens = generators if generators is not None else [None] * len(rows)
        probs = sampling_probs(x, [params] * len(rows))
        finals = []
        for s, d in zip(starts, drafts):
            a = 0
            gen = gens[s] if gens[s] is not None else default
            if d:
                p_draft = probs[s + torch.arange(len(d), device=dev), torch.tensor(d, device=dev)]
                u = torch.rand(len(d), generator=gen, device=gen.device).to(dev)
                rejected = (u >= p_draft).nonzero()
                a = int(rejected[0]) if rejected.numel() else len(d)
            p = probs[s + a].clone()
            if a < len(d):  # max(0, p - q) for the point mass q on the rejected draft
                p[d[a]] = 0.0
                p /= p.sum()
            finals.append(p)
            out.append((s, a, list(d[:a])))
        last = draw(torch.stack(finals), [gens[s] for s in starts], default).tolist()
        out = [(s, a, toks + [t]) for (s, a, toks), t in zip(out, last)]
    return [_finish(x, s, a, toks, params) for s, a, toks in out]


def _finish(x: torch.Tensor, start: int, accepted: int, tokens: list[int], params: SamplingParams) -> Verified:
    """The emitted tokens checked (an all-banned row ends the sequence before it;
    NaN or inf scores fail the request) and their log-probabilities."""
    r = torch.arange(start, start + len(tokens), device=x.device)
    chosen = x[r, torch.tensor(tokens, device=x.device)]
    bad = (~torch.isfinite(chosen)).nonzero()
    no_token, error = False, None
    if bad.numel():
        j = int(bad[0])
        value = float(chosen[j])
        if value == -float("inf"):
            no_token, tokens, r = True, tokens[:j], r[:j]
            accepted = min(accepted, j)
        else:
            error = f"its next-token scores are not finite ({value}): the model's logits hold NaN or inf"
    logprobs: list[float | None] = [None] * len(tokens)
    top = None
    if params.logprobs is not None and tokens and error is None:
        sub = x.index_select(0, r)
        lse = torch.logsumexp(sub, dim=-1)
        logprobs = (chosen[: len(tokens)] - lse).tolist()
        top = []
        k = params.logprobs
        vals, idx = sub.topk(k, dim=-1) if k else (None, None)
        for j, t in enumerate(tokens):
            d = dict(zip(idx[j].tolist(), (vals[j] - lse[j]).tolist())) if k else {}
            d[t] = logprobs[j]
            top.append(d)
    return Verified(tokens, accepted, logprobs, top, no_token, error)
