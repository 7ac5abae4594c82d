"""Rejection sampling keeps the target's distribution: the first two tokens a
sequence emits with speculation are distributed as plain sampling's.

The target is a tiny model given by its scores: ``p0`` for the first token and
``p1(. | t1)`` for the second (each HF's warped distribution of random scores,
computed in float64 by ``hf_probs``: the oracle). Each of ``N`` sequences is
verified with a fixed draft ``[d1, d2]``: one ``verify`` call over all of them
(rows: ``p0``, ``p1(. | d1)``, ``p2(. | d1, d2)``). A sequence that emitted one
token (its first draft rejected) takes its second from a second ``verify`` with
a draft for the second position (accepted or not), as the next engine step
would. The pairs ``(t1, t2)`` must follow ``p0(t1) p1(t2 | t1)``: the exact
support, and total variation within the bound derived in ``distribution.py``
(a correct sampler fails with probability below 1e-6). Rejection that
resampled from ``p`` instead of ``max(0, p - q)`` normalised would draw a
rejected draft again: the first token's draft would come out with probability
``p(2 - p)`` (~0.5 for ``p`` ~0.3), far outside the bound.
"""

from __future__ import annotations

import pytest
import torch

from distribution import FALSE_FAILURE, assert_draws_follow, hf_probs
from tandem import SamplingParams
from tandem.core.strategies.speculative.verify import verify

V = 8
N = 12_000
PARAMS = SamplingParams(temperature=0.9, top_k=6)


def _scores(seed: int, rows: int) -> torch.Tensor:
    return torch.randn(rows, V, generator=torch.Generator().manual_seed(seed)) * 1.2


@pytest.mark.parametrize("draft_kind", ["likely", "impossible"])
def test_first_two_tokens_follow_the_target(draft_kind):
    s0 = _scores(1, 1)[0]  # the first token's scores
    s1 = _scores(2, V)  # row t: the second token's scores after t
    s2 = _scores(3, 1)[0]  # the third token's after the two drafts (not checked here)
    p0 = hf_probs(s0, temperature=PARAMS.temperature, top_k=PARAMS.top_k)
    p1 = hf_probs(s1, temperature=PARAMS.temperature, top_k=PARAMS.top_k)
    order0 = torch.argsort(p0, descending=True)
    # "likely": drafts the target often accepts (its 2nd most probable tokens);
    # "impossible": a first draft outside the top-k (probability 0), always rejected.
    d1 = int(order0[1]) if draft_kind == "likely" else int(order0[-1])
    d2 = int(torch.argsort(p1[d1], descending=True)[1])
    assert (p0[d1] > 0.1) == (draft_kind == "likely")

    gen = torch.Generator().manual_seed(1234)
    rows = torch.stack([s0, s1[d1], s2]).repeat(N, 1)  # [3N, V]
    first = verify(rows, list(range(3 * N)), [[d1, d2]] * N, PARAMS, None, gen)
    t1 = torch.tensor([v.token_ids[0] for v in first])
    t2 = torch.full((N,), -1)
    two = [i for i, v in enumerate(first) if len(v.token_ids) >= 2]
    t2[two] = torch.tensor([first[i].token_ids[1] for i in two], dtype=torch.long)
    one = [i for i, v in enumerate(first) if len(v.token_ids) == 1]
    assert one and (two or draft_kind == "impossible")
    # The next step: each such sequence verifies a draft for its second token (that
    # token's 2nd most probable, accepted at times) on the rows p1(. | t1), p2.
    second_rows = torch.stack([torch.stack([s1[int(t1[i])], s2]) for i in one]).reshape(-1, V)
    drafts = [[int(torch.argsort(p1[int(t1[i])], descending=True)[1])] for i in one]
    second = verify(second_rows, list(range(2 * len(one))), drafts, PARAMS, None, gen)
    t2[one] = torch.tensor([v.token_ids[0] for v in second], dtype=torch.long)
    for v in first + second:
        assert v.accepted == len(v.token_ids) - 1 and v.error is None and not v.no_token

    joint = (p0[:, None] * p1).flatten()  # P(t1, t2), float64
    report = assert_draws_follow(t1 * V + t2, joint, FALSE_FAILURE / 2, f"(t1, t2), {draft_kind} drafts")
    assert report["draws"] == N
    assert_draws_follow(t1, p0, FALSE_FAILURE / 2, f"t1, {draft_kind} drafts")


def test_seeded_request_repeats_and_the_greedy_rule_is_argmax():
    s = _scores(5, 3)
    a = verify(s, [0, 1, 2], [[1, 2]], PARAMS, [torch.Generator().manual_seed(9)] * 3, None)
    b = verify(s, [0, 1, 2], [[1, 2]], PARAMS, [torch.Generator().manual_seed(9)] * 3, None)
    assert a[0].token_ids == b[0].token_ids
    greedy = SamplingParams(temperature=0)
    target = s.argmax(dim=-1).tolist()
    for drafts in ([target[0], target[1]], [target[0], (target[1] + 1) % V], [(target[0] + 1) % V, 0]):
        v = verify(s, [0, 1, 2], [drafts], greedy, None, torch.Generator())[0]
        a = 0
        while a < 2 and drafts[a] == target[a]:
            a += 1
        assert v.accepted == a and v.token_ids == target[: a + 1]


def test_a_seeded_sequence_emits_plain_sampling_s_tokens_whatever_its_drafts():
    """A seeded row's token is plain sampling's draw from the sequence's stream, one
    ``Exp(1)`` vector per emitted token: with any drafts (the right ones, wrong ones,
    none) a sequence emits a prefix of what plain sampling draws on the same rows, and
    leaves its stream where plain sampling would after as many tokens. So a seeded
    request's samples do not depend on the drafts the scheduler gave or dropped."""
    from tandem.core.worker.warpers import draw, sampling_probs

    s = _scores(6, 4)  # the rows after each accepted prefix
    for seed in range(40):
        plain_gen = torch.Generator().manual_seed(seed)
        plain = [int(draw(sampling_probs(s[j:j + 1], [PARAMS]), [plain_gen], None)[0]) for j in range(4)]
        states = []
        g = torch.Generator().manual_seed(seed)
        for j in range(4):
            draw(sampling_probs(s[j:j + 1], [PARAMS]), [g], None)
            states.append(g.get_state())
        wrong = [(t + 1) % V for t in plain]
        for drafts in (plain[:3], plain[:1] + wrong[1:3], wrong[:3], plain[:2], []):
            gen = torch.Generator().manual_seed(seed)
            (v,) = verify(s, list(range(len(drafts) + 1)), [drafts], PARAMS, [gen] * (len(drafts) + 1), None)
            a = 0
            while a < len(drafts) and drafts[a] == plain[a]:
                a += 1
            assert v.accepted == a and v.token_ids == plain[:a + 1]
            assert torch.equal(gen.get_state(), states[a])
