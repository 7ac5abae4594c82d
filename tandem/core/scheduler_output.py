"""What crosses from the scheduler to the worker and back: plain data only.

The scheduler keeps the live ``Sequence`` / ``SequenceGroup`` objects; the
worker sees ids, token ids, block ids and counts, so it could run in another
process (or as several tensor-parallel ranks) without sharing Python objects.
The worker keeps what it needs across steps (sampling parameters, seeded
generators, the persistent block tables) keyed by request and sequence id, and
drops it when the request id shows up in ``finished_request_ids``.

The per-step records (``ScheduledSequence``, ``ScheduledGroup``) are slotted, not
frozen: one of each is needed per running row every step, and a frozen dataclass's
``__init__`` (one ``object.__setattr__`` per field) cost 4x a slotted one's. Nothing
changes them until the next ``schedule()``, which may reuse them: a steady decode
group of one sequence gets its last record back, advanced in place
(``Scheduler._steady``). What must outlive the step copies them (a process
boundary does).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tandem.core.inputs import EncoderInputs
from tandem.core.sampling_params import SamplingParams

@dataclass(frozen=True)
class NewRequestData:
    """Sent once, the first time a request is scheduled."""

    request_id: str
    sampling_params: SamplingParams
    # A seeded request's sequences in completion order (``Sequence.index``): the worker
    # gives each its own random stream (``worker.seeded_stream``). Empty without a seed.
    seq_ids: tuple[int, ...] = ()


@dataclass(slots=True)
class ScheduledSequence:
    """One decoder sequence's work this step."""

    seq_id: int
    # The tokens whose K/V are computed now, at positions num_computed_tokens, ...
    token_ids: list[int]
    num_computed_tokens: int
    # Block-table update: the whole table when ``replace_blocks`` (first time
    # scheduled, after a swap, a recompute or a copy-on-write), else the ids
    # appended since the table was last sent (often none).
    block_ids: list[int]
    replace_blocks: bool
    # Output tokens so far, for processors that depend on it (min_tokens).
    num_output_tokens: int
    # The tokens already computed, sent when the worker has not seen this
    # sequence before although it has computed tokens (a sequence forked from
    # another), so processors that read the past have it.
    prefix_token_ids: list[int] | None = None
    # Positions whose logits the step returns: the last ``num_logits`` of
    # ``token_ids`` (more than one when draft tokens are verified).
    num_logits: int = 1


@dataclass(slots=True)
class ScheduledGroup:
    """One request's work this step: its running decoder sequences, and its
    encoder when it runs now (``encoder_inputs`` is None when the cross table
    already holds, or is being filled this step by a sharer, its K/V)."""

    request_id: str
    seqs: list[ScheduledSequence]
    encoder_inputs: EncoderInputs | None
    num_encoder_positions: int  # cross K/V length every sequence attends to
    cross_block_table: list[int]
    # The request's step mode, as plain data the worker hands the rows of this group
    # to (``tandem.core.strategies``); None: plain sampling by the request's params.
    mode: Any = None  # a tandem.core.strategies.base.StepMode
    # The request's LoRA adapter (tandem.lora.LoRARequest); None: the base weights.
    lora_request: Any = None
    # kv_compress: decoder positions below this have their attention to the encoder
    # observed (the observation window); 0: none are.
    cross_observe_until: int = 0
    # kv_compress: whether its cross table is compressed (the worker reads one re-packed
    # per head through its layout, ``CrossKVCompressor.layouts``).
    cross_compressed: bool = False

    @property
    def run_encoder(self) -> bool:
        return self.encoder_inputs is not None


@dataclass(frozen=True)
class CrossRepack:
    """kv_compress: re-pack a request's cross K/V from ``src_blocks`` (``src_positions``
    encoder positions) into ``dst_blocks`` (``dst_positions`` slots), each (layer, KV head)
    keeping the positions it attended to most. The worker does it first in the step,
    before swaps, copies and the forward pass (the source blocks may be reused later in
    the same step)."""

    request_id: str
    src_blocks: list[int]
    src_positions: int
    dst_blocks: list[int]
    dst_positions: int


