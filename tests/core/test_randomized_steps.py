"""Randomized mixed batches driven through ``LLMEngine.step()``: after every step the
tokens each request streamed and the KV block accounting are checked against
independent oracles (issue 49, "outputs unchanged").

Each case draws, from a seeded RNG, an engine (a pool small enough to preempt by
recompute and swap, a swap space that may run out, the token budget, ``max_num_seqs``,
``max_loras``, runs of decode steps: ``num_scheduler_steps``) and a mix of requests arriving at different steps: greedy, seeded
sampling with ``n > 1``, beam search, structured output (regex or JSON schema),
each on the base weights or a LoRA adapter, some with a decoder prompt or an
encoder input another request shares, some aborted mid-generation. Speculation
(n-gram) and the preemption mode are engine-wide: they are enumerated over the
case seeds so the default cases cover both.

Oracles:

- tokens: each request run alone on an idle engine of the same settings with an
  ample pool (no preemption), its encoder and prefix caches emptied first. After
  every step of the mixed run, what each request streamed (DELTA chunks added up,
  CUMULATIVE outputs as they are) equals the solo run's tokens at the same
  positions; a finished request equals it whole, finish reason included (beam
  search: its n best hypotheses and their scores); an aborted one streamed a
  prefix of it.
- blocks: after every step and every abort, from the scheduler's queues and the
  block tables alone: every waiting group holds nothing, each running group's
  tables are on the device and each swapped group's self tables on the host; on
  each pool every block's reference count is the number of tables listing it (a
  shared cross table or prompt block counts once per holder) and free + kept
  (the encoder and prefix caches') + distinct held blocks = total. At the end
  every block is free.

Where batch composition may change results:

- Greedy near ties. A packed batch sums in other orders than a solo step (the
  GEMMs' blocking, a verified draft chunk against a one-token step, the int8
  LM-head screen's exact re-computation). The wide random weights make the logits
  ill-conditioned: float32 log-probabilities differ from a float64 judge's by up to
  6e-4, and between the mixed and the solo run by up to 2.4e-4 over 30 cases
  (typically 1e-5). So log-probabilities are compared to ``LOGPROB_TOL`` (2e-3),
  the solo run of a greedy request asks for top-2 logprobs (which change no plain
  greedy token; a structured request keeps its own, as logprobs turn jump-forward
  off), and a greedy sequence is compared up to the first position where its
  reference's top-1 and top-2 log-probabilities are within ``NEAR_TIE`` (1e-2: a
  choice flips only where the gap is within the drift, 40x the largest seen); from
  there on the two may part.
- Seeded sampling draws each sequence's tokens from its own generator
  (``tandem/core/worker/worker.py``: one per completion), one exponential vector
  per emitted token, with speculation too (a verified draft is accepted where it
  equals that draw: ``verify.py``): a request's draws depend neither on the other
  requests nor on the drafts the scheduler gave or dropped, so the solo run is the
  oracle and tokens are compared exactly. (A draw flips only where two tokens'
  ``p / q`` lie within the ~1e-5 logit drift: about 1e-5 per draw; a fixed seed
  makes the outcome the same on every run of one machine.)
- Beam search: tokens compared exactly, scores to ``BEAM_SCORE_TOL`` (a sum of up
  to 12 log-probabilities); a flip needs two candidates' cumulative scores within
  the drift (typically 1e-5), and a fixed seed would show one as a failure.
"""

from __future__ import annotations

import importlib.util
import json
import math
import random
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from helpers import make_bart_bytes
from lora_adapters import make_adapter
from structured_specs import REGEX, SCHEMA
from tandem import LLM, LoRARequest, SamplingParams
from tandem.core.kv.block_pool import Device, blocks_for
from tandem.core.sampling_params import RequestOutputKind

