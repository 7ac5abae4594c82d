"""Runs of decode steps (``num_scheduler_steps``): one schedule, several forward passes.

When every running request is a plain one-sequence decode, a step's host work is
mostly per row and the same every step: the scheduler's records, the worker's rows,
the output path's appends and stop checks. With ``num_scheduler_steps = n > 1`` the
scheduler lets the worker run up to ``n`` decode steps on one schedule: it takes the
KV blocks the run's tokens need before it starts, the worker feeds each step's
sampled tokens to the next forward pass (its processors see each row's lengths and
history as the step would), and the update appends a row's tokens in order and ends
it at its first stop (EOS, a stop token, the length), dropping the tokens after it.
Tokens are the ones single steps would give: each row's processors, argmax or draws
from its own stream, run on the same inputs.

A run starts only where nothing could change between its steps but its rows' own
tokens: every running group is a steady one-sequence record of a strategy that takes
runs (``RequestStrategy.multi_step``), nothing was preempted, swapped or admitted,
nothing waits unless every sequence slot (``max_num_seqs``) is taken (then nothing could
be admitted before a row finishes: a row that finishes inside a run leaves its slot idle
for the rest of it), and each request's params keep its steps independent of the others'
(:func:`params_allow_runs`). A run is as long as the shortest remaining length.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tandem.core.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tandem.core.kv.block_manager import BlockManager
    from tandem.core.scheduler_output import ScheduledGroup
    from tandem.core.sequence import SequenceGroup


def params_allow_runs(p: SamplingParams) -> bool:
    """Whether a request with these params may decode in runs: greedy or drawing from its
    own seeded stream (an unseeded draw takes the engine's stream, which a row stopped
    inside a run would go on drawing from), no logprobs (the run returns tokens only), no
    stop strings (the frontend finds those, after the tokens past them were computed) and
    no logits processor callables (user code that would see steps whose tokens are dropped)."""
    return ((p.greedy or p.seed is not None) and p.logprobs is None and not p.stop_strings
            and not p.logits_processors)


def plan_run(limit: int, scheduled: "list[ScheduledGroup]", groups: "dict[str, SequenceGroup]",
             bm: "BlockManager", sent_tables: dict[int, list[int]]) -> tuple[int, list[int]]:
    """The number of steps of this schedule's run (1: none) and the indices of the
    records given blocks for it. ``scheduled``: the step's records, every one a steady
    record of a running group. Takes the blocks the run's later tokens need (each
    record's ``block_ids`` and the worker's table as the scheduler knows it,
    ``sent_tables``, gain them); nothing is taken when the run cannot start."""
    n = limit
    allowed: dict[int, bool] = {}
    rows = []
    for sg in scheduled:
        if len(sg.seqs) != 1 or sg.mode is not None:
            return 1, []
        group = groups[sg.request_id]
        if not vars(type(group.strategy)).get("multi_step", False):
            return 1, []
        p = group.sampling_params
        ok = allowed.get(id(p))
        if ok is None:
            ok = allowed[id(p)] = params_allow_runs(p)
        if not ok:
            return 1, []
        seq = group.seqs[0]
        # Tokens it may still produce, this step's included.
        n = min(n, p.max_tokens - len(seq.output_token_ids))
        if n <= 1:
            return 1, []
        rows.append((sg.seqs[0], seq))
    new_blocks = bm.reserve_run([(seq, ss.num_computed_tokens) for ss, seq in rows], n)
    if new_blocks is None:
        return 1, []
    extended = []
    for i, ((ss, seq), blocks) in enumerate(zip(rows, new_blocks)):
        if blocks:
            ss.block_ids = ss.block_ids + blocks
            sent_tables[seq.seq_id].extend(blocks)
            extended.append(i)
    return n, extended
