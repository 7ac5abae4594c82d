"""Isolation of the schedule: a fault inside a request strategy's hook or inside
the block manager while scheduling fails only the request it concerns.

Each fault is injected (monkeypatched) to raise for one request: the first one
to reach the patched call. That request ends with ``error`` naming the fault;
every other request equals its output in a fault-free run (the oracle: the same
engine settings without the patch); all blocks are free at the end and the
engine serves a request afterwards, under ``LLM``, ``AsyncLLM`` and the server.
A fault that leaves the pool's accounting broken is not served on: the engine
is dead. Every wait is bounded.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from helpers import final_output
from tandem import LLM, AsyncLLM, EngineDeadError, SamplingParams
from tandem.core.kv.block_manager import BlockManager
from tandem.core.strategies.beam import BeamSearchStrategy
from tandem.core.strategies.sampling import SamplingStrategy
from tandem.entrypoints.openai.api_server import build_app

# Generous: a few steps of a tiny model take well under a second; the machine is shared.
WAIT = 120.0
PROMPTS = [{"prompt_token_ids": [0, 5 + i, 9 + 2 * i, 17, 2]} for i in range(4)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
# Preempting by swap: a small pool, two sequences per request (3 swap-outs in a clean run).
SWAPPING = dict(block_size=4, num_kv_blocks=20, preemption_mode="swap", max_num_seqs=4)
SWAP_PARAMS = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, n=2)
SMALL_BLOCKS = dict(block_size=4)
TWO_SEQS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, n=2)
BEAMS = SamplingParams(num_beams=2, max_tokens=6, temperature=0.0)


class Injected(Exception):
    pass


def _rid_of(bm: BlockManager, args) -> str:
    """The request a block manager call concerns (its first argument: a group or a
    sequence; a list of groups: its first)."""
    x = args[0]
    if isinstance(x, list):
        x = x[0]
    return x.request_id if hasattr(x, "request_id") else bm._owner[x.seq_id]


def inject(monkeypatch, cls, name: str, rid_of) -> dict:
    """Make ``cls.name`` raise for the first request that reaches it (and that
    request only); returns a record with its id under ``"rid"``."""
    original = getattr(cls, name)
    hit: dict = {}

    def faulty(self, *args, **kw):
        rid = rid_of(self, args)
        hit.setdefault("rid", rid)
        if rid == hit["rid"]:
            raise Injected(f"injected fault in {name}")
        return original(self, *args, **kw)

    monkeypatch.setattr(cls, name, faulty)
    return hit


def _group_rid(self, args) -> str:
    return args[0].request_id  # the strategy hooks' first argument is the group (update: ops, group)


def _hook_rid(name):
    return (lambda self, args: args[1].request_id) if name == "update" else _group_rid


# (class, method, how it finds the request, engine settings, params)
BLOCK_FAULTS = {
    # What admitting a request takes, found once: what can_allocate was asked before.
    "admission": (BlockManager, {}, GREEDY),
    "allocate": (BlockManager, {}, GREEDY),
    # A decode step whose token goes into a block it holds alone takes append_in_place_all
    # (the scheduler's steady pass over every running group, then, after a fault there,
    # append_in_place group by group, which asks it for one group). Two sequences of a
    # request share its prompt's block, so their first decode step copies it: that takes
    # the general path (a block to open no longer does, while the free blocks cover it).
    "append_in_place_all": (BlockManager, {}, GREEDY),
    "can_append_slots": (BlockManager, SMALL_BLOCKS, TWO_SEQS),
    "append_slots": (BlockManager, SMALL_BLOCKS, TWO_SEQS),
    "swap_out": (BlockManager, SWAPPING, SWAP_PARAMS),
    "can_swap_in": (BlockManager, SWAPPING, SWAP_PARAMS),
    "swap_in": (BlockManager, SWAPPING, SWAP_PARAMS),
    # Beams no longer fork: their moves are one take_over for the step's beam requests,
    # faulted in tests/entrypoints/test_fault_isolation.py.
}
STRATEGY_HOOKS = ["ready", "lookahead", "batch_items", "step_mode", "update"]
# update: plain sampling applies a one-sequence group's token inline (update_all), so
# the hook is reached by requests of two sequences (tests/core/test_steady_records.py
# faults the inline path).
HOOK_PARAMS = {"update": SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, n=2)}

_clean: dict = {}


def _llm(bart_dir, **kw) -> LLM:
    return LLM(model=str(bart_dir), dtype="float32", device="cpu", **kw)


def _oracle(bart_dir, settings: dict, params) -> list[list[list[int]]]:
    key = (tuple(sorted(settings.items())), repr(params))
    if key not in _clean:
        outs = _llm(bart_dir, **settings).generate(PROMPTS, params, use_tqdm=False)
        _clean[key] = [[c.token_ids for c in o.outputs] for o in outs]
    return _clean[key]


def _check(outs, hit, want, llm_stats, what):
    failed = [i for i, o in enumerate(outs) if o.error is not None]
    assert "rid" in hit, f"the fault in {what} was never reached"
    assert [outs[i].request_id for i in failed] == [hit["rid"]]
    assert f"injected fault in {what}" in outs[failed[0]].error
    for i, o in enumerate(outs):
        if i not in failed:
            assert [c.token_ids for c in o.outputs] == want[i], (what, i)
    assert llm_stats["kv_blocks_free"] == llm_stats["kv_blocks_total"]
    assert llm_stats["num_requests_unfinished"] == 0


@pytest.mark.parametrize("name", list(BLOCK_FAULTS))
def test_llm_a_block_manager_fault_while_scheduling_fails_only_its_request(bart_dir, monkeypatch, name):
    cls, settings, params = BLOCK_FAULTS[name]
    want = _oracle(bart_dir, settings, params)
    llm = _llm(bart_dir, **settings)
    hit = inject(monkeypatch, cls, name, lambda bm, args: _rid_of(bm, args))
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    monkeypatch.undo()
    _check(outs, hit, want, llm.get_stats(), name)
    assert llm.engine.health().status == "ok"  # a request's own fault is no failed step
    again = llm.generate(PROMPTS[:1], params, use_tqdm=False)
    assert [c.token_ids for c in again[0].outputs] == want[0]


@pytest.mark.parametrize("name", STRATEGY_HOOKS)
def test_llm_a_strategy_hook_fault_fails_only_its_request(bart_dir, monkeypatch, name):
    params = HOOK_PARAMS.get(name, GREEDY)
    want = _oracle(bart_dir, {}, params)
    llm = _llm(bart_dir)
    hit = inject(monkeypatch, SamplingStrategy, name, _hook_rid(name))
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    monkeypatch.undo()
    _check(outs, hit, want, llm.get_stats(), name)
    again = llm.generate(PROMPTS[:1], params, use_tqdm=False)
    assert [c.token_ids for c in again[0].outputs] == want[0]


def test_beam_strategy_hook_fault_fails_only_its_request(bart_dir, monkeypatch):
    want = _oracle(bart_dir, {}, BEAMS)
    llm = _llm(bart_dir)
    hit = inject(monkeypatch, BeamSearchStrategy, "step_mode", _group_rid)
    outs = llm.generate(PROMPTS, BEAMS, use_tqdm=False)
    monkeypatch.undo()
    _check(outs, hit, want, llm.get_stats(), "step_mode")


def test_a_fault_that_breaks_the_pool_accounting_makes_the_engine_dead(bart_dir, monkeypatch):
    """A broken invariant is never repaired silently: a block taken from the pool
    and listed nowhere before the fault is found once the failed request is freed."""
    llm = _llm(bart_dir)
    original = BlockManager.allocate

    def leaking(self, group, *admission):  # the scheduler hands allocate the group's admission
        if group.request_id == "leaky":
            self.pools[next(iter(self.pools))].allocate(1)  # taken, in no table
            raise Injected("injected fault in allocate")
        return original(self, group, *admission)

    monkeypatch.setattr(BlockManager, "allocate", leaking)
    engine = llm.engine
    engine.add_request("ok", PROMPTS[1], GREEDY)
    engine.add_request("leaky", PROMPTS[0], GREEDY)
    with pytest.raises(EngineDeadError, match="KV block accounting is broken.*reference counts differ"):
        while engine.has_unfinished_requests():
            engine.step()
    assert engine.health().status == "dead"


@pytest.mark.asyncio
@pytest.mark.parametrize("where", ["append_in_place_all", "step_mode"])  # append_in_place_all: every decode step
async def test_async_llm_a_schedule_fault_fails_only_its_request(bart_dir, monkeypatch, where):
    want = _oracle(bart_dir, {}, GREEDY)
    engine = AsyncLLM(model=str(bart_dir), dtype="float32", device="cpu")
    try:
        if where == "append_in_place_all":
            hit = inject(monkeypatch, BlockManager, where, lambda bm, args: _rid_of(bm, args))
        else:
            hit = inject(monkeypatch, SamplingStrategy, where, _group_rid)
        outs = await asyncio.wait_for(
            asyncio.gather(*(final_output(engine, p, GREEDY, f"r{i}") for i, p in enumerate(PROMPTS))), WAIT)
        monkeypatch.undo()
        _check(outs, hit, want, engine.get_stats(), where)
        assert engine.health().status == "ok"
        again = await asyncio.wait_for(final_output(engine, PROMPTS[1], GREEDY, "after"), WAIT)
        assert again.error is None and again.outputs[0].token_ids == want[1][0]
    finally:
        await asyncio.wait_for(engine.shutdown(), WAIT)


@pytest.mark.asyncio
async def test_server_a_block_manager_fault_fails_only_its_request(bart_dir, monkeypatch):
    engine = AsyncLLM(model=str(bart_dir), dtype="float32", device="cpu")
    app = build_app(engine, served_model_name="m")
    clean = _llm(bart_dir).get_tokenizer()
    want = _oracle(bart_dir, {}, GREEDY)
    # The server names requests itself: the fault finds its request by max_tokens=7.
    original = BlockManager.allocate

    def faulty(self, group, *admission):  # the scheduler hands allocate the group's admission
        if group.sampling_params.max_tokens == 7:
            raise Injected("injected fault in allocate")
        return original(self, group, *admission)

    monkeypatch.setattr(BlockManager, "allocate", faulty)
    body = lambda i, n=8: {"prompt": PROMPTS[i]["prompt_token_ids"], "max_tokens": n,  # noqa: E731
                           "temperature": 0, "ignore_eos": True}
    try:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=WAIT) as client:
            rs = await asyncio.gather(*(client.post("/v1/completions", json=body(i, 7 if i == 2 else 8))
                                        for i in range(len(PROMPTS))))
            assert rs[2].status_code == 500 and "injected fault in allocate" in rs[2].json()["error"]["message"]
            for i, r in enumerate(rs):
                if i != 2:
                    assert r.status_code == 200
                    assert r.json()["choices"][0]["text"] == clean.decode(want[i][0], skip_special_tokens=True)
            assert (await client.get("/health")).status_code == 200
            monkeypatch.undo()
            ok = await client.post("/v1/completions", json=body(2, 7))
            assert ok.status_code == 200
            s = engine.get_stats()
            assert s["kv_blocks_free"] == s["kv_blocks_total"]
    finally:
        await asyncio.wait_for(engine.shutdown(), WAIT)
