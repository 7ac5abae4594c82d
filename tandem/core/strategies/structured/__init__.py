"""Structured output as a mode: another strategy (plain sampling) whose every token
is one the request's grammar allows.

The request is ready once its grammar compiled (``manager.py``
compiles it off the step loop); then each of its sequences gets a matcher (the
``n > 1``: one each). Each step the manager
fills the masks of the scheduled sequences from their matchers and the worker
applies them before the logits processors; here each matcher then accepts its
sequence's sampled token, and a sequence whose matcher terminated (it accepted
EOS where the grammar is complete) is finished.

A sequence left with no token to sample (the grammar allows none of the
vocabulary there, or the request's bans remove all it allows) fails the request
with an ``error`` saying which and after how many tokens: its completion ends
``no_allowed_token`` with the tokens it had, the request's others ``abort``. It
is not a finish: text the grammar cannot complete does not follow the spec, and
an output without ``error`` is always one the grammar ended or ``max_tokens`` cut.

Where the grammar then admits exactly one continuation, the sequence jumps over it
(``jump.py``): its tokens follow the sampled one in the same update and are
computed as one chunk the next step. Not where the request asks for what a jumped
token, which is never scored, cannot give (``jump.why_not_exact``), nor where the
engine option ``structured_outputs_disable_jump_forward`` is set, nor where its
grammar's searches could not be bounded (``bounds.GrammarCost.jump``); a search
past its CPU budget fails its request (``jump.JumpSearch``).

A JSON output its grammar ended is checked (``validate.py``) before it finishes:
one that is not valid for its schema fails the request instead.

The matchers live with the request on the scheduler's side, so preemption
leaves them as they are: a swapped-out sequence keeps its tokens and its
matcher, and a recomputed one recomputes the keys and values of the same
tokens (tandem keeps the generated tokens through a recompute), which the
matcher has accepted already.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from tandem.core.core_outputs import RequestResult
from tandem.core.sequence import SequenceStatus
from tandem.core.strategies.base import RequestFailed, RequestStrategy, SchedulerOps, StepMode
from tandem.core.strategies.modes import Mode, RequestContext
from tandem.core.strategies.sampling import finish_reason
from tandem.core.strategies.structured.jump import (
    DEFAULT_JUMP_TIMEOUT_S, JumpBudgetError, JumpCounters, JumpForward, JumpSearch, jump_stats, why_not_exact,
)
from tandem.core.strategies.structured.validate import OutputChecker

if TYPE_CHECKING:
    from tandem.core.scheduler_output import ModelRunnerOutput, ScheduledGroup
    from tandem.core.sequence import SequenceGroup


class StructuredStrategy(RequestStrategy):
    def __init__(self, grammar: Future, new_matcher: Callable[[Any], Any], inner: RequestStrategy,
                 num_allowed: Callable[[Any], int], jump: Callable[[], JumpForward] | None = None,
                 check: Callable[[list[int]], str | None] | None = None,
                 jump_mode: Callable[[], str] | None = None) -> None:
        """``grammar``: the future of the compiled grammar; ``new_matcher(compiled)``:
        a fresh matcher; ``inner``: the strategy whose tokens are constrained;
        ``num_allowed(matcher)``: how many ids the matcher allows next; ``jump``: the
        engine's jump-forward, once the grammar compiled (None: the request never jumps);
        ``check(output ids)``: why an output its grammar ended is not valid (None: it is;
        ``validate.py``), or None for kinds not checked; ``jump_mode()``: how the compiled
        grammar's jump searches run (``bounds.GrammarCost.jump``; "off": no jumps)."""
        self.grammar, self.new_matcher, self.inner, self.num_allowed = grammar, new_matcher, inner, num_allowed
        self.check = check
        self._jump_mode = jump_mode
        self.inline = False
        self.matchers: dict[int, Any] = {}  # seq id -> its matcher
        self._jump_factory = jump
        self.jump: JumpForward | None = None

    def ready(self, group: "SequenceGroup") -> bool:
        if not self.grammar.done():
            return False
        if not self.matchers:
            compiled = self.grammar.result()  # raises the compile error: the request fails
            # Every sequence starts from the grammar's start (a fresh matcher is as cheap
            # as a fork, which xgrammar only has from 0.2).
            for seq in group.seqs:
                self.matchers[seq.seq_id] = self.new_matcher(compiled)
            mode = self._jump_mode() if self._jump_mode is not None else "budget"
            if self._jump_factory is not None and mode != "off":
                self.jump = self._jump_factory()
                self.inline = mode == "inline"
        return True

    def max_num_seqs(self, group: "SequenceGroup") -> int:
        return self.inner.max_num_seqs(group)

    def num_initial_seqs(self, params) -> int:
        return self.inner.num_initial_seqs(params)

    def lookahead(self, group: "SequenceGroup") -> bool:
        return self.inner.lookahead(group)

    def batch_items(self, group: "SequenceGroup", sg: "ScheduledGroup | None"):
        yield from self.inner.batch_items(group, sg)
        if sg is not None:
            ids = [ss.seq_id for ss in sg.seqs]
            yield StructuredOutputMode.name, (sg.request_id, ids, [self.matchers[i] for i in ids])

    def blocks_needed_at_most(self, group: "SequenceGroup", full_len: int, block_size: int) -> int | None:
        return self.inner.blocks_needed_at_most(group, full_len, block_size)

    def aborted(self, group: "SequenceGroup"):
        return self.inner.aborted(group)

    def step_mode(self, group: "SequenceGroup") -> StepMode | None:
        return self.inner.step_mode(group)

    def update(
        self, ops: SchedulerOps, group: "SequenceGroup", sg: "ScheduledGroup", result: "ModelRunnerOutput",
        rows: dict[int, int],
    ) -> RequestResult | None:
        """Each matcher accepts its sequence's token (a token the grammar rejects fails
        the request: only a user logits processor that revives masked tokens can pick
        one), then the inner strategy appends them; terminated matchers finish their
        sequences. A sequence with no token to sample fails the request (module doc)."""
        by_id = {s.seq_id: s for s in group.seqs}
        if result.no_token_seq_ids:
            dead = [by_id[ss.seq_id] for ss in sg.seqs
                    if ss.seq_id in result.no_token_seq_ids and not by_id[ss.seq_id].finished]
            if dead:
                for seq in dead:
                    seq.status = SequenceStatus.FINISHED_NO_TOKEN
                raise RequestFailed(self._dead_end(group, dead[0]))
        for ss in sg.seqs:
            if by_id[ss.seq_id].finished:
                continue
            token = result.token_ids[rows[ss.seq_id]]
            if not self.matchers[ss.seq_id].accept_token(token):
                raise ValueError(
                    f"sampled token {token}, which its structured output does not allow there (a logits "
                    "processor gave a masked token a finite score)"
                )
            if self.check is not None and self.matchers[ss.seq_id].is_terminated():
                # The grammar ended it (EOS accepted): checked before it finishes as "stop".
                why = self.check(by_id[ss.seq_id].output_token_ids)
                if why is not None:
                    so = group.sampling_params.structured_outputs
                    which = f" (completion {by_id[ss.seq_id].index})" if len(group.seqs) > 1 else ""
                    raise RequestFailed(
                        f"StructuredOutputsParams.{so.kind}: the output its grammar ended{which} is not valid for the "
                        f"{'schema' if so.kind == 'json' else 'JSON object it asks for'}: {why}; it is refused rather "
                        "than finished as 'stop'")
        res = self.inner.update(ops, group, sg, result, rows)
        ended = False
        for ss in sg.seqs:
            seq = by_id[ss.seq_id]
            if not seq.finished and self.matchers[ss.seq_id].is_terminated():
                # EOS accepted under ignore_eos: the grammar has nothing more to say.
                seq.status = SequenceStatus.FINISHED_STOPPED
                ended = True
        if ended and res is not None:
            for delta in res.completions:
                seq = next(s for s in group.seqs if s.index == delta.index)
                delta.finish_reason = seq.status.value if seq.finished else None
            ops.release_finished(group)
            res.finished = group.is_finished
        if self.jump is not None and res is not None and not group.is_finished:
            self._jump(ops, group, sg, res, by_id)
        return res

    def _jump(self, ops: SchedulerOps, group: "SequenceGroup", sg: "ScheduledGroup", res: RequestResult,
              by_id: dict) -> None:
        """Each sequence that just sampled a token jumps over what its grammar forces
        next (``jump.py``): the forced tokens join this step's output (the sampled
        token replaced where the two tokenize differently together) and are computed
        with it as one chunk in the next step. Never past ``max_tokens``."""
        p = group.sampling_params
        stops = frozenset(p.stop_token_ids or ())
        deltas = {d.index: d for d in res.completions}
        ended = False
        for ss in sg.seqs:
            seq = by_id[ss.seq_id]
            d = deltas.get(seq.index)
            if (seq.finished or d is None or d.replace or not d.new_token_ids
                    or d.new_token_ids[-1] != seq.output_token_ids[-1]):
                continue
            matcher = self.matchers[ss.seq_id]
            try:
                ids = self.jump.after(matcher, seq.output_token_ids[-1], p.max_tokens - len(seq.output_token_ids),
                                      stops, self.inline)
            except JumpBudgetError as e:
                raise RequestFailed(f"StructuredOutputsParams.{p.structured_outputs.kind}: {e}") from None
            if ids is None:
                continue
            # Not emitted and its keys and values not computed yet: replacing it is free.
            seq.output_token_ids[-1] = seq.token_ids[-1] = d.new_token_ids[-1] = ids[0]
            for j, token in enumerate(ids[1:], 1):
                seq.append_token(token, None, None)
                d.new_token_ids.append(token)
                ops.check_stop(seq, group)
                if seq.finished:
                    if j < len(ids) - 1:
                        matcher.rollback(len(ids) - 1 - j)  # the matcher holds what the sequence holds
                    break
            d.cumulative_logprob = seq.cumulative_logprob
            if seq.finished:
                d.finish_reason, d.stop_reason = finish_reason(seq), seq.stop_reason
                ended = True
        if ended:
            ops.release_finished(group)
            res.finished = group.is_finished

    def _dead_end(self, group: "SequenceGroup", seq) -> str:
        """Why ``seq`` has no token to sample: the grammar allows none of the vocabulary,
        or the request's own bans remove every token it allows."""
        kind = group.sampling_params.structured_outputs.kind
        n = len(seq.output_token_ids)
        where = "at the start of the output" if n == 0 else f"after {n} generated token{'s' if n > 1 else ''}"
        if len(group.seqs) > 1:
            where += f" (completion {seq.index})"
        allowed = self.num_allowed(self.matchers[seq.seq_id])
        if allowed == 0:
            what = "begin the output" if n == 0 else "continue the output"
            return (f"StructuredOutputsParams.{kind}: cannot be satisfied by this model's vocabulary: {where}, "
                    f"its grammar allows no token (no token's text can {what} as the spec requires)")
        return (f"StructuredOutputsParams.{kind}: cannot be satisfied under this request's sampling parameters: "
                f"{where}, its grammar allows {allowed} token{'s' if allowed > 1 else ''} and the request bans "
                f"{'each' if allowed > 1 else 'it'} (allowed_token_ids, bad_words_ids, suppress_tokens, logit_bias, "
                "min_tokens)")

