"""An example mode from outside ``tandem/``: "forced words" forces given token ids
at given output positions of every request whose id starts with ``forced-``. It
wraps whatever base mode the request runs (sampling, ``n > 1``, beams) through one
batch hook, a logits transform; ``FAULT`` makes one request's hook raise."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.core.strategies.base import LogitsTransform, RequestStrategy
from tandem.core.strategies.modes import Mode, RequestContext
from tandem.plugins import hookimpl

# Output position -> the token forced there.
FORCED: dict[int, int] = {1: 7, 3: 11}
# (request id, hook name) whose hook raises, for the fault-isolation tests.
FAULT: tuple[str, str] | None = None


@dataclass(frozen=True)
class ForceTokens(LogitsTransform):
    seq_ids: list[int]
    forced: dict[int, int]

    def apply(self, logits, rows, owners, num_output_tokens) -> None:
        for r, n in zip(rows, num_output_tokens):
            token = self.forced.get(n)
            if token is not None:
                keep = logits[r, token].clone()
                logits[r] = -float("inf")
                logits[r, token] = keep


class ForcedStrategy(RequestStrategy):
    def __init__(self, request_id: str, inner: RequestStrategy) -> None:
        self.request_id, self.inner = request_id, inner

    def _maybe_fail(self, hook: str) -> None:
        if FAULT == (self.request_id, hook):
            raise RuntimeError(f"injected fault in {hook}")

    def max_num_seqs(self, group):
        return self.inner.max_num_seqs(group)

    def num_initial_seqs(self, params):
        return self.inner.num_initial_seqs(params)

    def blocks_needed_at_most(self, group, full_len, block_size):
        return self.inner.blocks_needed_at_most(group, full_len, block_size)

    def ready(self, group):
        self._maybe_fail("ready")
        return self.inner.ready(group)

    def lookahead(self, group):
        self._maybe_fail("lookahead")
        return self.inner.lookahead(group)

    def step_mode(self, group):
        self._maybe_fail("step_mode")
        return self.inner.step_mode(group)

    def batch_items(self, group, sg):
        yield from self.inner.batch_items(group, sg)
        if sg is None:
            yield ForcedWordsMode.name, self.request_id  # for before_schedule: which requests run
        else:
            self._maybe_fail("batch_items")
            yield ForcedWordsMode.name, [ss.seq_id for ss in sg.seqs]

    def update(self, ops, group, sg, result, rows):
        self._maybe_fail("update")
        return self.inner.update(ops, group, sg, result, rows)


class ForcedWordsMode(Mode):
    name = "forced_words"
    order = 30
    excludes = frozenset({"structured_output"})  # a grammar may not allow the forced token
    yields_to = frozenset({"speculative"})  # drafts would be verified against unforced logits

    def applies(self, req: RequestContext) -> bool:
        return req.request_id.startswith("forced-")

    def strategy(self, req: RequestContext, inner):
        return ForcedStrategy(req.request_id, inner)

    def before_schedule(self, items):
        # A mode-level fault: it concerns every request the mode was given.
        if FAULT is not None and FAULT[1] == "before_schedule" and any(rid == FAULT[0] for _, rid in items):
            raise RuntimeError("injected fault in before_schedule")

    def logits_transform(self, items):
        if FAULT is not None and FAULT[1] == "logits_transform":
            raise RuntimeError("injected fault in logits_transform")
        return ForceTokens([s for ids in items for s in ids], dict(FORCED)), {}


class Plugin:
    @hookimpl
    def tandem_register_modes(self, registry) -> None:
        registry.register_mode("forced_words", ForcedWordsMode)


plugin = Plugin()
