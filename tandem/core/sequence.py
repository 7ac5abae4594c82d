"""Requests as the scheduler sees them: decoder sequences and the groups that hold them."""

from __future__ import annotations

import enum
from collections.abc import Hashable

from tandem.core.inputs import EncoderInputs
from tandem.core.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    # Every token was banned for it (allowed_token_ids, bad words, biases, ...):
    # nothing could be generated, so it ends here rather than emit a banned token.
    FINISHED_NO_TOKEN = "no_allowed_token"

    # Members are singletons compared by identity: hash them in C (Enum's own
    # __hash__ is a Python call, paid for every status test of every sequence each step).
    __hash__ = object.__hash__

    @property
    def finished(self) -> bool:
        return self in _FINISHED


_FINISHED = {
    SequenceStatus.FINISHED_STOPPED,
    SequenceStatus.FINISHED_LENGTH,
    SequenceStatus.FINISHED_ABORTED,
    SequenceStatus.FINISHED_NO_TOKEN,
}


# What each status reports as a finish reason (None: still going), read as a dict
# lookup where a finish is checked per sequence per step.
FINISH_REASON: dict[SequenceStatus, str | None] = {s: s.value if s in _FINISHED else None for s in SequenceStatus}


class Sequence:
    """One decoder sequence (or the static encoder sequence of a group).

    ``num_computed_tokens`` counts the tokens whose keys and values are in the
    cache; ``len - num_computed_tokens`` tokens are computed in the next step.
    There is no prefill phase and no decode phase.
    """

    def __init__(self, seq_id: int, prompt_token_ids: list[int], index: int = 0) -> None:
        self.seq_id = seq_id
        self.index = index  # which of the request's completions it is
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        self.status = SequenceStatus.WAITING
        self.cumulative_logprob: float | None = 0.0
        self.output_logprobs: list[dict[int, float]] = []
        self.stop_reason: int | str | None = None
        # Tokens its strategy schedules beyond the next one this step (drafts to
        # verify): computed after ``token_ids`` and given slots, but not the
        # sequence's until the strategy accepts them.
        self.lookahead_token_ids: list[int] = []

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_new_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    def append_token(self, token_id: int, logprob: float | None, top: dict[int, float] | None) -> None:
        """``logprob`` is None when the request asked for no logprobs (the sampler
        then skips them): the cumulative log-probability is None from then on."""
        self.output_token_ids.append(token_id)
        self.token_ids.append(token_id)
        if logprob is None or self.cumulative_logprob is None:
            self.cumulative_logprob = None
        else:
            self.cumulative_logprob += logprob
        if top is not None:
            self.output_logprobs.append(top)

    def reset_for_recompute(self) -> None:
        self.num_computed_tokens = 0
        self.lookahead_token_ids = []
        self.status = SequenceStatus.WAITING

    def fork(self, seq_id: int) -> "Sequence":
        """A copy under a new id (its blocks are the block manager's to share)."""
        child = Sequence(seq_id, self.prompt_token_ids, self.index)
        child.output_token_ids = list(self.output_token_ids)
        child.token_ids = list(self.token_ids)
        child.num_computed_tokens = self.num_computed_tokens
        child.status = self.status
        child.cumulative_logprob = self.cumulative_logprob
        child.output_logprobs = list(self.output_logprobs)
        return child

    @property
    def finished(self) -> bool:
        return self.status.finished

    def __repr__(self) -> str:
        return f"Sequence(id={self.seq_id}, len={len(self)}, status={self.status.name})"


class SequenceGroup:
    """All sequences of one request: its encoder inputs and n decoder sequences."""

    def __init__(
        self,
        request_id: str,
        encoder_inputs: EncoderInputs,
        seqs: list[Sequence],
        sampling_params: SamplingParams,
        arrival_time: float,
        lora_request=None,
    ) -> None:
        self.request_id = request_id
        # The LoRA adapter it runs with (a tandem.lora.LoRARequest; None: the base weights).
        self.lora_request = lora_request
        self.encoder_inputs = encoder_inputs
        self.seqs = seqs
        self.sampling_params = sampling_params
        self.arrival_time = arrival_time
        # True once the cross-attention cache holds the encoder's K/V (its own
        # encoder run, or that of the group whose cross table it shares).
        self.encoder_computed = False
        # The request's mode (``tandem.core.strategies``): set by the engine, or plain
        # sampling when the scheduler admits a group without one.
        self.strategy = None

    @property
    def max_num_seqs(self) -> int:
        """Sequences the group may run at once (as its strategy says)."""
        return self.strategy.max_num_seqs(self)

    @property
    def encoder_key(self) -> Hashable:
        """Groups with equal keys (equal encoder inputs, run with the same adapter) share
        one cross table. The key roots the encoder cache's entries and the prefix cache's
        chains too: an adapter changes the encoder's output and the decoder's K/V, so a
        request never reuses another adapter's (or the base model's) blocks."""
        lora = self.lora_request
        if lora is None:
            return self.encoder_inputs.cache_key
        return ("lora", lora.lora_int_id, lora.lora_path, self.encoder_inputs.cache_key)

    @property
    def lora_id(self) -> int:
        """The adapter's id (0: the base weights)."""
        return 0 if self.lora_request is None else self.lora_request.lora_int_id

    @property
    def encoder_len(self) -> int:
        """Encoder positions: the cross K/V length, and the encoder's share of a step."""
        return self.encoder_inputs.num_positions

    def get_seqs(self, status: SequenceStatus | None = None) -> list[Sequence]:
        if status is None:
            return list(self.seqs)
        return [s for s in self.seqs if s.status is status]

    def unfinished_seqs(self) -> list[Sequence]:
        return [s for s in self.seqs if not s.finished]

    @property
    def is_finished(self) -> bool:
        return all(s.finished for s in self.seqs)

    def reset_for_recompute(self) -> None:
        self.encoder_computed = False
        for seq in self.unfinished_seqs():
            seq.reset_for_recompute()

    def __repr__(self) -> str:
        return f"SequenceGroup({self.request_id!r}, enc_len={self.encoder_len}, seqs={self.seqs})"