HAS_XGRAMMAR = importlib.util.find_spec("xgrammar") is not None
BLOCK_SIZE = 4
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
# Engine-wide axes, by case seed (seed % 6). The default seeds: speculation on (0, 1) and
# off (4, 5), preempting by swap (1, 4) and by recompute (5, and 0: the default policy,
# which recomputes a one-sequence victim and swaps one of several).
AXES = [(spec, mode) for spec in (True, False) for mode in (None, "swap", "recompute")]
DEFAULT_SEEDS = [0, 1, 4, 5]
SLOW_SEEDS = [s for s in range(24) if s not in DEFAULT_SEEDS]
NEAR_TIE = 1e-2  # see the module docstring
LOGPROB_TOL = 2e-3  # a logprob of the mixed run against the solo one (at most 2.4e-4 seen)
BEAM_SCORE_TOL = 1e-2
MAX_STEPS = 2000  # a bound that only turns a hang into a failure
BYTE_IDS = range(4, 260)  # the byte tokens of make_byte_tokenizer (0-3 are special)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("randomized_steps")
    base = make_bart_bytes(root / "base", seed=0)
    adapters = [
        LoRARequest("qv", 1, str(make_adapter(base, root / "qv", ["q_proj", "v_proj"], seed=1, r=4))),
        LoRARequest("ffn", 2, str(make_adapter(base, root / "ffn", ["fc1", "fc2", "out_proj"], seed=2, r=8,
                                               alpha=4))),
    ]
    return base, adapters


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread: this model's ops last microseconds, so a second thread adds
    only its wake-ups, and on a loaded 2-core machine they made a case 10x slower
    (seed 0: 42 s against 3 s). The mixed and solo runs share the setting."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@dataclass
class Req:
    rid: str
    kind: str  # greedy, sampled, beam, structured
    prompt: dict
    params: SamplingParams
    lora: LoRARequest | None
    arrive: int  # added before this step of the mixed run
    abort_after: int | None  # steps after its arrival; None: runs to its end


@dataclass
class Case:
    seed: int
    speculative: bool
    mode: str | None
    engine: dict
    reqs: list[Req]
    scheduler_steps: int = 1  # the mixed engine's num_scheduler_steps (the solo oracle schedules every step)


@dataclass
class Ref:
    """A request's solo run: per completion its tokens, finish reason, score, logprobs,
    and how many leading tokens are comparable (up to the first greedy near tie)."""

    tokens: list[list[int]]
    finish: list[str | None]
    cumulative: list[float | None]
    logprobs: list[list[dict[int, float]] | None]
    comparable: list[int]


