"""From engine progress to ``RequestOutput``s: incremental detokenization, stop
strings, and the per-request output kind (cumulative, delta or final only).

The core stops sequences on token ids and lengths; stop strings need text, so
they are found here, a token at a time, without decoding the whole output
again each step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tandem.core.outputs import CompletionOutput, RequestOutput
from tandem.core.sampling_params import RequestOutputKind, SamplingParams
from tandem.core.sequence import Sequence, SequenceGroup, SequenceStatus


class IncrementalDetokenizer:
    """One sequence's output text, grown a token at a time.

    Fast tokenizers use the tokenizers library's ``DecodeStream``, which keeps
    just enough of the tail to emit complete characters. Other tokenizers fall
    back to decoding the whole output and taking the new suffix."""

    def __init__(self, tokenizer, skip_special_tokens: bool) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.text = ""
        self._ids: list[int] = []
        backend = getattr(tokenizer, "_tokenizer", None)
        self._stream = None
        if backend is not None:
            from tokenizers.decoders import DecodeStream

            self._backend = backend
            self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)

    def add(self, token_ids: list[int]) -> str:
        """Feed new tokens; returns the text they complete (possibly empty)."""
        if self._stream is not None:
            pieces = [self._stream.step(self._backend, t) for t in token_ids]
            new = "".join(p for p in pieces if p)
        else:
            self._ids.extend(token_ids)
            full = self.tokenizer.decode(self._ids, skip_special_tokens=self.skip_special_tokens)
            if not full.startswith(self.text):  # the tokenizer revised earlier text: start over
                self.text = ""
            new = full[len(self.text):]
        self.text += new
        return new


@dataclass
class _SeqState:
    detok: IncrementalDetokenizer | None
    text: str = ""  # what the caller may see: cut before a stop string
    num_tokens_sent: int = 0  # DELTA: tokens already returned
    num_chars_sent: int = 0  # DELTA: characters already returned
    num_logprobs_sent: int = 0


@dataclass
class _RequestState:
    params: SamplingParams
    seqs: dict[int, _SeqState] = field(default_factory=dict)


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._requests: dict[str, _RequestState] = {}

    def add_request(self, group: SequenceGroup) -> None:
        p = group.sampling_params
        # Text is followed step by step only when someone reads it before the end.
        follow = self.tokenizer is not None and not p.use_beam_search and (
            bool(p.stop_strings) or p.output_kind is not RequestOutputKind.FINAL_ONLY
        )
        state = _RequestState(p)
        for seq in group.seqs:
            detok = IncrementalDetokenizer(self.tokenizer, p.skip_special_tokens) if follow else None
            state.seqs[seq.seq_id] = _SeqState(detok)
        self._requests[group.request_id] = state

    def forget(self, request_id: str) -> None:
        """Drop a request's state without building its output (it failed)."""
        self._requests.pop(request_id, None)

    def process(self, group: SequenceGroup, new_tokens: dict[int, int]) -> RequestOutput | None:
        """After a step: ``new_tokens[seq_id]`` tokens were appended to those sequences.

        Finds stop strings (finishing the sequence), then returns the output the
        request's kind asks for now, or None."""
        state = self._requests[group.request_id]
        p = state.params
        if p.use_beam_search:  # beams change until the end: nothing to show before it
            return self.make_output(group) if group.is_finished else None
        for seq in group.seqs:
            n = new_tokens.get(seq.seq_id, 0)
            s = state.seqs[seq.seq_id]
            if n and s.detok is not None:
                before = len(s.detok.text)
                s.detok.add(seq.output_token_ids[-n:])
                s.text = s.detok.text
                if p.stop_strings:
                    self._check_stop_strings(seq, s, p, before)
        if p.output_kind is RequestOutputKind.FINAL_ONLY and not group.is_finished:
            return None
        return self.make_output(group)

    @staticmethod
    def _check_stop_strings(seq: Sequence, s: _SeqState, p: SamplingParams, before: int) -> None:
        # Stop ids and EOS take precedence; a length finish still yields to a stop string.
        if seq.status is SequenceStatus.FINISHED_STOPPED or len(seq.output_token_ids) < p.min_tokens:
            return
        # Only the new text and the longest stop string's worth before it can hold a new match.
        start = max(0, before - max(len(x) for x in p.stop_strings) + 1)
        hits = [(at, x) for x in p.stop_strings if (at := s.text.find(x, start)) >= 0]
        if hits:
            at, x = min(hits)
            s.text = s.text[:at]
            seq.status, seq.stop_reason = SequenceStatus.FINISHED_STOPPED, x

    def make_output(self, group: SequenceGroup) -> RequestOutput:
        state = self._requests[group.request_id]
        p = state.params
        delta = p.output_kind is RequestOutputKind.DELTA
        completions = []
        for i, seq in enumerate(group.seqs):
            s = state.seqs.get(seq.seq_id) or state.seqs.setdefault(seq.seq_id, _SeqState(None))
            text = s.text
            if seq.finished and not isinstance(seq.stop_reason, str) and self.tokenizer is not None:
                # The final text is the tokenizer's own decode of the whole output.
                text = self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=p.skip_special_tokens)
            elif not seq.finished and p.stop_strings:
                # Hold back a possible stop string's beginning: sent text cannot be taken back.
                text = text[: max(0, len(text) - max(len(x) for x in p.stop_strings) + 1)]
            tokens, logprobs = seq.output_token_ids, seq.output_logprobs
            if delta:
                tokens, logprobs = tokens[s.num_tokens_sent:], logprobs[s.num_logprobs_sent:]
                text, s.num_chars_sent = text[s.num_chars_sent:], len(text)
                s.num_tokens_sent, s.num_logprobs_sent = len(seq.output_token_ids), len(seq.output_logprobs)
            completions.append(
                CompletionOutput(
                    index=i,
                    text=text,
                    token_ids=list(tokens),
                    cumulative_logprob=seq.cumulative_logprob,
                    logprobs=list(logprobs) if p.logprobs is not None else None,
                    finish_reason=seq.status.value if seq.finished else None,
                    stop_reason=seq.stop_reason,
                )
            )
        out = RequestOutput(
            request_id=group.request_id,
            encoder_prompt=group.encoder_prompt,
            encoder_prompt_token_ids=list(group.encoder_prompt_token_ids),
            prompt=group.prompt,
            prompt_token_ids=list(group.seqs[0].prompt_token_ids),
            outputs=completions,
            finished=group.is_finished,
        )
        if group.is_finished:
            del self._requests[group.request_id]
        return out
