"""Property-based tests for ``tandem.core.scheduler``.

No model: a fake engine loop in this file does what ``LLMEngine.step`` does
after a forward pass (mark the new tokens computed, append one token per
scheduled sequence, finish sequences at their target length, free them, hand
finished groups back) and checks the scheduler's output before and after
every step.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tandem.core.block_manager import BlockManager, Device, blocks_for
from tandem.core.sampling_params import SamplingParams
from tandem.core.scheduler import Scheduler, SchedulerConfig
from tandem.core.sequence import (
    Sequence,
    SequenceGroup,
    SequenceStatus,
)

_ids = itertools.count()

SETTINGS = dict(
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@dataclass
class Spec:
    enc_len: int
    prompt_len: int
    n: int
    max_tokens: int
    targets: list[int]  # output tokens each decoder sequence stops at (<= max_tokens)
    arrival: int  # step before which the request is added


def make_group(spec: Spec) -> SequenceGroup:
    rid = f"req-{next(_ids)}"
    enc = Sequence(next(_ids), list(range(spec.enc_len)))
    seqs = [Sequence(next(_ids), [3] * spec.prompt_len) for _ in range(spec.n)]
    params = SamplingParams(n=spec.n, max_tokens=spec.max_tokens, temperature=0.0)
    return SequenceGroup(rid, enc, seqs, params, float(spec.arrival))


def engine_accepts(spec: Spec, cfg: SchedulerConfig, bm: BlockManager) -> bool:
    """The checks ``LLMEngine._validate`` makes before a request reaches the scheduler."""
    bs = bm.block_size
    need = blocks_for(spec.enc_len, bs) + spec.n * blocks_for(spec.prompt_len + spec.max_tokens, bs)
    return (
        spec.n <= cfg.max_num_seqs
        and spec.enc_len + spec.n * spec.prompt_len <= cfg.max_num_batched_tokens
        and need <= bm.num_total_blocks() - bm.watermark_blocks
    )


def _blocks_of(bm: BlockManager, group: SequenceGroup) -> tuple[list[int], dict[int, list[int]]]:
    cross = list(bm.cross_tables.get(group.request_id, []))
    selfs = {s.seq_id: list(bm.self_tables[s.seq_id]) for s in group.seqs if s.seq_id in bm.self_tables}
    return cross, selfs


def _flat(tables: tuple[list[int], dict[int, list[int]]]) -> list[int]:
    cross, selfs = tables
    out = list(cross)
    for t in selfs.values():
        out += t
    return out


class Sim:
    """A scheduler, its block manager and a fake engine loop with checks."""

    def __init__(self, cfg: SchedulerConfig, block_size: int, gpu: int, cpu: int, watermark: float):
        self.cfg = cfg
        self.bm = BlockManager(block_size, gpu, cpu, watermark=watermark)
        self.sched = Scheduler(cfg, self.bm)
        self.gpu, self.cpu = gpu, cpu
        self.targets: dict[int, int] = {}
        self.groups: dict[str, SequenceGroup] = {}
        self.finished: list[SequenceGroup] = []
        self.aborted: list[SequenceGroup] = []
        self.steps = 0
        self.swapped_out_blocks = 0

    def add(self, spec: Spec) -> SequenceGroup:
        g = make_group(spec)
        for s, t in zip(g.seqs, spec.targets):
            self.targets[s.seq_id] = t
        self.groups[g.request_id] = g
        self.sched.add(g)
        return g

    # -- global checks ---------------------------------------------------------
    def check_state(self) -> None:
        bm, sched = self.bm, self.sched
        queues = {"waiting": sched.waiting, "running": sched.running, "swapped": sched.swapped}
        where: dict[str, str] = {}
        for name, q in queues.items():
            for g in q:
                assert g.request_id not in where, f"{g.request_id} in {where[g.request_id]} and {name}"
                where[g.request_id] = name
        live = {rid for rid, g in self.groups.items() if g not in self.finished and g not in self.aborted}
        assert set(where) == live
        held = {Device.GPU: [], Device.CPU: []}
        for g in sched.waiting:
            assert bm.group_blocks(g) == 0, f"waiting {g.request_id} holds blocks"
            assert g.request_id not in bm.location
            assert not g.is_finished
        for dev, q in ((Device.GPU, sched.running), (Device.CPU, sched.swapped)):
            for g in q:
                assert bm.location[g.request_id] is dev
                tables = _blocks_of(bm, g)
                assert len(tables[0]) == blocks_for(g.encoder_len, bm.block_size)
                assert set(tables[1]) == {s.seq_id for s in g.unfinished_seqs()}
                held[dev] += _flat(tables)
        for dev, q in ((Device.GPU, sched.running), (Device.CPU, sched.swapped)):
            total = self.gpu if dev is Device.GPU else self.cpu
            assert bm.num_free_blocks(dev) + sum(bm.group_blocks(g) for g in q) == total
        for dev, total in ((Device.GPU, self.gpu), (Device.CPU, self.cpu)):
            free = bm.pools[dev].free_ids()
            assert len(held[dev]) == len(set(held[dev])), f"{dev}: a block is held twice"
            assert not set(held[dev]) & set(free), f"{dev}: a block is held and free"
            assert sorted(held[dev] + free) == list(range(total)), f"{dev}: blocks leaked"
        assert set(bm.cross_tables) == {g.request_id for g in [*sched.running, *sched.swapped]}

    # -- one engine step -------------------------------------------------------
    def step(self):
        bm, sched, cfg = self.bm, self.sched, self.cfg
        before = {
            "running": {g.request_id: _blocks_of(bm, g) for g in sched.running},
            "swapped": {g.request_id: _blocks_of(bm, g) for g in sched.swapped},
            "waiting": [g.request_id for g in sched.waiting],
        }
        enc_done = {rid: g.encoder_computed for rid, g in self.groups.items()}
        preemptions_before = sched.num_preemptions

        out = sched.schedule()
        self.steps += 1

        # Budget and batch size.
        num_seqs = sum(len(m.seqs) for m in out.scheduled)
        assert num_seqs <= cfg.max_num_seqs
        assert out.num_batched_tokens <= cfg.max_num_batched_tokens
        tokens = sum(
            (m.group.encoder_len if m.run_encoder else 0) + sum(s.num_new_tokens for s in m.seqs)
            for m in out.scheduled
        )
        assert out.num_batched_tokens == tokens

        # Each scheduled group: once, all unfinished sequences, tables that cover it.
        seen_groups = set()
        step_blocks: list[int] = []
        gpu_free = set(bm.pools[Device.GPU].free_ids())
        for m in out.scheduled:
            g = m.group
            assert m.request_id == g.request_id and g.request_id not in seen_groups
            seen_groups.add(g.request_id)
            assert g in sched.running
            assert [s.seq_id for s in m.seqs] == [s.seq_id for s in g.unfinished_seqs()]
            assert m.run_encoder == (not enc_done[g.request_id])
            assert m.encoder_token_ids == g.encoder_seq.token_ids
            for s in m.seqs:
                assert s.status is SequenceStatus.RUNNING
                assert s.num_new_tokens >= 1
                if m.run_encoder:
                    assert s.num_computed_tokens == 0, "encoder reruns but decoder cache kept"
                table = m.block_tables[s.seq_id]
                assert table == bm.get_block_table(s)
                assert len(table) * bm.block_size >= len(s), (s, table)
                step_blocks += table
            assert m.cross_block_table == bm.get_cross_block_table(g)
            assert len(m.cross_block_table) == blocks_for(g.encoder_len, bm.block_size)
            step_blocks += m.cross_block_table
        assert len(step_blocks) == len(set(step_blocks)), "two scheduled tables share a block"
        assert all(0 <= b < self.gpu for b in step_blocks)
        assert not set(step_blocks) & gpu_free

        # Preemption: who left the running queue, and where their blocks went.
        now_running = {g.request_id for g in sched.running}
        now_swapped = {g.request_id: g for g in sched.swapped}
        now_waiting = {g.request_id for g in sched.waiting}
        swapped_out = [rid for rid in before["running"] if rid in now_swapped]
        recomputed = [rid for rid in before["running"] if rid in now_waiting]
        assert set(before["running"]) <= now_running | set(swapped_out) | set(recomputed)
        assert out.preempted == len(swapped_out) + len(recomputed)
        assert sched.num_preemptions == preemptions_before + out.preempted
        if cfg.preemption_mode == "recompute":
            assert not swapped_out and not out.blocks_to_swap_out
        for rid in recomputed:
            g = self.groups[rid]
            assert not g.encoder_computed
            assert all(s.num_computed_tokens == 0 for s in g.unfinished_seqs())

        old = [b for rid in swapped_out for b in _flat(before["running"][rid])]
        new = [b for rid in swapped_out for b in _flat(_blocks_of(bm, now_swapped[rid]))]
        assert len(out.blocks_to_swap_out) == len(old)
        assert sorted(src for src, _ in out.blocks_to_swap_out) == sorted(old)
        assert sorted(dst for _, dst in out.blocks_to_swap_out) == sorted(new)
        assert dict(out.blocks_to_swap_out) == dict(zip(old, new))
        self.swapped_out_blocks += len(old)

        swapped_in = [rid for rid in before["swapped"] if rid in now_running]
        assert set(before["swapped"]) <= set(now_swapped) | set(swapped_in)
        old = [b for rid in swapped_in for b in _flat(before["swapped"][rid])]
        assert len(out.blocks_to_swap_in) == len(old)
        assert sorted(src for src, _ in out.blocks_to_swap_in) == sorted(old)
        for rid in swapped_in:
            g = self.groups[rid]
            cross, selfs = before["swapped"][rid]
            new_cross, new_selfs = _blocks_of(bm, g)
            mapping = dict(out.blocks_to_swap_in)
            assert [mapping[b] for b in cross] == new_cross
            for sid, t in selfs.items():
                # append_slots may have grown the table after the move.
                assert [mapping[b] for b in t] == new_selfs[sid][: len(t)]

        # Queue order. Victims are the most recently admitted running groups.
        run_order = list(before["running"])
        victims = set(swapped_out) | set(recomputed)
        assert victims == set(run_order[len(run_order) - len(victims) :])
        kept = [rid for rid in run_order if rid not in victims]
        admitted = [m.request_id for m in out.scheduled if m.run_encoder]
        scheduled = [m.request_id for m in out.scheduled]
        # Running groups first (in order), then swapped-in ones, then admitted ones.
        assert scheduled == kept + swapped_in + admitted
        assert [g.request_id for g in sched.running] == scheduled
        # FIFO swapped queue: swap-ins from the front, evictions to the back.
        swapped_order = list(before["swapped"])
        assert swapped_in == swapped_order[: len(swapped_in)]
        evicted_to_swap = [rid for rid in reversed(run_order) if rid in swapped_out]
        assert [g.request_id for g in sched.swapped] == swapped_order[len(swapped_in) :] + evicted_to_swap
        # Recomputed groups go back to the front of the waiting queue, oldest
        # first; admissions come from the front.
        back_to_wait = [rid for rid in run_order if rid in recomputed]
        assert admitted == (back_to_wait + before["waiting"])[: len(admitted)]
        assert [g.request_id for g in sched.waiting] == (back_to_wait + before["waiting"])[len(admitted) :]
        # Nothing swapped in or admitted in a step that preempted; nothing
        # admitted while groups wait in the swapped queue.
        if out.preempted:
            assert not swapped_in and not admitted
        if sched.swapped:
            assert not admitted

        self.check_state()

        # The fake forward pass and output processing.
        for m in out.scheduled:
            g = m.group
            for s in m.seqs:
                s.num_computed_tokens = len(s)
                s.append_token(5, 0.0, None)
                assert len(s.output_token_ids) <= self.targets[s.seq_id]
                if len(s.output_token_ids) >= self.targets[s.seq_id]:
                    s.status = SequenceStatus.FINISHED_LENGTH
                    bm.free(s, g)
            g.encoder_computed = True
            if g.is_finished:
                sched.finish(g)
                self.finished.append(g)
        self.check_state()
        return out

    def run(self, specs: list[Spec], max_steps: int) -> None:
        pending = sorted(specs, key=lambda s: s.arrival)
        while pending or self.sched.has_unfinished():
            while pending and pending[0].arrival <= self.steps:
                self.add(pending.pop(0))
            assert self.steps < max_steps, (
                f"no progress: {self.steps} steps, waiting={list(self.sched.waiting)} "
                f"running={list(self.sched.running)} swapped={list(self.sched.swapped)} "
                f"free gpu={self.bm.num_free_blocks()} cpu={self.bm.num_free_blocks(Device.CPU)}"
            )
            self.step()

    def check_all_free(self) -> None:
        bm = self.bm
        assert not self.sched.has_unfinished()
        assert bm.num_free_blocks(Device.GPU) == self.gpu
        assert bm.num_free_blocks(Device.CPU) == self.cpu
        assert not bm.self_tables and not bm.cross_tables and not bm.location


def step_bound(specs: list[Spec]) -> int:
    # Each step with a non-empty running queue produces a token for its oldest
    # group, and a step with an empty one admits or swaps in a group.
    return max((s.arrival for s in specs), default=0) + 2 * sum(s.n * max(s.targets) for s in specs) + 20


# -- strategies ------------------------------------------------------------------


@st.composite
def scenarios(draw, tiny: bool = False, mode=None, max_groups: int = 8):
    """A scheduler config, pool sizes and requests the engine would accept.

    ``tiny``: the pool is just big enough for the largest request, several
    requests arrive together and their decoder sequences grow a lot, so
    preemption (and, with CPU space, swapping) is common.
    """
    block_size = draw(st.integers(1, 8))
    max_num_seqs = draw(st.integers(2 if tiny else 1, 8))
    max_batched = draw(st.integers(max(max_num_seqs, 16 if tiny else 2), 128))
    if mode is None:
        mode = draw(st.sampled_from([None, "recompute", "swap"]))
    cfg = SchedulerConfig(max_num_seqs, max_batched, mode)
    watermark = draw(st.sampled_from([0.0, 0.01, 0.1]))

    specs = []
    for _ in range(draw(st.integers(2 if tiny else 1, max_groups))):
        n = draw(st.integers(1, min(3, max_num_seqs, max_batched - 1)))
        prompt = draw(st.integers(1, min(10, (max_batched - 1) // n)))
        enc = draw(st.integers(1, min(12 if tiny else 40, max_batched - n * prompt)))
        # A group preempted by recompute re-prefills its encoder and every
        # unfinished decoder sequence in one step; keep that within the budget
        # (see test_recompute_that_outgrows_the_token_budget_stalls).
        top = min(24, (max_batched - enc) // n - prompt + 1)
        max_tokens = draw(st.integers((top + 1) // 2 if tiny else 1, top))
        # Mostly run to max_tokens (sequences that grow are what fill the pool).
        targets = [draw(st.one_of(st.just(max_tokens), st.integers(1, max_tokens))) for _ in range(n)]
        arrival = draw(st.one_of(st.just(0), st.integers(0, 6)))
        specs.append(Spec(enc, prompt, n, max_tokens, targets, arrival))

    # The smallest pool the engine would accept for the biggest request, plus slack.
    def usable(gpu: int) -> int:
        return gpu - int(watermark * gpu)

    need = max(
        blocks_for(s.enc_len, block_size) + s.n * blocks_for(s.prompt_len + s.max_tokens, block_size)
        for s in specs
    )
    gpu = max(4, need)
    while usable(gpu) < need:
        gpu += 1
    gpu += draw(st.integers(0, 2 if tiny else 40))
    cpu = draw(st.one_of(st.just(0), st.integers(0, 64)))
    return cfg, block_size, gpu, cpu, watermark, specs


def new_sim(cfg, block_size, gpu, cpu, watermark, specs) -> Sim:
    sim = Sim(cfg, block_size, gpu, cpu, watermark)
    for s in specs:
        assert engine_accepts(s, cfg, sim.bm), s
    return sim


# -- tests -------------------------------------------------------------------------


@settings(max_examples=500, **SETTINGS)
@given(scenarios())
def test_every_group_finishes_and_steps_are_valid(scenario):
    sim = new_sim(*scenario)
    specs = scenario[-1]
    sim.run(specs, step_bound(specs))
    sim.check_all_free()
    assert len(sim.finished) == len(specs)
    for g in sim.finished:
        for s in g.seqs:
            assert len(s.output_token_ids) == sim.targets[s.seq_id]
            assert s.status is SequenceStatus.FINISHED_LENGTH


@settings(max_examples=500, **SETTINGS)
@given(scenarios(tiny=True, max_groups=6))
def test_tiny_pools_preempt_and_still_finish(scenario):
    sim = new_sim(*scenario)
    specs = scenario[-1]
    sim.run(specs, step_bound(specs))
    sim.check_all_free()


@settings(max_examples=300, **SETTINGS)
@given(scenarios(tiny=True, mode="swap", max_groups=6))
def test_swap_mode_moves_the_swapped_groups_blocks(scenario):
    # Sim.step checks that blocks_to_swap_out/in are exactly the moved groups' blocks.
    sim = new_sim(*scenario)
    specs = scenario[-1]
    sim.run(specs, step_bound(specs))
    sim.check_all_free()


def _spec(enc, prompt, n, max_tokens, arrival=0):
    return Spec(enc, prompt, n, max_tokens, [max_tokens] * n, arrival)


@pytest.mark.parametrize("mode", ["recompute", "swap", None])
def test_small_pool_preempts(mode):
    # block_size 2, 8 GPU blocks: each request needs 1 cross + blocks_for(1 + 10, 2) = 7
    # at most alone, but two fit at first (1 + 1 each), so they must evict later.
    cfg = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, preemption_mode=mode)
    specs = [_spec(2, 1, 1, 10), _spec(2, 1, 1, 10), _spec(2, 1, 1, 10)]
    sim = new_sim(cfg, 2, 8, 16, 0.0, specs)
    sim.run(specs, step_bound(specs))
    sim.check_all_free()
    assert sim.sched.num_preemptions > 0
    if mode == "swap":
        assert sim.swapped_out_blocks > 0


def test_swap_out_pairs_reference_the_victims_blocks():
    cfg = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, preemption_mode="swap")
    # A needs up to 1 + 7 blocks and B (n=2) up to 1 + 2 x 5 of the 11: B is evicted.
    sim = Sim(cfg, 2, 11, 32, 0.0)
    a = sim.add(_spec(2, 1, 1, 12))
    b = sim.add(_spec(2, 1, 2, 8))
    seen_swap = False
    while sim.sched.has_unfinished():
        held = {g.request_id: set(_flat(_blocks_of(sim.bm, g))) for g in sim.sched.running}
        out = sim.step()
        if out.blocks_to_swap_out:
            seen_swap = True
            victims = [g for g in sim.sched.swapped if g.request_id in held]
            assert victims
            srcs = {src for src, _ in out.blocks_to_swap_out}
            assert srcs == set().union(*(held[g.request_id] for g in victims))
        assert sim.steps < 200
    assert seen_swap
    assert a.is_finished and b.is_finished
    sim.check_all_free()


# -- abort -------------------------------------------------------------------------


def test_abort_frees_groups_in_every_queue():
    cfg = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, preemption_mode="swap")
    sim = Sim(cfg, 2, 10, 32, 0.0)
    for spec in [_spec(2, 1, 1, 12), _spec(2, 1, 2, 8), _spec(3, 1, 1, 4), _spec(3, 2, 1, 4)]:
        sim.add(spec)
    while not (sim.sched.waiting and sim.sched.running and sim.sched.swapped):
        sim.step()
        assert sim.steps < 100, "never had a group in each queue"
    queues = [list(sim.sched.waiting), list(sim.sched.running), list(sim.sched.swapped)]
    for q in queues:
        g = q[0]
        gpu, cpu = sim.bm.num_free_blocks(Device.GPU), sim.bm.num_free_blocks(Device.CPU)
        dev = sim.bm.location.get(g.request_id)
        held = sim.bm.group_blocks(g)
        was_finished = {s.seq_id: s.status for s in g.seqs if s.finished}
        assert sim.sched.abort({g.request_id, "no-such-request"}) == [g]
        sim.aborted.append(g)
        for s in g.seqs:
            assert s.status is was_finished.get(s.seq_id, SequenceStatus.FINISHED_ABORTED)
        assert sim.bm.group_blocks(g) == 0 and g.request_id not in sim.bm.location
        gained_gpu = sim.bm.num_free_blocks(Device.GPU) - gpu
        gained_cpu = sim.bm.num_free_blocks(Device.CPU) - cpu
        assert (gained_gpu, gained_cpu) == {
            None: (0, 0), Device.GPU: (held, 0), Device.CPU: (0, held)
        }[dev]
        sim.check_state()
    rest = {g.request_id for q in (sim.sched.waiting, sim.sched.running, sim.sched.swapped) for g in q}
    aborted = sim.sched.abort(rest)
    assert {g.request_id for g in aborted} == rest
    sim.aborted += aborted
    sim.check_all_free()
    assert sim.sched.abort({"req-none"}) == []


@settings(max_examples=200, **SETTINGS)
@given(scenarios(tiny=True, max_groups=6), st.integers(0, 12), st.data())
def test_abort_midway_frees_everything(scenario, steps_before, data):
    sim = new_sim(*scenario)
    specs = scenario[-1]
    for spec in specs:
        sim.add(spec)
    for _ in range(steps_before):
        if not sim.sched.has_unfinished():
            break
        sim.step()
    live = sorted(g.request_id for q in (sim.sched.waiting, sim.sched.running, sim.sched.swapped) for g in q)
    chosen = set(data.draw(st.lists(st.sampled_from(live), unique=True), label="abort")) if live else set()
    gpu0, cpu0 = sim.bm.num_free_blocks(Device.GPU), sim.bm.num_free_blocks(Device.CPU)
    held = sum(sim.bm.group_blocks(sim.groups[r]) for r in chosen)
    aborted = sim.sched.abort(chosen)
    sim.aborted += aborted
    assert {g.request_id for g in aborted} == chosen
    gained = sim.bm.num_free_blocks(Device.GPU) - gpu0 + sim.bm.num_free_blocks(Device.CPU) - cpu0
    assert gained == held
    sim.check_state()
    # The rest still finishes and every block comes back.
    sim.run([], sim.steps + step_bound(specs))
    sim.check_all_free()


# -- config validation ----------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        (dict(max_num_seqs=0), "max_num_seqs=0"),
        (dict(max_num_seqs=-3), "max_num_seqs=-3"),
        (dict(max_num_seqs=2.5), "max_num_seqs=2.5"),
        (dict(max_num_batched_tokens=0), "max_num_batched_tokens=0"),
        (dict(max_num_batched_tokens=-1), "max_num_batched_tokens=-1"),
        (dict(max_num_seqs=16, max_num_batched_tokens=8), "max_num_batched_tokens=8"),
        (dict(preemption_mode="evict"), "preemption_mode='evict'"),
    ],
)
def test_scheduler_config_rejects_bad_values(kwargs, needle):
    with pytest.raises(ValueError) as err:
        SchedulerConfig(**kwargs)
    assert needle in str(err.value)


def test_scheduler_config_accepts_good_values():
    for mode in (None, "recompute", "swap"):
        cfg = SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=1, preemption_mode=mode)
        assert cfg.preemption_mode == mode


# -- regressions -----------------------------------------------------------------------


@pytest.mark.parametrize("mode", [None, "swap"])
def test_swapped_group_that_filled_the_pool_comes_back(mode):
    # B (n=3) holds 4 of the 6 blocks when A needs one more, so B is swapped
    # out. With "one spare block per sequence" B needed 4 + 3 > 6 blocks to
    # come back and sat in the swapped queue forever, which also blocks every
    # waiting request.
    cfg = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, preemption_mode=mode)
    specs = [_spec(1, 7, 1, 5), _spec(8, 1, 3, 7)]
    sim = new_sim(cfg, 8, 6, 16, 0.0, specs)
    sim.run(specs, step_bound(specs))
    sim.check_all_free()
    assert sim.swapped_out_blocks == 4


def test_recompute_within_the_engine_admission_bound_finishes():
    # The engine admits a request only if encoder + n * (prompt + max_tokens - 1)
    # fits max_num_batched_tokens, so a recompute always fits the budget again.
    cfg = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=21, preemption_mode="recompute")
    specs = [_spec(1, 1, 1, 20), _spec(1, 1, 1, 20)]
    sim = new_sim(cfg, 1, 22, 0, 0.0, specs)
    sim.run(specs, step_bound(specs))
    assert sim.sched.num_preemptions > 0