def make_case(seed: int, adapters: list[LoRARequest]) -> Case:
    rng = random.Random(seed)
    speculative, mode = AXES[seed % len(AXES)]
    kinds = ["greedy", "sampled", "beam"] + (["structured"] if HAS_XGRAMMAR else [])
    # A few encoder inputs, shared by several requests (shared cross tables, prefix hits);
    # repeated words so n-gram lookups find drafts.
    inputs = []
    for _ in range(rng.randint(4, 6)):
        words = [rng.choice(BYTE_IDS) for _ in range(rng.randint(2, 5))]
        inputs.append([0] + words * rng.randint(1, 4) + [2])
    reqs, needs = [], []
    for i in range(rng.randint(10, 13)):
        # Each kind once, then greedy (the usual request) as likely as two others.
        kind = kinds[i] if i < len(kinds) else rng.choices(kinds, weights=[2, 1, 1, 1][:len(kinds)])[0]
        enc = {"prompt_token_ids": rng.choice(inputs)}
        prompt, dec_len = enc, 2  # BART's default decoder prompt: <DEC><BOS>
        if kind != "structured" and rng.random() < 0.3:  # a decoder prompt of a block or two
            dec = [rng.choice(BYTE_IDS) for _ in range(rng.randint(3, 8))]
            prompt, dec_len = {"encoder_prompt": enc, "decoder_prompt": {"prompt_token_ids": dec}}, len(dec) + 1
        common = dict(max_tokens=rng.randint(6, 24), ignore_eos=rng.random() < 0.3,
                      output_kind=rng.choice([RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE]),
                      # Stops end sequences at different steps (a group's sequences one by one).
                      stop_token_ids=rng.sample(BYTE_IDS, 12) if rng.random() < 0.4 else None)
        if kind == "greedy":
            params = SamplingParams(temperature=0.0, logprobs=rng.choice([None, None, 1, 2]),
                                    repetition_penalty=rng.choice([1.0, 1.0, 1.2]), **common)
        elif kind == "sampled":
            params = SamplingParams(temperature=rng.uniform(0.7, 1.3), top_k=rng.choice([-1, 20]),
                                    top_p=rng.choice([1.0, 0.9]), seed=rng.randrange(1 << 30), n=rng.randint(2, 3),
                                    logprobs=rng.choice([None, 1]), **common)
        elif kind == "beam":
            beams = rng.randint(2, 3)
            params = SamplingParams(temperature=0.0, num_beams=beams, n=rng.randint(1, beams),
                                    length_penalty=rng.choice([1.0, 0.6]), early_stopping=rng.choice([False, True]),
                                    **{**common, "max_tokens": rng.randint(4, 12)})
        else:
            from tandem import StructuredOutputsParams as SO

            so = rng.choice([SO(regex=REGEX), SO(json=SCHEMA, disable_any_whitespace=True)])
            sampling = dict(temperature=0.9, seed=rng.randrange(1 << 30), n=rng.randint(1, 2))
            params = SamplingParams(**(sampling if rng.random() < 0.5 else dict(temperature=0.0)),
                                    structured_outputs=so,
                                    logprobs=rng.choice([None, 2]),  # with logprobs: no jump-forward
                                    **{**common, "max_tokens": rng.randint(10, 30), "stop_token_ids": None})
        lora = rng.choice([None, *adapters])
        arrive = 0 if rng.random() < 0.5 else rng.randint(1, 12)
        abort_after = rng.randint(1, 8) if rng.random() < 0.2 else None
        reqs.append(Req(f"{kind}-{i}", kind, prompt, params, lora, arrive, abort_after))
        seqs = max(params.n, params.num_beams)
        needs.append(blocks_for(len(enc["prompt_token_ids"]), BLOCK_SIZE)
                     + seqs * blocks_for(dec_len + params.max_tokens, BLOCK_SIZE))
    # A pool of a tenth to a fifth of what all the requests would hold at full length (at
    # least what the largest needs alone): it runs short and preempts.
    blocks = max(max(needs) + rng.randint(0, 6), int(sum(needs) * rng.uniform(0.1, 0.2)))
    engine = dict(
        num_kv_blocks=blocks, max_num_seqs=rng.randint(6, 16),
        max_num_batched_tokens=rng.choice([96, 192, 2048]), max_loras=rng.randint(1, 2),
        # Host blocks for swapping: ample, or a handful (a full swap space preempts by recompute).
        swap_blocks=rng.choice([None, rng.randint(8, 24)]),
    )
    # Drawn last: the draws above, and so every case's requests and engine, are as before.
    return Case(seed, speculative, mode, engine, reqs, scheduler_steps=rng.choice([1, 4, 8]))


def build_engine(base: Path, case: Case, ample: bool):
    kwargs = dict(dtype="float32", device="cpu", block_size=BLOCK_SIZE, enable_lora=True, max_lora_rank=8,
                  max_cpu_loras=2, speculative_config=SPEC if case.speculative else None)
    if not ample:
        e = case.engine
        kwargs.update(num_kv_blocks=e["num_kv_blocks"], max_num_seqs=e["max_num_seqs"],
                      max_num_batched_tokens=e["max_num_batched_tokens"], max_loras=e["max_loras"],
                      preemption_mode=case.mode, num_scheduler_steps=case.scheduler_steps)
        if e["swap_blocks"] is not None:
            kwargs["swap_space"] = e["swap_blocks"] * block_bytes(base) / (1 << 30)
    else:  # ample: no request waits for another's blocks
        kwargs.update(num_kv_blocks=1024, max_loras=2)
    return LLM(str(base), **kwargs).llm_engine


def block_bytes(base: Path) -> int:
    cfg = json.loads((base / "config.json").read_text())
    head = cfg["d_model"] // cfg["decoder_attention_heads"]
    # K and V of every decoder layer, float32 (self and cross share one cache per layer).
    return 2 * cfg["decoder_layers"] * BLOCK_SIZE * cfg["decoder_attention_heads"] * head * 4


