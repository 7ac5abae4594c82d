"""Beam-search bookkeeping for one request, step for step as HF ``generate`` does it.

The worker proposes each step's best ``beams_to_keep`` continuations (parent
beam, token, accumulated score: ``strategies.beam.BeamStep.select``). Here, with HF's
own float32 tensor arithmetic so that scores and ties come out identical:

- continuations that end (an EOS or stop token id, or the length limit) among
  the top ``num_beams`` become finished hypotheses, scored
  ``score / generated_length ** length_penalty``, kept if among the best
  ``num_beams`` finished so far;
- the best ``num_beams`` continuations that do not end become the running
  beams of the next step (the scheduler forks and frees sequences to match);
- the search stops as HF's ``early_stopping`` (True, False, "never") says.

The finished hypotheses are token lists; only running beams hold KV blocks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from tandem.core.sampling_params import SamplingParams

_NEG = -1.0e9  # HF's "impossible" score


@dataclass(frozen=True)
class BeamCandidates:
    """One beam-search group's best continuations this step, best first (HF's
    ``beams_to_keep``): each is a parent beam (index into the group's scheduled
    sequences), a token and the accumulated score (float32 values)."""

    scores: list[float]
    parents: list[int]
    token_ids: list[int]
    token_logprobs: list[float]  # the token's processed log-probability alone
    top_logprobs: list[dict[int, float]] | None = None  # per parent row, when asked for


class Hypothesis(NamedTuple):
    """Up to ``num_beams`` are made per request every step: ``step_all`` builds them
    with ``tuple.__new__(Hypothesis, fields)``, which is no Python call."""

    output_token_ids: list[int]
    output_logprobs: list[dict[int, float]]
    finished_by_stop: bool  # ended on an EOS / stop token (else on length)


@dataclass(slots=True)
class NextBeams:
    """One request's next running beams, in HF's order: beam ``i`` continues running
    beam ``parents[i]`` (an index into the step's running beams) with ``token_ids[i]``.
    Lists, one object per request: built without a Python call per beam."""

    parents: list[int]
    token_ids: list[int]
    scores: list[float]  # the accumulated scores (float32 values)
    token_logprobs: list[float]
    top_logprobs: list[dict[int, float]] | None  # None unless the request asks for logprobs


class BeamSearchState:
    def __init__(self, params: SamplingParams, prompt_len: int, stop_ids: frozenset[int]) -> None:
        self.params = params
        self.num_beams = params.num_beams
        self.prompt_len = prompt_len
        self.max_length = prompt_len + params.max_tokens
        self.stop_ids = stop_ids
        # Running beam scores; the first step's extra beams are copies scored -1e9.
        self.running = torch.zeros(self.num_beams, dtype=torch.float32)
        self.running[1:] = _NEG
        # Finished hypotheses, best first (HF's sequences / beam_scores / is_sent_finished).
        self.scores = torch.full((self.num_beams,), _NEG, dtype=torch.float32)
        self.is_finished = torch.zeros(self.num_beams, dtype=torch.bool)
        self.hyps: list[Hypothesis | None] = [None] * self.num_beams
        self.improvable = True  # HF's is_early_stop_heuristic_unsatisfied
        self.done = False

    def running_scores(self) -> list[float]:
        return self.running.tolist()

    @staticmethod
    def step_all(items: list[tuple["BeamSearchState", BeamCandidates, list, list, int]]) -> list[NextBeams]:
        """Advance each request by one token: ``(state, cands, parents_out,
        parents_logprobs, num_out)`` each, where ``parents_out[j]`` / ``parents_logprobs[j]``
        are the output tokens / logprobs of parent beam ``j`` and ``num_out`` their
        (common) count before this step. Returns each request's next running beams, in
        HF's order. Requests with the same beam count and candidate count are stacked,
        one tensor op per stage for all of them (HF's own batched arithmetic: each row's
        values are those of the request stepped alone, which
        ``tests/core/test_beam_step.py`` checks bit for bit; the HF beam parity suites
        check the search itself); only the finished hypotheses and the next beams'
        records are built per request."""
        buckets: dict[tuple[int, int], list[int]] = {}
        for i, (state, cands, *_) in enumerate(items):
            buckets.setdefault((state.num_beams, len(cands.scores)), []).append(i)
        out: list = [None] * len(items)
        for (num_beams, k), idx in buckets.items():
            group = [items[i] for i in idx]
            states = [it[0] for it in group]
            cur = [st.prompt_len + it[4] for st, it in zip(states, group)]
            topk = torch.tensor([it[1].scores for it in group], dtype=torch.float32)  # [G, k]
            ended_rows = []  # per candidate: a stop id, or the length limit (a loop: no call per request)
            for st, it, c in zip(states, group, cur):
                tokens = it[1].token_ids
                ended_rows.append([True] * len(tokens) if c + 1 >= st.max_length
                                  else list(map(st.stop_ids.__contains__, tokens)))
            ended = torch.tensor(ended_rows, dtype=torch.bool)

            # e. The next running beams: the best that did not end.
            running_cands = topk + ended.to(torch.float32) * _NEG
            next_idx = torch.topk(running_cands, k=num_beams, dim=1)[1]
            new_running = running_cands.gather(1, next_idx)

            # f. Finished hypotheses: the top num_beams candidates that ended, if better.
            top_mask = torch.zeros(len(group), k, dtype=torch.bool)
            top_mask[:, :num_beams] = True
            just_finished = ended & top_mask
            scores = torch.stack([st.scores for st in states])  # [G, B]
            is_finished = torch.stack([st.is_finished for st in states])
            lengths = torch.tensor([[(c + 1 - st.prompt_len) ** st.params.length_penalty]
                                    for st, c in zip(states, cur)], dtype=torch.float32)
            finished_scores = topk / lengths
            full = is_finished.all(dim=1, keepdim=True) & torch.tensor(
                [[st.params.early_stopping is True] for st in states])
            finished_scores += full.to(torch.float32) * _NEG
            finished_scores += torch.tensor([[float(not st.improvable)] for st in states]) * _NEG
            finished_scores += (~just_finished) * _NEG
            merged_scores = torch.cat((scores, finished_scores), dim=1)
            merged_finished = torch.cat((is_finished, just_finished), dim=1)
            keep_t = torch.topk(merged_scores, k=num_beams, dim=1)[1]
            new_scores = merged_scores.gather(1, keep_t)
            new_finished = merged_finished.gather(1, keep_t)

            # g. Whether the search goes on.
            best_lens = []
            for st, c in zip(states, cur):
                p = st.params
                best_len = st.max_length - st.prompt_len if p.early_stopping == "never" and p.length_penalty > 0.0 \
                    else c + 1 - st.prompt_len
                best_lens.append([best_len ** p.length_penalty])
            best_possible = new_running[:, :1] / torch.tensor(best_lens, dtype=torch.float32)
            worst = torch.where(new_finished, new_scores.amin(dim=1, keepdim=True), torch.tensor(_NEG))
            better = (best_possible > worst).any(dim=1).tolist()
            all_finished = new_finished.all(dim=1).tolist()
            all_ended = ended.all(dim=1).tolist()

            keeps, nexts, runs = keep_t.tolist(), next_idx.tolist(), running_cands.tolist()
            new_hyp = tuple.__new__  # Hypothesis(*fields) without a Python call
            for n, (i, st, it) in enumerate(zip(idx, states, group)):
                _, cands, parents_out, parents_logprobs, _ = it
                tokens = cands.token_ids
                new_hyps: list[Hypothesis | None] = []
                for m in keeps[n]:
                    if m < num_beams:
                        new_hyps.append(st.hyps[m])
                    else:
                        c = m - num_beams
                        j, t = cands.parents[c], tokens[c]
                        top = st._top(cands, j, t, c) if cands.top_logprobs is not None else None
                        logprobs = parents_logprobs[j] + [top] if top is not None else []
                        new_hyps.append(new_hyp(Hypothesis, (parents_out[j] + [t], logprobs, t in st.stop_ids)))
                st.scores, st.is_finished, st.hyps, st.running = new_scores[n], new_finished[n], new_hyps, new_running[n]
                st.improvable = st.improvable and better[n]
                all_full = all_finished[n] and st.params.early_stopping is True
                st.done = not (st.improvable and not all_full and not all_ended[n])
                nx = nexts[n]
                parents = list(map(cands.parents.__getitem__, nx))
                next_tokens = list(map(tokens.__getitem__, nx))
                tops = None
                if cands.top_logprobs is not None:
                    tops = [st._top(cands, p, t, c) for p, t, c in zip(parents, next_tokens, nx)]
                out[i] = NextBeams(parents, next_tokens, list(map(runs[n].__getitem__, nx)),
                                   list(map(cands.token_logprobs.__getitem__, nx)), tops)
        return out

    def _top(self, cands: BeamCandidates, parent: int, token: int, c: int) -> dict[int, float] | None:
        if cands.top_logprobs is None:
            return None
        d = dict(cands.top_logprobs[parent])
        d[token] = cands.token_logprobs[c]
        return d

    def best(self, n: int) -> list[tuple[Hypothesis | None, float]]:
        """The ``n`` best finished hypotheses with their scores, best first."""
        return [(self.hyps[i], float(self.scores[i])) for i in range(n)]
