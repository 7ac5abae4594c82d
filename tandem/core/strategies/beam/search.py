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


@dataclass
class Hypothesis:
    output_token_ids: list[int]
    output_logprobs: list[dict[int, float]]
    finished_by_stop: bool  # ended on an EOS / stop token (else on length)


@dataclass
class NextBeam:
    parent: int  # index into the step's running beams
    token_id: int
    score: float
    token_logprob: float
    top_logprobs: dict[int, float] | None


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

    def step(
        self,
        cands: BeamCandidates,
        parents_out: list[list[int]],
        parents_logprobs: list[list[dict[int, float]]],
        num_out: int,
    ) -> list[NextBeam]:
        """Advance by one token. ``parents_out[j]`` / ``parents_logprobs[j]`` are the
        output tokens / logprobs of parent beam ``j``; ``num_out`` their (common)
        count before this step. Returns the next running beams, in HF's order."""
        p = self.params
        cur_len = self.prompt_len + num_out
        k = len(cands.scores)
        topk = torch.tensor(cands.scores, dtype=torch.float32)
        tokens = cands.token_ids
        ended = torch.tensor(
            [t in self.stop_ids or cur_len + 1 >= self.max_length for t in tokens], dtype=torch.bool
        )

        # e. The next running beams: the best that did not end.
        running_cands = topk + ended.to(torch.float32) * _NEG
        next_idx = torch.topk(running_cands, k=self.num_beams)[1]
        new_running = running_cands.index_select(0, next_idx)

        # f. Finished hypotheses: the top num_beams candidates that ended, if better.
        top_mask = torch.zeros(k, dtype=torch.bool)
        top_mask[: self.num_beams] = True
        just_finished = ended & top_mask
        finished_scores = topk / ((cur_len + 1 - self.prompt_len) ** p.length_penalty)
        full = bool(self.is_finished.all()) and p.early_stopping is True
        finished_scores += torch.tensor(float(full)) * _NEG
        finished_scores += torch.tensor(float(not self.improvable)) * _NEG
        finished_scores += (~just_finished) * _NEG
        merged_scores = torch.cat((self.scores, finished_scores))
        merged_finished = torch.cat((self.is_finished, just_finished))
        keep = torch.topk(merged_scores, k=self.num_beams)[1].tolist()
        new_hyps: list[Hypothesis | None] = []
        for m in keep:
            if m < self.num_beams:
                new_hyps.append(self.hyps[m])
            else:
                c = m - self.num_beams
                j, t = cands.parents[c], tokens[c]
                top = self._top(cands, j, t, c)
                logprobs = parents_logprobs[j] + [top] if top is not None else []
                new_hyps.append(Hypothesis(parents_out[j] + [t], logprobs, t in self.stop_ids))
        self.scores = merged_scores[keep]
        self.is_finished = merged_finished[keep]
        self.hyps = new_hyps
        self.running = new_running

        # g. Whether the search goes on.
        cur_len += 1
        if p.early_stopping == "never" and p.length_penalty > 0.0:
            best_len = self.max_length - self.prompt_len
        else:
            best_len = cur_len - self.prompt_len
        best_possible = self.running[:1] / (best_len ** p.length_penalty)
        worst = torch.where(self.is_finished, torch.min(self.scores), torch.tensor(_NEG))
        self.improvable = self.improvable and bool(torch.any(best_possible > worst))
        all_full = bool(self.is_finished.all()) and p.early_stopping is True
        self.done = not (self.improvable and not all_full and not bool(ended.all()))

        out = []
        for c in next_idx.tolist():
            j, t = cands.parents[c], tokens[c]
            out.append(NextBeam(j, t, float(running_cands[c]), cands.token_logprobs[c], self._top(cands, j, t, c)))
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
