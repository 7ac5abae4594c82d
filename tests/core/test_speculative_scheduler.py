"""The scheduler with speculation, against the same scheduler without it: a fake
worker keeps its block tables from the updates it is sent (checked equal to the
block manager's every step), applies swaps and copy-on-write pairs to a fake KV
cache and writes every computed token (drafts too) where the tables say, and
answers with a deterministic "model" (its next token is a function of the
decoder tokens so far, periodic enough for lookups to hit). Under random pools
(preempting by recompute and by swap), ``k``, ``n`` and lengths, every output
equals the run without speculation, every sequence reads its computed tokens
back through its table after every step, and every block is free at the end.
"""

from __future__ import annotations

import itertools

from hypothesis import assume, given, settings
from hypothesis import strategies as st

from tandem.core.kv.block_manager import BlockManager

from tandem.core.kv.block_pool import Device, blocks_for
from tandem.core.config import SchedulerConfig
from tandem.core.inputs import EncoderInputs
from tandem.core.sampling_params import SamplingParams
from tandem.core.sched.scheduler import Scheduler
from tandem.core.scheduler_output import ModelRunnerOutput
from tandem.core.sequence import Sequence, SequenceGroup
from tandem.core.speculative_config import SpeculativeConfig
from tandem.core.strategies.speculative.verify import Verified
from tandem.core.strategies.sampling import SamplingStrategy
from tandem.core.strategies.speculative import SpeculationCounters, SpeculativeStrategy, VerifyStep

EOS = 4
DEV, HOST = Device.DEVICE, Device.HOST


def model(tokens: list[int]) -> int:
    """The next token after ``tokens``: mostly the token three back (a loop that
    lookups find), now and then something new; EOS (4) at times."""
    n = len(tokens)
    if n >= 3 and n % 7:
        return tokens[-3]
    return (tokens[-1] * 5 + n) % 21 + 4


