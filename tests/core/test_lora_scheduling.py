"""At most ``max_loras`` distinct LoRA adapters in one step (``tandem.core.sched.lora_slots``).

No model: a fake worker samples one token per scheduled sequence (EOS at a
per-sequence target), as in tests/core/test_scheduler.py. The oracle is the
scheduler's own output read back: the adapters each step's ``ScheduledGroup``s
name, the order in which requests with an adapter first run (their arrival order:
first come, first served), and every request finishing (no starvation)."""

from __future__ import annotations

import itertools
import random

import pytest

from tandem.core.inputs import EncoderInputs
from tandem.core.kv.block_manager import BlockManager
from tandem.core.sampling_params import SamplingParams
from tandem.core.sched.scheduler import Scheduler, SchedulerConfig
from tandem.core.scheduler_output import ModelRunnerOutput
from tandem.core.sequence import Sequence, SequenceGroup
from tandem.core.strategies.sampling import SamplingStrategy
from tandem.lora.request import LoRARequest

_ids = itertools.count()
EOS = 7
ADAPTERS = {i: LoRARequest(f"a{i}", i, f"/adapters/a{i}") for i in range(1, 6)}


def make_group(lora_id: int, max_tokens: int = 4, n: int = 1, enc_len: int = 3) -> SequenceGroup:
    gid = next(_ids)
    seqs = [Sequence(next(_ids), [2, 0]) for _ in range(n)]
    group = SequenceGroup(f"req-{gid}", EncoderInputs.from_token_ids([gid % 50 + 10] * enc_len), seqs,
                          SamplingParams(n=n, max_tokens=max_tokens, temperature=0.0), 0.0,
                          lora_request=ADAPTERS.get(lora_id))
    group.strategy = SamplingStrategy()
    return group


def step(sched: Scheduler, targets: dict[int, int]):
    out = sched.schedule()
    seq_ids, tokens = [], []
    for sg in out.scheduled:
        for ss in sg.seqs:
            seq_ids.append(ss.seq_id)
            tokens.append(EOS if ss.num_output_tokens + 1 >= targets.get(ss.seq_id, 1 << 30) else 50)
    sched.update_from_output(out, ModelRunnerOutput(seq_ids, tokens, [0.0] * len(tokens), [None] * len(tokens)))
    return out


def test_one_step_holds_at_most_max_loras_and_base_requests_go_past_a_waiting_adapter():
    sched = Scheduler(SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=512, max_loras=2),
                      BlockManager(4, 256, 0, watermark=0.0), eos_token_ids=[EOS])
    groups = [make_group(i) for i in (1, 2, 3, 0, 1, 3, 0)]
    for g in groups:
        sched.add(g)
    out = sched.schedule()
    # a3 finds no slot; the base requests behind it run; a1 behind it waits its turn too.
    assert [sg.request_id for sg in out.scheduled] == [groups[i].request_id for i in (0, 1, 3, 6)]
    assert [sg.lora_request for sg in out.scheduled] == [ADAPTERS[1], ADAPTERS[2], None, None]
    assert [g.request_id for g in sched.waiting] == [groups[i].request_id for i in (2, 4, 5)]


def test_a_swapped_group_waits_for_a_slot():
    sched = Scheduler(SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=512, max_loras=1),
                      BlockManager(4, 256, 16, watermark=0.0), eos_token_ids=[EOS])
    a1, a2 = make_group(1, max_tokens=8, n=2), make_group(2, max_tokens=8)
    sched.add(a1)
    step(sched, {})
    swap_out = []
    sched.running.remove(a1)
    sched._preempt(a1, swap_out)  # as the scheduler does when short of blocks (two sequences: swap)
    assert swap_out and a1 in sched.swapped
    sched.running.append(a2)  # a2 running with another adapter: a1 must not come back beside it
    sched.groups[a2.request_id] = a2
    sched.block_manager.allocate(a2)
    out = sched.schedule()
    assert [sg.request_id for sg in out.scheduled] == [a2.request_id] and a1 in sched.swapped


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("max_loras", [1, 2, 3])
def test_random_traffic_respects_the_limit_serves_everyone_in_order(seed, max_loras):
    rng = random.Random(seed)
    sched = Scheduler(SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=64, max_loras=max_loras),
                      BlockManager(4, 48, 8, watermark=0.0), eos_token_ids=[EOS])
    pending = [make_group(rng.choice([0, 0, 1, 2, 3, 4, 5]), max_tokens=rng.randint(1, 8), n=rng.choice([1, 1, 2]))
               for _ in range(40)]
    targets = {s.seq_id: rng.randint(1, g.sampling_params.max_tokens) for g in pending for s in g.seqs}
    arrival = {g.request_id: i for i, g in enumerate(pending)}
    lora_of = {g.request_id: g.lora_id for g in pending}
    first_run: list[str] = []
    steps = 0
    while pending or sched.has_unfinished():
        for _ in range(rng.randint(0, 3)):
            if pending:
                sched.add(pending.pop(0))
        out = step(sched, targets)
        adapters = {sg.lora_request.lora_int_id for sg in out.scheduled if sg.lora_request is not None}
        assert len(adapters) <= max_loras
        for sg in out.scheduled:
            assert (sg.lora_request.lora_int_id if sg.lora_request else 0) == lora_of[sg.request_id]
            if sg.request_id not in first_run:
                first_run.append(sg.request_id)
        steps += 1
        assert steps < 2000, "a request starved"  # 40 requests of <= 8 tokens finish in far fewer steps
    assert len(first_run) == 40
    with_adapter = [r for r in first_run if lora_of[r]]
    assert with_adapter == sorted(with_adapter, key=arrival.get)
