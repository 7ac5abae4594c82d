"""Acceptance of draft tokens from the target model's scores (worker side).

A sequence verified with ``k`` draft tokens ``x_1..x_k`` has ``k + 1`` rows of
processed scores: row ``j`` scores the token after ``x_1..x_j`` (row 0: after
its last sampled token), each row processed with the history it would have
had (``x_1..x_j`` accepted), so every row is exactly the distribution plain
decoding would sample from at that point, given that prefix.

- Greedy: ``x_{j+1}`` is accepted while it equals row ``j``'s argmax; the first
  row where it does not (or row ``k``) gives its argmax. The emitted tokens are
  the argmaxes of rows ``0..a``: what plain greedy decoding emits, one per step.
- Sampled: each row's token is drawn as plain sampling draws it, ``argmax(p_j / e)``
  with ``e ~ Exp(1)`` from the sequence's stream (``warpers.draw``), and ``x_{j+1}``
  is accepted while it equals row ``j``'s draw; the first row where it does not (or
  row ``k``) gives its draw. This is rejection sampling with a point-mass draft
  ``q``: ``x`` is accepted with probability ``p_j(x) = min(1, p_j(x)/q(x))``, and on
  its rejection the token is distributed as ``p_j`` with ``x`` taken out, which is
  ``max(0, p_j - q)`` normalised (Leviathan et al. 2023, Chen et al. 2023): the
  output is distributed as the target's. It is also coupled to plain decoding: a
  seeded sequence draws one ``Exp(1)`` vector per emitted token from its own stream
  (the rows past the first rejection draw nothing), so it emits what it would have
  without speculation, whatever drafts it was given (those the scheduler drops
  included), and never depends on the rest of the batch (up to the float rounding
  of a verify pass's logits against a decode pass's, which greedy shares). An unseeded request's rows draw from the engine's stream at once.
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
    probs = gens = None
    if params.greedy:
        target = argmax_rows(x).tolist()
    else:
        probs = sampling_probs(x, [params] * len(rows))  # [R, vocab]
        gens = generators if generators is not None else [None] * len(rows)
        # The engine's stream is the batch's: its rows draw at once, used or not.
        shared = [i for i, g in enumerate(gens) if g is None]
        target = [-1] * len(rows)
        if shared:
            drawn = draw(probs.index_select(0, torch.tensor(shared, device=dev)), [None] * len(shared), default)
            for i, t in zip(shared, drawn.tolist()):
                target[i] = t
    out = []
    for s, d in zip(starts, drafts):
        a = 0
        while True:
            if target[s + a] < 0:  # a seeded row: its sequence's next draw, only when needed
                target[s + a] = int(draw(probs[s + a:s + a + 1], [gens[s + a]], default)[0])
            if a == len(d) or d[a] != target[s + a]:
                break
            a += 1
        out.append((s, a, target[s:s + a + 1]))
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
