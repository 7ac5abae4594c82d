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

The finished hypotheses hold token lists (``Hypothesis``: their parent beam's,
read when wanted); only running beams hold KV blocks. The state is lists of
float32 values, made into tensors for each stacked step.
"""

from __future__ import annotations

from typing import NamedTuple
import torch

from tandem.core.sampling_params import SamplingParams

_NEG = -1.0e9  # HF's "impossible" score


class BeamCandidates(NamedTuple):
    """One beam-search group's best continuations this step, best first (HF's
    ``beams_to_keep``): each is a parent beam (index into the group's scheduled
    sequences), a token and the accumulated score (float32 values). A named tuple:
    ``select_all`` makes one per request with ``tuple.__new__``, no Python call."""

    scores: list[float]
    parents: list[int]
    token_ids: list[int]
    token_logprobs: list[float]  # the token's processed log-probability alone
    top_logprobs: list[dict[int, float]] | None = None  # per parent row, when asked for


class Hypothesis(tuple):
    """A hypothesis the search kept: its parent beam's output tokens (and logprobs) as
    the step found them, and its last token. Up to ``num_beams`` are made per request
    every step, nearly all of them dropped unread, so the token list is not copied
    then: the hypothesis holds the parent's own list with its length at that step (a
    sequence's lists are only appended to, or replaced, never cut or rewritten below
    their length), and the lists are made when read. ``step_all`` builds them with
    ``tuple.__new__(Hypothesis, (parent_out, n, token, parent_logprobs, n_logprobs,
    top, finished_by_stop))``, which is no Python call."""

    __slots__ = ()

    @property
    def output_token_ids(self) -> list[int]:
        return self[0][:self[1]] + [self[2]]

    @property
    def output_logprobs(self) -> list[dict[int, float]]:
        top = self[5]
        return [] if top is None else self[3][:self[4]] + [top]

    @property
    def finished_by_stop(self) -> bool:  # ended on an EOS / stop token (else on length)
        return self[6]


class NextBeams(NamedTuple):
    """One request's next running beams, in HF's order: beam ``i`` continues running
    beam ``parents[i]`` (an index into the step's running beams) with ``token_ids[i]``.
    Lists, one named tuple per request (``tuple.__new__``): no Python call."""

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
        # Lists of float32 values (a stacked step makes its tensors from them and
        # takes them back with one copy each, exactly: float32 -> float -> float32).
        # Running beam scores; the first step's extra beams are copies scored -1e9.
        self.running: list[float] = [0.0] + [_NEG] * (self.num_beams - 1)
        # Finished hypotheses, best first (HF's sequences / beam_scores / is_sent_finished).
        self.scores: list[float] = [_NEG] * self.num_beams
        self.is_finished: list[bool] = [False] * self.num_beams
        self.hyps: list[Hypothesis | None] = [None] * self.num_beams
        self.improvable = True  # HF's is_early_stop_heuristic_unsatisfied
        self.done = False

    def running_scores(self) -> list[float]:
        return self.running  # replaced each step, never changed in place

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
            # Each request's inputs, in one loop (no call per request): its candidates'
            # scores, whether each ended (a stop id, or the length limit), its finished
            # scores and flags, and [length ** penalty, early_stopping is True, not
            # improvable, best possible length ** penalty].
            cand_rows, ended_rows, scores_rows, finished_rows, const_rows = [], [], [], [], []
            for st, it in zip(states, group):
                p, cands, c = st.params, it[1], st.prompt_len + it[4]
                cand_rows.append(cands.scores)
                ended_rows.append([True] * len(cands.token_ids) if c + 1 >= st.max_length
                                  else list(map(st.stop_ids.__contains__, cands.token_ids)))
                scores_rows.append(st.scores)
                finished_rows.append(st.is_finished)
                best_len = st.max_length - st.prompt_len if p.early_stopping == "never" and p.length_penalty > 0.0 \
                    else c + 1 - st.prompt_len
                const_rows.append(((c + 1 - st.prompt_len) ** p.length_penalty, float(p.early_stopping is True),
                                   float(not st.improvable), best_len ** p.length_penalty))
            topk = torch.tensor(cand_rows, dtype=torch.float32)  # [G, k]
            ended = torch.tensor(ended_rows, dtype=torch.bool)
            const = torch.tensor(const_rows, dtype=torch.float32)  # [G, 4]

            # e. The next running beams: the best that did not end.
            running_cands = topk + ended.to(torch.float32) * _NEG
            next_idx = torch.topk(running_cands, k=num_beams, dim=1)[1]
            new_running = running_cands.gather(1, next_idx)

            # f. Finished hypotheses: the top num_beams candidates that ended, if better.
            top_mask = torch.zeros(len(group), k, dtype=torch.bool)
            top_mask[:, :num_beams] = True
            just_finished = ended & top_mask
            scores = torch.tensor(scores_rows, dtype=torch.float32)  # [G, B]
            is_finished = torch.tensor(finished_rows, dtype=torch.bool)
            finished_scores = topk / const[:, 0:1]
            full = is_finished.all(dim=1, keepdim=True) & (const[:, 1:2] != 0)
            finished_scores += full.to(torch.float32) * _NEG
            finished_scores += const[:, 2:3] * _NEG
            finished_scores += (~just_finished) * _NEG
            merged_scores = torch.cat((scores, finished_scores), dim=1)
            merged_finished = torch.cat((is_finished, just_finished), dim=1)
            keep_t = torch.topk(merged_scores, k=num_beams, dim=1)[1]
            new_scores = merged_scores.gather(1, keep_t)
            new_finished = merged_finished.gather(1, keep_t)

            # g. Whether the search goes on.
            best_possible = new_running[:, :1] / const[:, 3:4]
            worst = torch.where(new_finished, new_scores.amin(dim=1, keepdim=True), torch.tensor(_NEG))
            better = (best_possible > worst).any(dim=1).tolist()
            all_finished = new_finished.all(dim=1).tolist()
            all_ended = ended.all(dim=1).tolist()

            keeps, nexts = keep_t.tolist(), next_idx.tolist()
            new_scores, new_finished, new_running = new_scores.tolist(), new_finished.tolist(), new_running.tolist()
            new_hyp = tuple.__new__  # Hypothesis(fields), NextBeams(fields) without a Python call
            for n, (i, st, it) in enumerate(zip(idx, states, group)):
                _, cands, parents_out, parents_logprobs, _ = it
                tokens, hyps, tops = cands.token_ids, st.hyps, cands.top_logprobs
                new_hyps: list[Hypothesis | None] = []
                for m in keeps[n]:
                    if m < num_beams:
                        new_hyps.append(hyps[m])
                        continue
                    c = m - num_beams
                    j, t = cands.parents[c], tokens[c]
                    out_j = parents_out[j]
                    if tops is None:
                        new_hyps.append(new_hyp(Hypothesis, (out_j, len(out_j), t, None, 0, None, t in st.stop_ids)))
                    else:
                        lp_j = parents_logprobs[j]
                        new_hyps.append(new_hyp(Hypothesis, (out_j, len(out_j), t, lp_j, len(lp_j),
                                                             st._top(cands, j, t, c), t in st.stop_ids)))
                st.scores, st.is_finished, st.hyps, st.running = new_scores[n], new_finished[n], new_hyps, new_running[n]
                st.improvable = st.improvable and better[n]
                all_full = all_finished[n] and st.params.early_stopping is True
                st.done = not (st.improvable and not all_full and not all_ended[n])
                nx = nexts[n]
                parents = list(map(cands.parents.__getitem__, nx))
                next_tokens = list(map(tokens.__getitem__, nx))
                next_tops = None
                if tops is not None:
                    next_tops = [st._top(cands, p, t, c) for p, t, c in zip(parents, next_tokens, nx)]
                out[i] = new_hyp(NextBeams, (parents, next_tokens, new_running[n],
                                             list(map(cands.token_logprobs.__getitem__, nx)), next_tops))
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
