"""Turns last-position logits into next tokens, per each sequence's params.

Greedy and sampled rows: the logits processors on the raw logits, then argmax
or a draw from HF's warped distribution (temperature, top-k, top-p, min-p in
that order, ``tandem.core.worker.warpers``). Beam-search groups: the
processors on the log-probabilities, the group's running beam scores added,
and the top ``beams_to_keep`` (beam, token) continuations over all its beams,
exactly as HF ``generate`` picks them; the scheduler decides from those which
beams live on (``tandem.core.beam_search``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tandem.core.sampling_params import SamplingParams
from tandem.core.scheduler_output import BeamCandidates
from tandem.core.worker.logits_processors import LogitsProcessors, ProcessorRows
from tandem.core.worker.reductions import argmax_rows
from tandem.core.worker.warpers import draw, sampling_probs

# HF's score for the beams that start as copies of the first (so only its tokens count).
BEAM_PLACEHOLDER_SCORE = -1e9


@dataclass
class BeamRows:
    """One beam-search group's rows in the step: ``rows`` (its running beams, or
    the single prompt sequence on the first step) and their running scores."""

    request_id: str
    rows: list[int]
    scores: list[float]  # num_beams running scores (float32 values)
    num_beams: int
    beams_to_keep: int


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[float | None]  # chosen token's log-probability; None where not asked for
    top_logprobs: list[dict[int, float] | None]
    beams: dict[str, BeamCandidates] = field(default_factory=dict)
    failed_rows: dict[int, str] = field(default_factory=dict)  # row -> why its request failed
    # Rows whose processed scores were all -inf (every token banned): their token is meaningless.
    no_token_rows: list[int] = field(default_factory=list)


class Sampler:
    def __init__(self, eos_token_ids: list[int], seed: int = 0, device: torch.device | str = "cpu") -> None:
        self.eos_token_ids = list(eos_token_ids)
        self.processors = LogitsProcessors(self.eos_token_ids)
        # Requests without a seed of their own draw from the engine's stream,
        # not torch's global one, so the engine never touches global state.
        self.generator = torch.Generator(device=device).manual_seed(seed)

    def __call__(
        self,
        logits: torch.Tensor,
        rows: ProcessorRows,
        generators: list[torch.Generator | None],
        beams: list[BeamRows] | None = None,
    ) -> SamplerOutput:
        """``logits`` is float32 ``[S, vocab]``; row ``i`` samples with ``rows.params[i]``
        from ``generators[i]`` (None: the engine's stream), except the rows of ``beams``.
        The returned token lists hold the non-beam rows, in row order."""
        params = rows.params
        beam_rows = sorted(i for b in beams or () for i in b.rows)
        if beam_rows:
            r = torch.tensor(beam_rows, device=logits.device)
            logits.index_copy_(0, r, torch.log_softmax(logits.index_select(0, r), dim=-1))
        scores = self.processors(logits, rows)
        out = SamplerOutput([], [], [])
        beam_set = set(beam_rows)
        plain = [i for i in range(len(params)) if i not in beam_set] if beam_rows else None
        if plain is None or plain:
            sub = scores if plain is None else scores.index_select(0, torch.tensor(plain, device=scores.device))
            sub_params = params if plain is None else [params[i] for i in plain]
            sub_gens = generators if plain is None else [generators[i] for i in plain]
            out.token_ids, out.logprobs, out.top_logprobs = self._sample(sub, sub_params, sub_gens)
            self._check_chosen(sub, out, plain)
        for b in beams or ():
            out.beams[b.request_id] = self._beam_candidates(scores, b, params[b.rows[0]])
        out.failed_rows = {**self.processors.failures, **out.failed_rows}
        return out

    @staticmethod
    def _check_chosen(scores: torch.Tensor, out: SamplerOutput, plain: list[int] | None) -> None:
        """A chosen token whose processed score is -inf means every token was banned;
        NaN or +inf means the scores themselves are broken (the model's logits)."""
        tokens = torch.tensor(out.token_ids, device=scores.device)
        chosen = scores.gather(1, tokens[:, None]).squeeze(1)
        bad = ~torch.isfinite(chosen)
        if not bool(bad.any()):
            return
        for j, value in zip(bad.nonzero().flatten().tolist(), chosen[bad].tolist()):
            row = j if plain is None else plain[j]
            if value == -float("inf"):
                out.no_token_rows.append(row)
            else:
                out.failed_rows[row] = f"its next-token scores are not finite ({value}): the model's logits hold NaN or inf"

    # -- greedy and sampled rows -----------------------------------------------------
    def _sample(self, logits: torch.Tensor, params: list[SamplingParams], generators):
        # Log-probabilities cost a logsumexp over the vocabulary per row (~4% of a
        # CPU decode step at vocab 50K), so only rows that ask for logprobs get
        # them; the full log-softmax is never built (top-k uses logits - lse).
        want = [(i, p.logprobs) for i, p in enumerate(params) if p.logprobs is not None]
        greedy = [p.greedy for p in params]
        tokens = torch.empty(len(params), dtype=torch.long, device=logits.device)
        greedy_rows = [i for i, g in enumerate(greedy) if g]
        if len(greedy_rows) == len(params):  # all greedy: no copy of the logits
            tokens = argmax_rows(logits)
        elif greedy_rows:
            rows = torch.tensor(greedy_rows, device=logits.device)
            tokens[rows] = argmax_rows(logits.index_select(0, rows))
        sample_rows = [i for i, g in enumerate(greedy) if not g]
        if sample_rows:
            rows = torch.tensor(sample_rows, device=logits.device)
            probs = sampling_probs(logits.index_select(0, rows), [params[i] for i in sample_rows])
            tokens[rows] = draw(probs, [generators[i] for i in sample_rows], self.generator)

        token_list = tokens.tolist()
        top: list[dict[int, float] | None] = [None] * len(params)
        chosen: list[float | None] = [None] * len(params)
        if want:
            rows = torch.tensor([i for i, _ in want], device=logits.device)
            sub = logits if len(want) == len(params) else logits.index_select(0, rows)
            lse = torch.logsumexp(sub, dim=-1, keepdim=True)
            sub_chosen = (sub.gather(1, tokens.index_select(0, rows)[:, None]) - lse).squeeze(1).tolist()
            k_max = max(k for _, k in want)
            vals, idx = sub.topk(k_max, dim=-1) if k_max else (None, None)
            if k_max:
                vals = (vals - lse).tolist()
                idx = idx.tolist()
            for j, (i, k) in enumerate(want):
                d = {} if not k else dict(zip(idx[j][:k], vals[j][:k]))
                d[token_list[i]] = sub_chosen[j]
                top[i] = d
                chosen[i] = sub_chosen[j]
        return token_list, chosen, top

    # -- beam search -------------------------------------------------------------------
    @staticmethod
    def _beam_candidates(scores: torch.Tensor, b: BeamRows, p: SamplingParams) -> BeamCandidates:
        """HF's top-k continuations: processed log-probs plus each beam's running
        score, flattened over (beam, token), the best ``beams_to_keep``."""
        logp = scores.index_select(0, torch.tensor(b.rows, device=scores.device))
        vocab = logp.shape[1]
        if len(b.rows) == 1 and b.num_beams > 1:
            # First step: HF runs num_beams copies of the prompt, all but the first
            # scored -1e9; one row stands for all of them.
            logp = logp.expand(b.num_beams, vocab)
        running = torch.tensor(b.scores, dtype=torch.float32, device=scores.device)
        accumulated = (logp + running[:, None]).reshape(1, -1)
        values, idx = torch.topk(accumulated, k=b.beams_to_keep)
        values, idx = values[0], idx[0]
        beam = idx // vocab
        token = idx % vocab
        token_logprob = logp.reshape(-1).index_select(0, idx)
        parent = beam if len(b.rows) > 1 else torch.zeros_like(beam)
        top = None
        if p.logprobs is not None:
            rows_logp = logp[: len(b.rows)]
            k = p.logprobs
            top = []
            if k:
                vals, ids = rows_logp.topk(k, dim=-1)
                top = [dict(zip(ids[r].tolist(), vals[r].tolist())) for r in range(len(b.rows))]
            else:
                top = [{} for _ in b.rows]
        return BeamCandidates(
            scores=values.tolist(),
            parents=parent.tolist(),
            token_ids=token.tolist(),
            token_logprobs=token_logprob.tolist(),
            top_logprobs=top,
        )