def warm_up(engine, adapters: list[LoRARequest], reqs: list[Req]) -> None:
    """Load every adapter and compile every grammar before the run, so the schedule
    does not depend on how fast a background thread is; then empty the caches."""
    for i, lora in enumerate(adapters):
        engine.add_request(f"warm-{i}", {"prompt_token_ids": [0, 7, 2]}, SamplingParams(temperature=0, max_tokens=1),
                           lora_request=lora)
    for r in reqs:
        if r.params.structured_outputs is not None:
            engine.compile_structured_outputs(r.params.structured_outputs).result(timeout=120)
    for _ in range(MAX_STEPS):
        if not engine.has_unfinished_requests():
            break
        engine.step()
    assert not engine.has_unfinished_requests()
    engine.block_manager.clear_encoder_cache()


# -- the block accounting oracle ------------------------------------------------------
def check_blocks(engine) -> None:
    """The identities, from the scheduler's queues and the tables they hold."""
    sched, bm = engine.scheduler, engine.block_manager
    queued = [*sched.waiting, *sched.running, *sched.swapped]
    assert sorted(g.request_id for g in queued) == sorted(sched.groups), "a live group in no queue, or twice"
    held = {Device.DEVICE: Counter(), Device.HOST: Counter()}
    for g in sched.waiting:
        assert bm.cross_device(g) is None and not any(bm.has_block_table(s) for s in g.seqs), g
    for where, groups in ((Device.DEVICE, sched.running), (Device.HOST, sched.swapped)):
        for g in groups:
            assert bm.device_of(g) is where, (g, bm.device_of(g))
            for s in g.seqs:
                if not bm.has_block_table(s):
                    assert s.finished, s  # a running or swapped sequence holds its table
                    continue
                table = bm.get_block_table(s)
                # Its computed tokens' slots, and no block past its tokens and drafts (rejected
                # drafts' blocks are rolled back).
                need = blocks_for(len(s) + len(s.lookahead_token_ids), BLOCK_SIZE)
                assert blocks_for(s.num_computed_tokens, BLOCK_SIZE) <= len(table) <= need, (s, table)
                held[where].update(table)
            cross = bm.cross_device(g)
            # A shared cross table stays on the device while another holder runs there.
            assert cross is Device.DEVICE or (cross is Device.HOST and where is Device.HOST), (g, cross)
            table = bm.get_cross_block_table(g)
            assert len(table) == blocks_for(bm.cross_positions(g), BLOCK_SIZE), (g, table)
            held[cross].update(table)
    for device, pool in bm.pools.items():
        counts = held[device]
        wrong = [(b, pool.refcount(b), c) for b, c in counts.items() if pool.refcount(b) != c]
        assert not wrong, f"{device.value}: (block, refcount, tables listing it): {wrong[:5]}"
        held_ids = int((pool.refcounts > 0).sum())
        assert held_ids == len(counts), f"{device.value}: {held_ids - len(counts)} blocks held that no table lists"
        kept = set(pool.kept_ids())
        assert not kept & counts.keys(), f"{device.value}: kept blocks a table holds: {kept & counts.keys()}"
        assert pool.num_free + pool.num_kept + len(counts) == pool.num_blocks, (
            device, pool.num_free, pool.num_kept, len(counts), pool.num_blocks)
        assert len(kept) == pool.num_kept and pool.num_free == pool.num_blocks - held_ids - len(kept), device.value
    assert bm.pools[Device.HOST].num_kept == 0
    assert bm.pools[Device.DEVICE].num_kept == bm.num_cached_blocks() + bm.num_prefix_cached_blocks()


def check_all_free(engine) -> None:
    bm = engine.block_manager
    assert not engine.scheduler.groups
    assert bm.num_free_blocks() == bm.num_total_blocks()
    assert bm.num_free_blocks(Device.HOST) == bm.num_total_blocks(Device.HOST)
    bm.clear_encoder_cache()
    assert bm.pools[Device.DEVICE].num_free == bm.num_total_blocks()


