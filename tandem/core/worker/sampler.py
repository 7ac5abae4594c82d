"""Turns last-position logits into next tokens, per each sequence's params.

The logits processors run on every row; then each row not claimed by a mode
(``tandem.core.strategies``: beam search, a prompt slot) gets its argmax or a
draw from HF's warped distribution (temperature, top-k, top-p, min-p in that
order, ``tandem.core.worker.warpers``). The processed scores are returned for
the modes to pick from.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tandem.core.sampling_params import SamplingParams
from tandem.core.worker.greedy_screen import StepScreen
from tandem.core.worker.logits_processors import LogitsProcessors, ProcessorRows
from tandem.core.worker.reductions import argmax_rows
from tandem.core.worker.warpers import draw, sampling_probs

@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[float | None]  # chosen token's log-probability; None where not asked for
    top_logprobs: list[dict[int, float] | None]
    scores: torch.Tensor | None = None  # every row's processed scores [S, vocab]
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
        claimed: list[int] | None = None,
        screen: StepScreen | None = None,
    ) -> SamplerOutput:
        """``logits`` is float32 ``[S, vocab]``; row ``i`` samples with ``rows.params[i]``
        from ``generators[i]`` (None: the engine's stream), except the ``claimed`` rows
        (sorted), which a mode picks from ``scores``. The returned token lists hold the
        other rows, in row order. ``screen``: the step's :class:`StepScreen` when its rows
        are all plain greedy; if the LM head screened, ``logits`` are int8 logits and the
        tokens come from ``screen.tokens`` (exact float32 argmaxes)."""
        params = rows.params
        scores = self.processors(logits, rows)
        out = SamplerOutput([], [], [], scores)
        claimed_set = set(claimed or ())
        plain = [i for i in range(len(params)) if i not in claimed_set] if claimed_set else None
        if plain is None or plain:
            sub = scores if plain is None else scores.index_select(0, torch.tensor(plain, device=scores.device))
            sub_params = params if plain is None else [params[i] for i in plain]
            sub_gens = generators if plain is None else [generators[i] for i in plain]
            screened = screen.tokens(scores) if screen is not None and plain is None else None
            if screened is not None:
                n = len(params)
                out.token_ids, bad = self._take(sub, screened)
                out.logprobs, out.top_logprobs = [None] * n, [None] * n
            else:
                out.token_ids, out.logprobs, out.top_logprobs, bad = self._sample(sub, sub_params, sub_gens)
            self._check_chosen(out, bad, plain)
        out.failed_rows = {**self.processors.failures, **out.failed_rows}
        return out

    @staticmethod
    def _take(scores: torch.Tensor, tokens: torch.Tensor) -> tuple[list[int], list[tuple[int, float]]]:
        """The chosen tokens as a list, and ``(row, score)`` of each row whose chosen
        token's processed score is not finite: one device-to-host copy for both (a
        second only when some row is bad)."""
        chosen = scores.gather(1, tokens[:, None]).squeeze(1)
        both = torch.stack([tokens, torch.isfinite(chosen).to(tokens.dtype)]).tolist()
        token_list, finite = both
        if all(finite):
            return token_list, []
        bad = [j for j, ok in enumerate(finite) if not ok]
        values = chosen.index_select(0, torch.tensor(bad, device=scores.device)).tolist()
        return token_list, list(zip(bad, values))

    @staticmethod
    def _check_chosen(out: SamplerOutput, bad: list[tuple[int, float]], plain: list[int] | None) -> None:
        """A chosen token whose processed score is -inf means every token was banned;
        NaN or +inf means the scores themselves are broken (the model's logits)."""
        for j, value in bad:
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
        # Per distinct params object, not per row (rows of one request, or of requests
        # whose resolved params are equal, share it).
        distinct = {id(p): p for p in params}
        if len(distinct) == 1:
            (p0,) = distinct.values()
            want = [(i, p0.logprobs) for i in range(len(params))] if p0.logprobs is not None else []
            greedy = [p0.greedy] * len(params)
        else:
            is_greedy = {k: p.greedy for k, p in distinct.items()}
            want = [(i, p.logprobs) for i, p in enumerate(params) if p.logprobs is not None]
            greedy = [is_greedy[id(p)] for p in params]
        tokens = torch.empty(len(params), dtype=torch.long, device=logits.device)
        all_greedy = greedy.count(True) == len(params)
        greedy_rows = [] if all_greedy else [i for i, g in enumerate(greedy) if g]
        if all_greedy:  # no copy of the logits
            tokens = argmax_rows(logits)
        elif greedy_rows:
            rows = torch.tensor(greedy_rows, device=logits.device)
            tokens[rows] = argmax_rows(logits.index_select(0, rows))
        sample_rows = [] if all_greedy else [i for i, g in enumerate(greedy) if not g]
        if sample_rows:
            rows = torch.tensor(sample_rows, device=logits.device)
            probs = sampling_probs(logits.index_select(0, rows), [params[i] for i in sample_rows])
            tokens[rows] = draw(probs, [generators[i] for i in sample_rows], self.generator)

        token_list, bad = self._take(logits, tokens)
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
        return token_list, chosen, top, bad
