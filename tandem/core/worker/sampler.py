"""Turns last-position logits into next tokens, per each sequence's params."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.core.sampling_params import SamplingParams


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[float]  # chosen token's log-probability
    top_logprobs: list[dict[int, float] | None]


class Sampler:
    def __init__(self, eos_token_ids: list[int], seed: int = 0, device: torch.device | str = "cpu") -> None:
        self.eos_token_ids = list(eos_token_ids)
        # Requests without a seed of their own draw from the engine's stream,
        # not torch's global one, so the engine never touches global state.
        self.generator = torch.Generator(device=device).manual_seed(seed)

    def __call__(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        num_output_tokens: list[int],
    ) -> SamplerOutput:
        """``logits`` is float32 ``[S, vocab]``; row ``i`` samples with ``params[i]`` from
        ``generators[i]`` (None: the engine's stream) after ``num_output_tokens[i]`` tokens."""
        self._suppress_stop_tokens(logits, num_output_tokens, params)
        # The chosen token's log-probability needs only the row's logsumexp;
        # the full log-softmax is built only when top-k logprobs are asked for.
        lse = torch.logsumexp(logits, dim=-1, keepdim=True)

        greedy = [p.greedy for p in params]
        tokens = torch.empty(len(params), dtype=torch.long, device=logits.device)
        greedy_rows = [i for i, g in enumerate(greedy) if g]
        if greedy_rows:
            rows = torch.tensor(greedy_rows, device=logits.device)
            tokens[rows] = logits.index_select(0, rows).argmax(dim=-1)
        sample_rows = [i for i, g in enumerate(greedy) if not g]
        if sample_rows:
            rows = torch.tensor(sample_rows, device=logits.device)
            probs = self._probs(logits.index_select(0, rows), [params[i] for i in sample_rows])
            tokens[rows] = self._draw(probs, [generators[i] for i in sample_rows], self.generator)

        chosen = (logits.gather(1, tokens[:, None]) - lse).squeeze(1)
        top: list[dict[int, float] | None] = [None] * len(params)
        want = [(i, p.logprobs) for i, p in enumerate(params) if p.logprobs is not None]
        if want:
            k_max = max(k for _, k in want)
            vals, idx = logits.topk(k_max, dim=-1) if k_max else (None, None)
            if k_max:
                vals = vals - lse
            for i, k in want:
                d = {} if not k else dict(zip(idx[i, :k].tolist(), vals[i, :k].tolist()))
                d[int(tokens[i])] = float(chosen[i])
                top[i] = d
        return SamplerOutput(tokens.tolist(), chosen.tolist(), top)

    def _suppress_stop_tokens(self, logits, num_output_tokens: list[int], params: list[SamplingParams]) -> None:
        """Before ``min_tokens`` exist, EOS and the stop tokens cannot be picked."""
        young = [i for i, (n, p) in enumerate(zip(num_output_tokens, params)) if n < p.min_tokens]
        if not young:
            return
        eos_rows = [i for i in young if not params[i].ignore_eos]
        if eos_rows and self.eos_token_ids:
            rows = torch.tensor(eos_rows, device=logits.device)[:, None]
            logits[rows, torch.tensor(self.eos_token_ids, device=logits.device)] = -float("inf")
        for i in young:
            if params[i].stop_token_ids:
                logits[i, params[i].stop_token_ids] = -float("inf")

    @staticmethod
    def _probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        dev = logits.device
        temp = torch.tensor([p.temperature for p in params], device=dev)[:, None]
        logits = logits / temp
        vocab = logits.shape[-1]
        top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=dev)
        top_p = torch.tensor([p.top_p for p in params], device=dev)
        min_p = torch.tensor([p.min_p for p in params], device=dev)
        if (top_k < vocab).any() or (top_p < 1).any():
            sorted_logits, order = logits.sort(dim=-1, descending=True)
            ranks = torch.arange(vocab, device=dev)[None, :]
            drop = ranks >= top_k[:, None]
            sorted_probs = sorted_logits.softmax(dim=-1)
            # Keep the smallest prefix whose mass reaches top_p (always the first token).
            mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
            drop |= mass_before >= top_p[:, None]
            sorted_logits = sorted_logits.masked_fill(drop, -float("inf"))
            logits = torch.empty_like(logits).scatter_(1, order, sorted_logits)
        probs = logits.softmax(dim=-1)
        if (min_p > 0).any():
            floor = min_p[:, None] * probs.max(dim=-1, keepdim=True).values
            probs = probs.masked_fill(probs < floor, 0.0)
            probs = probs / probs.sum(dim=-1, keepdim=True)
        return probs

    @staticmethod
    def _draw(
        probs: torch.Tensor, generators: list[torch.Generator | None], default: torch.Generator
    ) -> torch.Tensor:
        # argmax(p / q) with q ~ Exp(1) draws from p; seeded rows use their own stream.
        q = torch.empty_like(probs)
        unseeded = [i for i, g in enumerate(generators) if g is None]
        if unseeded:
            shape = (len(unseeded), probs.shape[1])
            q[unseeded] = torch.empty(shape, device=probs.device).exponential_(generator=default)
        for i, g in enumerate(generators):
            if g is not None:
                row = torch.empty(probs.shape[1]).exponential_(generator=g)
                q[i] = row.to(probs.device)
        return (probs / q).argmax(dim=-1)