# -- the token oracle -----------------------------------------------------------------
def solo(engine, r: Req) -> Ref:
    """``r`` alone on the idle ``engine``, stepped to its end (blocks checked each step).
    Greedy requests ask for top-2 logprobs, for the near-tie cut."""
    engine.block_manager.clear_encoder_cache()  # as a fresh engine: no kept cross tables or prompt blocks
    params = r.params.replace(output_kind=RequestOutputKind.FINAL_ONLY)
    if r.kind == "greedy":
        params = params.replace(logprobs=max(2, params.logprobs or 0))
    engine.add_request(r.rid, r.prompt, params, lora_request=r.lora)
    final = None
    for _ in range(MAX_STEPS):
        for out in engine.step():
            final = out
        check_blocks(engine)
        if not engine.has_unfinished_requests():
            break
    assert final is not None and final.finished and final.error is None, final
    check_all_free(engine)
    comparable = []
    for c in final.outputs:
        cut = len(c.token_ids)
        if params.greedy and not params.use_beam_search and (params.logprobs or 0) >= 2:
            for pos, top in enumerate(c.logprobs):
                best = sorted((v for v in top.values() if v > -math.inf), reverse=True)
                if len(best) > 1 and best[0] - best[1] < NEAR_TIE:
                    cut = pos
                    break
        comparable.append(cut)
    return Ref([list(c.token_ids) for c in final.outputs], [c.finish_reason for c in final.outputs],
               [c.cumulative_logprob for c in final.outputs], [c.logprobs for c in final.outputs], comparable)


@dataclass
class Stream:
    tokens: dict[int, list[int]] = field(default_factory=dict)
    logprobs: dict[int, list[dict[int, float]]] = field(default_factory=dict)
    finish: dict[int, str | None] = field(default_factory=dict)
    cumulative: dict[int, float | None] = field(default_factory=dict)
    finished: bool = False
    aborted: bool = False


def take(stream: Stream, r: Req, out) -> None:
    """Add a step's output of ``r`` to what it streamed."""
    assert out.error is None, (r.rid, out.error)
    assert not stream.finished, f"{r.rid}: an output after its last"
    if r.kind == "beam" or r.params.output_kind is RequestOutputKind.FINAL_ONLY:
        assert out.finished, f"{r.rid}: beam search streams nothing before it ends"
    delta = r.params.output_kind is RequestOutputKind.DELTA
    for c in out.outputs:
        if delta:
            stream.tokens.setdefault(c.index, []).extend(c.token_ids)
            if c.logprobs is not None:
                stream.logprobs.setdefault(c.index, []).extend(c.logprobs)
        else:
            stream.tokens[c.index] = list(c.token_ids)
            if c.logprobs is not None:
                stream.logprobs[c.index] = list(c.logprobs)
        stream.finish[c.index], stream.cumulative[c.index] = c.finish_reason, c.cumulative_logprob
    stream.finished = out.finished


def check_stream(stream: Stream, r: Req, ref: Ref) -> None:
    """What ``r`` streamed so far against its solo run, at the same positions."""
    where = f"{r.rid} ({r.kind}, lora {r.lora and r.lora.lora_name}, {r.params})"
    if r.kind == "beam" and stream.aborted:
        # Its best n so far: not prefixes of the best finished hypotheses.
        assert len(stream.tokens) <= r.params.n, where
        return
    if not stream.tokens:
        return
    assert max(stream.tokens) < len(ref.tokens), where
    for i, got in stream.tokens.items():
        want, cut = ref.tokens[i], ref.comparable[i]
        n = min(len(got), cut)
        assert got[:n] == want[:n], f"{where}: completion {i}\n mixed {got}\n alone {want}"
        if cut == len(want):
            assert len(got) <= len(want), f"{where}: completion {i}\n mixed {got}\n alone {want}"
        for pos, (a, b) in enumerate(zip(stream.logprobs.get(i, ()), ref.logprobs[i] or ())):
            if pos >= cut:
                break
            common = a.keys() & b.keys()  # top-k sets may differ by a near tie below the chosen token
            assert common and all(a[t] == b[t] or abs(a[t] - b[t]) <= LOGPROB_TOL for t in common), (where, pos, a, b)
    if not stream.finished or stream.aborted:
        return
    assert sorted(stream.tokens) == list(range(len(ref.tokens))), where
    for i, want in enumerate(ref.tokens):
        got, cut = stream.tokens[i], ref.comparable[i]
        if cut == len(want):
            assert got == want and stream.finish[i] == ref.finish[i], (
                f"{where}: completion {i}\n mixed {got} {stream.finish[i]}\n alone {want} {ref.finish[i]}")
        if r.kind == "beam":
            assert abs(stream.cumulative[i] - ref.cumulative[i]) <= BEAM_SCORE_TOL, where


