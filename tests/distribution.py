"""Checking sampled tokens against an exact distribution, with a derived bound.

The oracle for what a sampled row draws from is HF's own warpers
(``TemperatureLogitsWarper``, ``TopKLogitsWarper``, ``TopPLogitsWarper``,
``MinPLogitsWarper``, in the order ``GenerationMixin._get_logits_processor``
appends them) applied to the same scores; ``hf_probs`` computes it.

``assert_draws_follow`` makes two checks of ``N`` draws against the exact
probabilities ``p``:

1. Support, exactly: no token of probability 0 is ever drawn.
2. Total variation, with a bound that holds for every ``N`` (not an
   asymptotic chi-square). Group the tokens into ``B`` bins (the most
   probable ones alone, the rest of the support together). For any union
   ``A`` of bins, the empirical mass ``p^(A)`` is a mean of ``N`` independent
   Bernoulli(``p(A)``) draws, so Hoeffding gives
   ``P(p^(A) - p(A) >= t) <= exp(-2 N t^2)``. Since
   ``||p^ - p||_1 = 2 max_A (p^(A) - p(A))``, a union bound over the ``2^B``
   sets gives ``P(||p^ - p||_1 >= eps) <= 2^B exp(-N eps^2 / 2)``
   (Bretagnolle-Huber-Carol). Setting that to ``delta`` gives
   ``eps = sqrt(2 (B ln 2 + ln(1 / delta)) / N)``: a correct sampler fails the
   check with probability at most ``delta``, whatever the machine or thread
   count, as only the random draws enter it.

A test that makes ``m`` such checks passes each ``delta / m``, so the test as a
whole fails falsely with probability below ``delta`` (1e-6 here).
"""

from __future__ import annotations

import math

import torch

FALSE_FAILURE = 1e-6  # per test function, split over its checks
MAX_BINS = 24


def l1_bound(num_draws: int, bins: int, delta: float) -> float:
    return math.sqrt(2.0 * (bins * math.log(2.0) + math.log(1.0 / delta)) / num_draws)


def hf_probs(scores: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
             min_p: float = 0.0) -> torch.Tensor:
    """Float64 probabilities HF samples from after its warpers on float32 ``scores``
    (``[vocab]`` or ``[rows, vocab]``), each warper added under HF's own condition."""
    from transformers.generation.logits_process import (
        LogitsProcessorList,
        MinPLogitsWarper,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    warpers = LogitsProcessorList()
    if temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(temperature))
    if top_k:
        warpers.append(TopKLogitsWarper(top_k=top_k))
    if top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p=top_p))
    if min_p:
        warpers.append(MinPLogitsWarper(min_p=min_p))
    x = scores.float().reshape(-1, scores.shape[-1])
    warped = warpers(torch.zeros(x.shape[0], 1, dtype=torch.long), x.clone())
    return torch.softmax(warped.double(), dim=-1).reshape(scores.shape)


def assert_support_stable(probs_fn, scores: torch.Tensor, eta: float, tries: int = 16, seed: int = 0) -> None:
    """The fixture's guard: the support of ``probs_fn(scores)`` does not change when
    the scores move by up to ``eta`` (more than the float32 differences between the
    two sides), so exact support checks cannot flake on a boundary."""
    base = probs_fn(scores) > 0
    g = torch.Generator().manual_seed(seed)
    for _ in range(tries):
        noise = (torch.rand(scores.shape, generator=g) * 2 - 1) * eta
        assert torch.equal(probs_fn(scores + noise) > 0, base), "fixture too close to a support boundary"


def assert_draws_follow(tokens: torch.Tensor, probs: torch.Tensor, delta: float, label: str = "") -> dict:
    """``tokens``: drawn ids ``[N]``; ``probs``: exact float64 ``[vocab]``."""
    vocab = probs.shape[0]
    counts = torch.bincount(tokens.flatten().long(), minlength=vocab).double()
    n = int(counts.sum())
    outside = (counts > 0) & (probs <= 0)
    assert not outside.any(), (
        f"{label}: drew tokens of probability 0: {outside.nonzero().flatten().tolist()} "
        f"(counts {counts[outside].long().tolist()}); support {int((probs > 0).sum())} tokens"
    )
    order = torch.argsort(probs, descending=True)
    support = int((probs > 0).sum())
    solo = min(support, MAX_BINS - 1)
    p_bins = [float(probs[order[i]]) for i in range(solo)]
    c_bins = [float(counts[order[i]]) for i in range(solo)]
    if support > solo:
        rest = order[solo:support]
        p_bins.append(float(probs[rest].sum()))
        c_bins.append(float(counts[rest].sum()))
    l1 = sum(abs(c / n - p) for c, p in zip(c_bins, p_bins))
    eps = l1_bound(n, len(p_bins), delta)
    assert l1 <= eps, f"{label}: L1 distance {l1:.4f} > bound {eps:.4f} ({n} draws, {len(p_bins)} bins)"
    return {"draws": n, "support": support, "drawn": int((counts > 0).sum()), "l1": l1, "bound": eps}