class FakeWorker:
    def __init__(self, bm: BlockManager, block_size: int):
        self.bm, self.bs = bm, block_size
        self.tables: dict[int, list[int]] = {}
        self.tokens: dict[int, list[int]] = {}  # what the worker has seen of each sequence
        self.cache = {DEV: {}, HOST: {}}

    def _apply(self, pairs, src, dst):
        for s, d in pairs:
            self.cache[dst][d] = dict(self.cache[src].get(s, {}))

    def execute(self, out, groups) -> ModelRunnerOutput:
        self._apply(out.blocks_to_swap_out, DEV, HOST)
        self._apply(out.blocks_to_swap_in, HOST, DEV)
        self._apply(out.blocks_to_copy, DEV, DEV)
        for sid in out.finished_seq_ids:
            self.tables.pop(sid, None)
        seq_ids, token_ids, modes = [], [], {}
        for sg in out.scheduled:
            by_id = {s.seq_id: s for s in groups[sg.request_id].seqs}
            verified = []
            for i, ss in enumerate(sg.seqs):
                if ss.replace_blocks or ss.seq_id not in self.tables:
                    assert ss.replace_blocks
                    self.tables[ss.seq_id] = list(ss.block_ids)
                else:
                    self.tables[ss.seq_id] += ss.block_ids
                assert self.tables[ss.seq_id] == self.bm.get_block_table(by_id[ss.seq_id])
                seen = by_id[ss.seq_id].token_ids[: ss.num_computed_tokens] + ss.token_ids
                table = self.tables[ss.seq_id]
                for pos in range(ss.num_computed_tokens, len(seen)):
                    self.cache[DEV].setdefault(table[pos // self.bs], {})[pos % self.bs] = seen[pos]
                k = ss.num_logits - 1
                targets = [model(seen[: len(seen) - k + j]) for j in range(k + 1)]
                if isinstance(sg.mode, VerifyStep):
                    drafts = list(sg.mode.drafts[i])
                    assert drafts == ss.token_ids[len(ss.token_ids) - k:]
                    a = 0
                    while a < k and drafts[a] == targets[a]:
                        a += 1
                    verified.append(Verified(targets[: a + 1], a, [None] * (a + 1), None))
                else:
                    assert k == 0
                    seq_ids.append(ss.seq_id)
                    token_ids.append(targets[0])
            if verified:
                modes[sg.request_id] = verified
        return ModelRunnerOutput(seq_ids, token_ids, [None] * len(seq_ids), [None] * len(seq_ids), modes)

    def check_reads(self, seqs) -> None:
        for seq in seqs:
            table = self.bm.get_block_table(seq)
            got = [self.cache[DEV].get(table[p // self.bs], {}).get(p % self.bs) for p in range(seq.num_computed_tokens)]
            assert got == seq.token_ids[: seq.num_computed_tokens]


def run(specs, spec_config, block_size, num_blocks, mode):
    bm = BlockManager(block_size, num_blocks, 400, watermark=0.0)
    sched = Scheduler(SchedulerConfig(8, 64, mode), bm, eos_token_ids=[EOS])
    sched.counters = counters = SpeculationCounters()  # the speculative mode's, in an engine
    worker = FakeWorker(bm, block_size)
    groups = {}
    ids = itertools.count()
    for r, (enc, prompt, n, max_tokens) in enumerate(specs):
        seqs = [Sequence(next(ids), prompt, i) for i in range(n)]
        g = SequenceGroup(f"r{r}", EncoderInputs.from_token_ids(enc), seqs,
                          SamplingParams(n=n, max_tokens=max_tokens, temperature=0), 0.0)
        g.strategy = SamplingStrategy()  # what the engine's modes give a plain request
        if spec_config is not None:
            g.strategy = SpeculativeStrategy(spec_config, enc, counters)
        groups[g.request_id] = g
        sched.add(g)
    for _ in range(2000):
        if not sched.has_unfinished():
            break
        out = sched.schedule()
        result = worker.execute(out, groups)
        sched.update_from_output(out, result)
        assert not result.failed_requests
        running = [s for g in sched.running for s in g.seqs if bm.has_block_table(s)]
        worker.check_reads([s for s in running if bm.device_of(groups[_rid(groups, s)]) is DEV])
    assert not sched.has_unfinished()
    assert bm.num_free_blocks(DEV) == bm.num_total_blocks(DEV)
    assert bm.num_free_blocks(HOST) == bm.num_total_blocks(HOST)
    return {rid: [s.output_token_ids for s in g.seqs] for rid, g in groups.items()}, sched


def _rid(groups, seq):
    return next(rid for rid, g in groups.items() if seq in g.seqs)


@settings(max_examples=80, deadline=None)
@given(
    specs=st.lists(st.tuples(
        st.lists(st.integers(5, 12), min_size=1, max_size=12),  # encoder ids
        st.lists(st.integers(5, 12), min_size=1, max_size=5),  # decoder prompt
        st.integers(1, 2), st.integers(1, 30)), min_size=1, max_size=5),
    k=st.integers(1, 5),
    block_size=st.sampled_from([1, 2, 4]),
    num_blocks=st.integers(40, 120),
    mode=st.sampled_from(["recompute", "swap", None]),
)
def test_outputs_equal_plain_and_tables_stay_in_step(specs, k, block_size, num_blocks, mode):
    # What the engine admits: each request at full length fits the pool alone.
    assume(all(blocks_for(len(e), block_size) + n * blocks_for(len(p) + m, block_size) <= num_blocks
               for e, p, n, m in specs))
    config = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 3})
    plain, _ = run(specs, None, block_size, 400, None)
    spec, sched = run(specs, config, block_size, num_blocks, mode)
    assert spec == plain
    c = sched.counters
    assert 0 <= c.accepted <= c.proposed and c.verify_steps <= c.proposed


def test_a_small_pool_preempts_speculating_groups_and_outputs_stay_plain():
    specs = [([5, 6, 7, 8, 5, 6, 7, 8], [5, 6], 2, 30), ([9, 10, 11], [7], 1, 25), ([5] * 6, [5, 9, 9], 2, 30)]
    config = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3})
    plain, _ = run(specs, None, 2, 400, None)
    for mode in ("recompute", "swap"):
        spec, sched = run(specs, config, 2, 40, mode)
        assert spec == plain
        assert sched.num_preemptions > 0 and 0 < sched.counters.accepted < sched.counters.proposed