@dataclass(frozen=True)
class SamplingInputs:
    """What sampling needs beside the scheduler output: the modes' logits
    transforms for this step (``tandem.core.strategies.base.LogitsTransform``),
    applied in order to the raw logits."""

    transforms: list[Any]


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledGroup]
    num_batched_tokens: int
    # (src_block, dst_block) pairs moved between the device and host pools
    blocks_to_swap_in: list[tuple[int, int]]
    blocks_to_swap_out: list[tuple[int, int]]
    # (src_block, dst_block) device pairs to copy after the swaps and before the
    # forward pass: shared blocks a sequence is about to write into (copy-on-write)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    preempted: int = 0
    new_requests: list[NewRequestData] = field(default_factory=list)
    # Requests that finished or were aborted since the last step: the worker
    # forgets them (their blocks are already free in the block manager).
    finished_request_ids: list[str] = field(default_factory=list)
    finished_seq_ids: list[int] = field(default_factory=list)
    # kv_compress: cross tables to re-pack, first of all (``CrossRepack``).
    cross_repacks: list[CrossRepack] = field(default_factory=list)
    # Sequences that took another's place after the last step (a beam continuing another
    # beam's hypothesis keeps its own id: ``Scheduler.take_over``), each ``(src seq id,
    # dst seq id, n, block ids)``: before anything else, the worker's state of dst becomes
    # src's as the last step left it: its token history, and its block table the first
    # ``n`` ids of src's followed by ``block ids``. Applied before the step's forgets, so a
    # dst or src finished since is copied, then forgotten.
    seq_copies: list[tuple[int, int, int, list[int]]] = field(default_factory=list)
    # (src_block, dst_block) device pairs copied first of all, before re-packs, swaps and
    # ``blocks_to_copy``: the partly filled blocks of those sequences, their K/V as the last
    # step left them (whatever this step does to a block afterwards comes after).
    blocks_to_copy_first: list[tuple[int, int]] = field(default_factory=list)
    # Indices into ``scheduled`` (ascending) of the groups whose block tables the worker
    # may not hold as they are: every group but the scheduler's steady decode records
    # that open no block (``Scheduler._steady``), whose self and cross tables the worker
    # was sent already. The worker looks at these groups' table updates only (their
    # encoders included: a group that runs its encoder is listed). None: look at all.
    table_updates: list[int] | None = None
    # Decode steps the worker may run on this schedule (``num_scheduler_steps``,
    # ``core/sched/multi_step.py``): every scheduled row is a plain decode whose blocks
    # hold this many tokens; each step after the first feeds the last one's tokens.
    num_steps: int = 1

    @property
    def num_seqs(self) -> int:
        return sum(len(g.seqs) for g in self.scheduled)


@dataclass(frozen=True)
class ModelRunnerOutput:
    """The worker's answer: one sampled token per scheduled sequence of the groups
    without a mode, in the order the scheduler output lists them, and what each
    mode's rows produced (``StepMode.select``), by request id."""

    seq_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]  # the sampled token's log-probability
    top_logprobs: list[dict[int, float] | None]
    mode_outputs: dict[str, Any] = field(default_factory=dict)
    # Requests that failed in the worker (a user logits processor raised), with why.
    failed_requests: dict[str, str] = field(default_factory=dict)
    # Sequences for which every token was banned: they end with no token appended.
    no_token_seq_ids: frozenset[int] = frozenset()
    # kv_compress per head: blocks each table re-packed this step still needs (its
    # largest layer's kept K/V); the scheduler frees the rest.
    cross_blocks_needed: dict[str, int] = field(default_factory=dict)
    # A run of decode steps (``SchedulerOutput.num_steps``): the tokens of each step after
    # the first, one list per step in row order (as ``token_ids``); empty when one step ran.
    run_token_ids: list[list[int]] = field(default_factory=list)


def table_update(table: list[int], sent: list[int] | None) -> tuple[list[int], bool]:
    """What to send the worker of a block table it last got as ``sent``: the blocks
    appended since (``replace=False``) when ``sent`` is still its prefix, else the
    whole table (``replace=True``)."""
    if sent is not None and len(table) >= len(sent) and table[: len(sent)] == sent:
        return table[len(sent):], False
    return list(table), True