class StructuredOutputMode(Mode):
    """Requests with ``structured_outputs``: the engine's grammar compiler
    (``services["structured"]``, a ``StructuredOutputManager``) compiles off the step
    loop; each step its ``grammar_mask`` is the logits transform of their rows."""

    name = "structured_output"
    order = 20

    def __init__(self, ctx) -> None:
        super().__init__(ctx)
        self.manager = ctx.services.get("structured")
        self.jump_enabled = not getattr(ctx.config, "structured_outputs_disable_jump_forward", False)
        self.jump_counters = JumpCounters()
        self._jump_search = JumpSearch(getattr(ctx.config, "structured_outputs_jump_timeout", DEFAULT_JUMP_TIMEOUT_S))
        self._jump: JumpForward | None = None
        self._checker = OutputChecker()
        self._token_bytes: tuple[list[bytes], bytes] | None = None

    def applies(self, req: RequestContext) -> bool:
        return req.params.structured_outputs is not None

    def strategy(self, req: RequestContext, inner: RequestStrategy | None) -> RequestStrategy:
        # Raises ImportError (no xgrammar) or ValueError (no tokenizer, no EOS) at the door;
        # the compile itself runs off the step loop and a failure is this request's error.
        m = self.manager
        backend = m.backend
        jump = self._jump_forward if self.jump_enabled and why_not_exact(req.params) is None else None
        so = req.params.structured_outputs
        check = None
        if so.kind in ("json", "json_object"):
            schema = so.spec if so.kind == "json" else None
            check = lambda ids: self._why_invalid(schema, ids)  # noqa: E731
        return StructuredStrategy(m.grammar(so), backend.matcher, inner, backend.num_allowed, jump, check,
                                  lambda: backend.jump_mode(so))

    def _why_invalid(self, schema: str | None, ids: list[int]) -> str | None:
        # The text the grammar matched: each id's string as xgrammar sees it (built with
        # the first compile, before any output).
        if self._token_bytes is None:
            backend = self.manager.backend
            sep = backend.joined.separator.encode("utf-8") if backend.joined is not None else b""
            self._token_bytes = (backend.token_bytes()[0], sep)
        strings, sep = self._token_bytes
        text = b"".join(strings[i] for i in ids if 0 <= i < len(strings))
        if sep and text.startswith(sep):
            text = text[len(sep):]  # the grammar's first separator, written by no decoder
        return self._checker.why_invalid(schema, text)

    def _jump_forward(self) -> JumpForward:
        # Once a grammar compiled: the vocabulary table is built with the compiler.
        if self._jump is None:
            backend = self.manager.backend
            strings, never = backend.token_bytes()
            self._jump = JumpForward(backend.tokenizer, strings, never, self.jump_counters, self._jump_search)
        return self._jump

    def stats(self) -> dict[str, int]:
        return jump_stats(self.jump_counters)

    def logits_transform(self, items: list):
        return self.manager.grammar_mask(items)

    def has_pending(self) -> bool:
        return self.manager.has_pending()

    def wait(self, timeout: float) -> None:
        self.manager.wait(timeout)
