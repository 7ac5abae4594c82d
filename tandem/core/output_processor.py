"""From the core's per-request results to ``RequestOutput``s: the frontend's own
per-request state, incremental detokenization, stop strings, and the output kind
(cumulative, delta or final only).

The core reports plain data (``core_outputs.RequestResult``: new token ids,
logprobs, finish reasons) and keeps no output state. The core stops sequences on
token ids and lengths; stop strings need text, so they are found here, a token
at a time, and reported back to the core, which frees the sequence
(``stops``). Each sequence's text is detokenized once, incrementally, the
sequences a step advanced together (``detokenizer.py``): the final text is
exactly what was streamed (DELTA chunks add up to it). ``stream_interval``
spaces a streaming request's outputs by tokens (the engine's option).

One ``OutputProcessor`` serves both frontends, as vLLM's does: ``LLMEngine.step``
runs it on the caller's thread and returns the outputs; ``AsyncLLM``'s output loop
runs it on the event loop for each step's results, and each output goes to its
request's own queue (given at ``add_request``), where its consumer awaits it. A
request whose output cannot be built fails alone (``ProcessedOutputs.failed``:
the frontend fails it in the core).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tandem.core.core_outputs import OutputShape, RequestInfo, RequestResult
from tandem.core.detokenizer import BatchDetokenizer, DetokenizerStream, IncrementalDetokenizer
from tandem.core.faults import describe
from tandem.core.outputs import CompletionOutput, RequestOutput, with_error
from tandem.core.sampling_params import RequestOutputKind


@dataclass
class _Completion:
    detok: IncrementalDetokenizer | DetokenizerStream | None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float | None = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    text: str = ""  # what the caller may see: cut before a stop string
    num_detok: int = 0  # tokens fed to the detokenizer
    num_tokens_sent: int = 0  # DELTA: tokens already returned
    num_chars_sent: int = 0  # DELTA: characters already returned
    num_logprobs_sent: int = 0
    num_tokens_shown: int = 0  # tokens when the last output was built (stream_interval)
    finish_shown: bool = False  # whether an output has shown its finish reason

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


# (completion index, completion, its text's length before the step): what a step's text is checked for.
Followed = list[tuple[int, _Completion, int]]


class RequestState:
    """One request's output state on the frontend side: everything an output shows.

    ``batch``: the processor's batch detokenizer, which then grows this request's text
    (else each completion has its own ``IncrementalDetokenizer``); ``stream_interval``:
    tokens per streamed output (the engine's option): a streaming request's output is
    built when a completion has that many tokens not yet shown, when one finished, and
    for its first and last step; 1, every step it advanced."""

    def __init__(self, info: RequestInfo, tokenizer, queue: Any = None, *, batch: BatchDetokenizer | None = None,
                 stream_interval: int = 1) -> None:
        p = info.params
        self.info, self.params, self.tokenizer = info, p, tokenizer
        self.queue = queue  # its outputs go here (put_nowait) instead of the step's list
        self.batch = batch if tokenizer is not None else None
        self.interval = stream_interval
        self.shown = False  # whether an output was built
        self.replaced = False  # whether a completion was replaced since the last output
        self.prompt_token_ids = list(info.prompt_token_ids)
        self.probe_prob: float | None = None
        # The request's modes say how its outputs are shaped (core_outputs.OutputShape).
        shape = self.shape = info.shape if info.shape is not None else OutputShape(p.n)
        self.stop_strings = p.stop_strings if shape.stop_strings else []
        # Text is followed step by step only when someone reads it before the end;
        # otherwise it is detokenized once, when the sequence finishes.
        self.follow = tokenizer is not None and shape.streams and (
            bool(self.stop_strings) or p.output_kind is not RequestOutputKind.FINAL_ONLY
        )
        self.hold = max((len(x) for x in self.stop_strings), default=1) - 1
        self.completions = [self._new() for _ in range(shape.num_completions)]
        self.error: str | None = None

    def _new(self) -> _Completion:
        return _Completion(self._detokenizer(), logprobs=[] if self.params.logprobs is not None else None)

    def _detokenizer(self) -> IncrementalDetokenizer | DetokenizerStream | None:
        if self.tokenizer is None:
            return None
        if self.batch is not None:
            return self.batch.stream(self.params.skip_special_tokens, self.info.non_text_token_ids)
        return IncrementalDetokenizer(self.tokenizer, self.params.skip_special_tokens, self.info.non_text_token_ids)

    @property
    def finished(self) -> bool:
        if self.error is not None:
            return True
        # Read for every request every step: a plain loop, no generator or property calls.
        for c in self.completions:
            if c.finish_reason is None:
                return False
        return bool(self.completions)

    def update(self, result: RequestResult) -> dict[int, str]:
        """Apply a step's result; returns the completions a stop string ended, by
        index (the core is to stop them)."""
        followed = self.apply(result)
        for _, c, _ in followed:
            if c.detok is not None and c.num_detok < len(c.token_ids):
                c.detok.add(c.token_ids[c.num_detok:])
                c.num_detok = len(c.token_ids)
        return self.find_stops(followed)

    def apply(self, result: RequestResult) -> Followed:
        """Apply a step's result but for the text: returns the completions whose text
        is to grow now (the caller detokenizes them, then :meth:`find_stops`)."""
        followed = []
        if result.prompt_token_ids is not None:
            self.prompt_token_ids = list(result.prompt_token_ids)
        if result.probe_prob is not None:
            self.probe_prob = result.probe_prob
        if result.error is not None:
            self.error = result.error
        for d in result.completions:
            while d.index >= len(self.completions):
                self.completions.append(self._new())
            c = self.completions[d.index]
            if c.finish_reason is not None:  # ended here by a stop string; the core may not know yet
                continue
            if d.replace:
                c.token_ids, c.num_detok, c.text = list(d.new_token_ids), 0, ""
                self.replaced = True
                if c.detok is not None:
                    c.detok = self._detokenizer()
                if c.logprobs is not None:
                    c.logprobs = list(d.new_logprobs or ())
            else:
                c.token_ids.extend(d.new_token_ids)
                if c.logprobs is not None and d.new_logprobs:
                    c.logprobs.extend(d.new_logprobs)
            c.cumulative_logprob = d.cumulative_logprob
            c.finish_reason, c.stop_reason = d.finish_reason, d.stop_reason
            if self.follow or d.finish_reason is not None:
                followed.append((d.index, c, len(c.text)))
        return followed

    def find_stops(self, followed: Followed) -> dict[int, str]:
        """Take the followed completions' grown text; returns those a stop string
        ended, by index."""
        stops: dict[int, str] = {}
        for index, c, before in followed:
            if c.detok is not None:
                c.text = c.detok.text
            if self.stop_strings:
                hit = self._check_stop_strings(c, before)
                if hit is not None:
                    stops[index] = hit
        return stops

    def _check_stop_strings(self, c: _Completion, before: int) -> str | None:
        # Stop ids and EOS take precedence; a length finish still yields to a stop string.
        if c.finish_reason == "stop" or len(c.token_ids) < self.params.min_tokens:
            return None
        # Only the new text and the longest stop string's worth before it can hold a new match.
        start = max(0, before - self.hold)
        hits = [(at, x) for x in self.stop_strings if (at := c.text.find(x, start)) >= 0]
        if not hits:
            return None
        at, x = min(hits)
        c.text = c.text[:at]
        c.finish_reason, c.stop_reason = "stop", x
        return x

    def abort(self) -> None:
        for c in self.completions:
            if not c.finished:
                c.finish_reason = "abort"

    def output(self, finished: bool | None = None) -> RequestOutput:
        """``finished``: :attr:`finished` when the caller knows it."""
        p = self.params
        delta = p.output_kind is RequestOutputKind.DELTA
        outs = []
        for i, c in enumerate(self.completions):
            text = c.text
            if self.stop_strings and c.finish_reason is None:
                # Hold back a possible stop string's beginning: sent text cannot be taken back.
                text = text[: max(0, len(text) - self.hold)]
            tokens, logprobs = c.token_ids, c.logprobs
            if delta:
                tokens = tokens[c.num_tokens_sent:]
                logprobs = logprobs[c.num_logprobs_sent:] if logprobs is not None else None
                text, c.num_chars_sent = text[c.num_chars_sent:], max(c.num_chars_sent, len(text))
                c.num_tokens_sent = len(c.token_ids)
                c.num_logprobs_sent = len(c.logprobs) if c.logprobs is not None else 0
            c.num_tokens_shown, c.finish_shown = len(c.token_ids), c.finish_reason is not None
            outs.append(CompletionOutput(
                index=i, text=text, token_ids=list(tokens), cumulative_logprob=c.cumulative_logprob,
                logprobs=list(logprobs) if logprobs is not None else None,
                finish_reason=c.finish_reason, stop_reason=c.stop_reason,
            ))
        self.shown, self.replaced = True, False
        if self.error is not None:
            outs = with_error(outs, self.shape.num_completions, self.error)
        info = self.info
        return RequestOutput(
            request_id=info.request_id, encoder_prompt=info.encoder_prompt,
            encoder_prompt_token_ids=list(info.encoder_prompt_token_ids), prompt=info.prompt,
            prompt_token_ids=list(self.prompt_token_ids), outputs=outs,
            finished=self.finished if finished is None else finished, error=self.error, probe_prob=self.probe_prob,
        )

    def step_output(self, finished: bool | None = None) -> RequestOutput | None:
        """The output the request's kind asks for after a step (``finished``: the
        request's :attr:`finished` when the caller knows it), or None."""
        if finished is None:
            finished = self.finished
        if not finished:
            if not self.shape.streams or self.params.output_kind is RequestOutputKind.FINAL_ONLY:
                return None
            if self.interval > 1 and self.shown and not self.replaced and not self._due():
                return None
        return self.output(finished)

    def _due(self) -> bool:
        """Whether a completion has ``stream_interval`` tokens not yet shown, or a finish."""
        for c in self.completions:
            if len(c.token_ids) - c.num_tokens_shown >= self.interval or (c.finish_reason is not None
                                                                          and not c.finish_shown):
                return True
        return False


@dataclass
class ProcessedOutputs:
    """A step's outputs, and what the frontend reports back to the core."""

    outputs: list[RequestOutput]  # of the requests without a queue (the others' went to theirs)
    stops: dict[str, dict[int, str]]  # request id -> completion index -> the stop string found
    failed: dict[str, str]  # request id -> why its output could not be built


class OutputProcessor:
    """Every live request's ``RequestState``, for the frontend that follows them.

    With a fast tokenizer one ``BatchDetokenizer`` grows the text of every request a
    step advanced at once (``tandem/core/detokenizer.py``). ``stream_interval``: tokens
    per streamed output (:class:`RequestState`)."""

    def __init__(self, tokenizer, stream_interval: int = 1) -> None:
        self.tokenizer = tokenizer
        self.stream_interval = stream_interval
        self.batch = BatchDetokenizer(tokenizer) if BatchDetokenizer.supports(tokenizer) else None
        self.requests: dict[str, RequestState] = {}

    def add_request(self, info: RequestInfo, queue: Any = None) -> RequestState:
        """Follow a request the core accepted; ``queue``: where its outputs go (an
        ``asyncio.Queue``, put to from the thread that runs :meth:`process`)."""
        state = self.requests[info.request_id] = RequestState(info, self.tokenizer, queue, batch=self.batch,
                                                              stream_interval=self.stream_interval)
        return state

    def forget(self, request_id: str) -> None:
        """Drop a request's state without building its output."""
        self.requests.pop(request_id, None)

    def process(self, results: list[RequestResult]) -> ProcessedOutputs:
        """The step's outputs, the stop-string hits and the failed requests to report
        to the core. A result for a request no longer followed (finished here first)
        is dropped; a request whose output cannot be built fails alone, with an output
        that says why (after the step's other outputs). The text of every request the
        step advanced grows in one batch, before any stop string is looked for."""
        outputs, stops, failed, errors = [], {}, {}, []
        applied: list[tuple[RequestState, Followed]] = []
        batched: list[tuple[DetokenizerStream, list[int]]] = []  # for the batch detokenizer
        for result in results:
            state = self.requests.get(result.request_id)
            if state is None:
                continue
            try:
                followed = state.apply(result)
                for _, c, _ in followed:
                    if c.detok is None or c.num_detok >= len(c.token_ids):
                        continue
                    new = c.token_ids[c.num_detok:]
                    c.num_detok = len(c.token_ids)
                    if c.detok.__class__ is DetokenizerStream:
                        batched.append((c.detok, new))
                    else:
                        c.detok.add(new)
            except Exception as e:  # noqa: BLE001 - this request's output
                self._fail(state, e, failed, errors)
                continue
            applied.append((state, followed))
        bad = self.batch.add(batched) if batched else None
        for state, followed in applied:
            rid = state.info.request_id
            try:
                if bad:
                    for _, c, _ in followed:
                        if c.detok in bad:
                            raise bad[c.detok]
                hits = state.find_stops(followed)
                finished = state.finished
                out = state.step_output(finished)
            except Exception as e:  # noqa: BLE001 - detokenizing this request's output
                self._fail(state, e, failed, errors)
                continue
            if hits:
                stops[rid] = hits
            if finished:
                self.requests.pop(rid, None)
            if out is not None:
                if state.queue is None:  # _emit, inline: once per request every step
                    outputs.append(out)
                else:
                    state.queue.put_nowait(out)
        for state, out in errors:
            self._emit(state, out, outputs)
        return ProcessedOutputs(outputs, stops, failed)

    def _fail(self, state: RequestState, e: Exception, failed: dict[str, str], errors: list) -> None:
        rid = state.info.request_id
        self.requests.pop(rid, None)
        failed[rid] = f"building its output failed: {describe(e)}"
        outs = with_error([], state.shape.num_completions, failed[rid])
        errors.append((state, RequestOutput(rid, None, [], None, [], outs, True, error=failed[rid])))

    @staticmethod
    def _emit(state: RequestState, out: RequestOutput, outputs: list[RequestOutput]) -> None:
        if state.queue is None:
            outputs.append(out)
        else:
            state.queue.put_nowait(out)

    def abort(self, request_id: str, error: str | None = None) -> RequestOutput | None:
        """The final output of a request ended from outside (aborted, or failed with
        ``error``); None if it is not followed."""
        state = self.requests.pop(request_id, None)
        if state is None:
            return None
        state.abort()
        state.error = error
        return state.output()