# -- the mixed run ----------------------------------------------------------------------
def run_mixed(engine, case: Case, refs: dict[str, Ref]) -> dict[str, Stream]:
    streams = {r.rid: Stream() for r in case.reqs}
    by_id = {r.rid: r for r in case.reqs}
    aborts = {}  # step -> request ids
    for r in case.reqs:
        if r.abort_after is not None:
            aborts.setdefault(r.arrive + r.abort_after, []).append(r.rid)
    last_arrival = max(r.arrive for r in case.reqs)
    for step in range(MAX_STEPS):
        for r in case.reqs:
            if r.arrive == step:
                engine.add_request(r.rid, r.prompt, r.params, lora_request=r.lora)
        if step > last_arrival and not engine.has_unfinished_requests():
            break
        for out in engine.step():
            r = by_id[out.request_id]
            take(streams[r.rid], r, out)
            check_stream(streams[r.rid], r, refs[r.rid])
        check_blocks(engine)
        for rid in aborts.get(step, ()):
            if streams[rid].finished:
                continue
            for out in engine.abort_request(rid):
                take(streams[rid], by_id[rid], out)
            streams[rid].aborted = True
            assert streams[rid].finished
            check_stream(streams[rid], by_id[rid], refs[rid])
            check_blocks(engine)
    else:
        pytest.fail(f"case {case.seed}: not done after {MAX_STEPS} steps")
    for rid, s in streams.items():
        assert s.finished, f"{rid}: never finished"
    check_all_free(engine)
    return streams


def run_case(seed: int, checkpoint) -> tuple[Case, dict]:
    """The case's solo runs, then its mixed run, each checked step by step; returns the
    case and the mixed engine's counters."""
    base, adapters = checkpoint
    case = make_case(seed, adapters)
    oracle = build_engine(base, case, ample=True)
    try:
        warm_up(oracle, adapters, case.reqs)
        refs = {r.rid: solo(oracle, r) for r in case.reqs}
        assert oracle.get_stats()["num_preemptions"] == 0
    finally:
        oracle.shutdown()
    engine = build_engine(base, case, ample=False)
    try:
        warm_up(engine, adapters, case.reqs)
        run_mixed(engine, case, refs)
        stats = engine.get_stats()
    finally:
        engine.shutdown()
    if not any(r.abort_after for r in case.reqs):  # an abort frees a swapped request's host blocks
        assert stats["swapped_in_blocks"] == stats["swapped_out_blocks"], stats
    return case, stats


@pytest.mark.parametrize("seed", DEFAULT_SEEDS)
def test_mixed_steps_equal_solo_runs_and_blocks_add_up(checkpoint, seed):
    case, stats = run_case(seed, checkpoint)
    # What these cases are for: the pool ran short and preempted, by swap where the mode
    # swaps, and drafts were accepted where the engine speculates.
    assert stats["num_preemptions"] > 0, (case.engine, stats)
    if case.mode == "recompute":
        assert stats["swapped_out_blocks"] == 0, stats
    elif case.mode == "swap" and case.engine["swap_blocks"] is None:
        assert stats["swapped_out_blocks"] > 0, (case.engine, stats)
    if case.speculative:
        assert stats["spec_accepted_tokens"] > 0, stats


@pytest.mark.slow
@pytest.mark.parametrize("seed", SLOW_SEEDS)
def test_mixed_steps_equal_solo_runs_and_blocks_add_up_more_seeds(checkpoint, seed):
    run_case(seed, checkpoint)  # a case may happen not to preempt: it is checked all the same
