"""Runs of decode steps (``num_scheduler_steps``, ``tandem/core/sched/multi_step.py``):
one schedule, several forward passes, each feeding the last one's tokens.

Oracles: HF ``generate`` for greedy requests, and the same engine scheduling every
step (``num_scheduler_steps=1``, itself held to HF by the parity suites) for requests
HF's greedy helper does not cover (seeded draws, n-gram bans, penalties, stop token
ids, min_tokens). Every test also checks that runs happened (the worker's
``execute_next`` was called), so none passes by running one step per schedule.
"""

from __future__ import annotations

import pytest

from helpers import hf_greedy

from tandem import LLM, SamplingParams
from tandem.core.sampling_params import RequestOutputKind

PROMPTS = [{"prompt_token_ids": [0] + [(7 * i + 3 * j) % 90 + 4 for j in range(3 + i % 6)] + [2]} for i in range(12)]


def _llm(bart_dir, steps: int, **kw) -> LLM:
    return LLM(model=str(bart_dir), dtype="float32", device="cpu", seed=0, num_scheduler_steps=steps, **kw)


def _count_run_steps(llm: LLM, monkeypatch) -> list[int]:
    """Calls of the runner's ``execute_next`` (a run's steps after its first), counted."""
    runner = llm.llm_engine.core.executor.worker.runner
    calls = [0]
    inner = runner.execute_next

    def counted(*a, **k):
        calls[0] += 1
        return inner(*a, **k)

    monkeypatch.setattr(runner, "execute_next", counted)
    return calls


def _mixed_params(first_new: list[list[int]]) -> list[SamplingParams]:
    """One request each of the kinds a run serves; lengths differ, so runs shorten as the
    shortest remaining request nears its end. ``first_new``: each prompt's greedy tokens
    without EOS; the requests marked ``stop`` stop on a token that first appears after
    a few steps (so inside a run), with EOS on or not."""
    kinds = [
        dict(temperature=0.0, max_tokens=5),
        dict(temperature=0.0, max_tokens=23, stop=True),
        dict(temperature=0.0, max_tokens=30, min_tokens=9),
        dict(temperature=0.0, max_tokens=28, ignore_eos=True, stop=True),
        dict(temperature=0.0, max_tokens=26, ignore_eos=True),
        dict(temperature=1.0, top_k=20, seed=11, max_tokens=21),
        dict(temperature=0.8, top_p=0.9, seed=5, max_tokens=19, ignore_eos=True),
        dict(temperature=0.0, max_tokens=24, no_repeat_ngram_size=2, ignore_eos=True),
        dict(temperature=0.0, max_tokens=20, repetition_penalty=1.4, ignore_eos=True),
        dict(temperature=0.0, max_tokens=18, suppress_tokens=[5, 6, 7], bad_words_ids=[[9]]),
        dict(temperature=0.0, max_tokens=29, ignore_eos=True, min_tokens=29),
        dict(temperature=0.0, max_tokens=30, ignore_eos=True, stop=True),
    ]
    out = []
    for tokens, k in zip(first_new, kinds):
        if k.pop("stop", False):
            at = next(i for i in range(6, len(tokens)) if tokens[i] not in tokens[:i])
            k["stop_token_ids"] = [tokens[at]]
        out.append(SamplingParams(**k))
    return out


def _count_stops_inside_runs(monkeypatch) -> list[int]:
    """Rows that ended before their run's last step, the tokens after their stop dropped
    (white box: the scenario reaches that case)."""
    from tandem.core.strategies.sampling import SamplingStrategy

    inner, count = SamplingStrategy.update_all.__func__, [0]

    def counted(cls, ops, items, result, rows):
        before = [len(group.seqs[0].output_token_ids) for group, _ in items]
        out = inner(cls, ops, items, result, rows)
        if result.run_token_ids:
            for (group, _), n in zip(items, before):
                seq = group.seqs[0]
                count[0] += seq.finished and len(seq.output_token_ids) - n < 1 + len(result.run_token_ids)
        return out

    monkeypatch.setattr(SamplingStrategy, "update_all", classmethod(counted))
    return count


def _tokens(outs):
    return [(list(o.outputs[0].token_ids), o.outputs[0].finish_reason) for o in outs]


@pytest.mark.parametrize("steps", [pytest.param(2, marks=pytest.mark.slow), 5, pytest.param(16, marks=pytest.mark.slow)])
def test_runs_give_the_tokens_single_steps_give(bart_dir, monkeypatch, steps):
    single = _llm(bart_dir, 1)
    probe = single.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True), use_tqdm=False)
    params = _mixed_params([list(o.outputs[0].token_ids) for o in probe])
    expected = _tokens(single.generate(PROMPTS, params, use_tqdm=False))

    llm = _llm(bart_dir, steps)
    calls = _count_run_steps(llm, monkeypatch)
    got = _tokens(llm.generate(PROMPTS, params, use_tqdm=False))
    assert got == expected
    assert calls[0] > 0
    bm = llm.llm_engine.block_manager
    assert bm.num_free_blocks() == bm.num_total_blocks()


@pytest.mark.parametrize("steps", [2, pytest.param(5, marks=pytest.mark.slow), pytest.param(16, marks=pytest.mark.slow)])
def test_a_row_stopping_inside_a_run_ends_there(bart_dir, monkeypatch, steps):
    """Each request stops on a token that first appears near its own position (3-29), so
    stops fall at many places in a run; the tokens after a stop are dropped."""
    single = _llm(bart_dir, 1)
    probe = single.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True), use_tqdm=False)
    params = []
    for i, o in enumerate(probe):
        tokens = list(o.outputs[0].token_ids)
        firsts = [j for j in range(3, len(tokens)) if tokens[j] not in tokens[:j]]
        at = min(firsts, key=lambda j: abs(j - (6 + i)), default=None)  # None: a repetitive output, no stop
        params.append(SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True,
                                     stop_token_ids=[] if at is None else [tokens[at]]))
    expected = _tokens(single.generate(PROMPTS, params, use_tqdm=False))
    assert sum(reason == "stop" for _, reason in expected) >= 6

    llm = _llm(bart_dir, steps)
    calls, stops = _count_run_steps(llm, monkeypatch), _count_stops_inside_runs(monkeypatch)
    assert _tokens(llm.generate(PROMPTS, params, use_tqdm=False)) == expected
    assert calls[0] > 0 and stops[0] > 0
    bm = llm.llm_engine.block_manager
    assert bm.num_free_blocks() == bm.num_total_blocks()


def test_greedy_runs_equal_hf_generate(bart_dir, monkeypatch):
    lengths = [4, 9, 16, 21, 30, 7]
    llm = _llm(bart_dir, 8)
    calls = _count_run_steps(llm, monkeypatch)
    prompts = PROMPTS[: len(lengths)]
    outs = llm.generate(prompts, [SamplingParams(temperature=0.0, max_tokens=n) for n in lengths], use_tqdm=False)
    assert calls[0] > 0
    for n, out in zip(lengths, outs):
        assert list(out.outputs[0].token_ids) == hf_greedy(bart_dir, out.encoder_prompt_token_ids,
                                                           out.prompt_token_ids, n)


def test_streamed_runs_deliver_every_token_once(bart_dir, monkeypatch):
    """DELTA outputs of a run carry several tokens at once; joined, they are the final output."""
    params = SamplingParams(temperature=0.0, max_tokens=27, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    expected = _tokens(_llm(bart_dir, 1).generate(
        PROMPTS[:5], SamplingParams(temperature=0.0, max_tokens=27, ignore_eos=True), use_tqdm=False))
    llm = _llm(bart_dir, 6)
    calls = _count_run_steps(llm, monkeypatch)
    engine = llm.llm_engine
    for i, p in enumerate(PROMPTS[:5]):
        engine.add_request(str(i), p, params)
    joined: dict[str, list[int]] = {}
    sizes = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            delta = list(out.outputs[0].token_ids)
            sizes.append(len(delta))
            joined.setdefault(out.request_id, []).extend(delta)
    assert calls[0] > 0 and max(sizes) > 1
    assert [joined[str(i)] for i in range(5)] == [t for t, _ in expected]


def test_no_run_while_a_request_asks_for_logprobs(bart_dir, monkeypatch):
    llm = _llm(bart_dir, 8)
    calls = _count_run_steps(llm, monkeypatch)
    params = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)] + \
        [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)] * 3
    got = _tokens(llm.generate(PROMPTS[:4], params, use_tqdm=False))
    assert calls[0] == 0  # the logprobs request runs all along, and every step is scheduled
    assert got == _tokens(_llm(bart_dir, 1).generate(PROMPTS[:4], params, use_tqdm=False))


@pytest.mark.parametrize("mode", [pytest.param("recompute", marks=pytest.mark.slow), "swap"])
def test_runs_in_a_small_pool_preempt_and_free_every_block(bart_dir, monkeypatch, mode):
    """Blocks taken for runs come from the same pool preemption frees: a pool too small
    for the batch preempts, runs where it can, and ends with every block free."""
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    small = _llm(bart_dir, 4, block_size=4, num_kv_blocks=40, preemption_mode=mode)
    calls = _count_run_steps(small, monkeypatch)
    got = _tokens(small.generate(PROMPTS, params, use_tqdm=False))
    assert small.get_stats()["num_preemptions"] > 0 and calls[0] > 0
    bm = small.llm_engine.block_manager
    assert bm.num_free_blocks() == bm.num_total_blocks()
    assert got == _tokens(_llm(bart_dir, 1, block_size=4).generate(PROMPTS, params, use_tqdm=False))


@pytest.mark.parametrize("value", [0, 65, 2.5, "4", True])
def test_a_bad_num_scheduler_steps_raises_naming_it(bart_dir, value):
    with pytest.raises(ValueError, match=f"num_scheduler_steps={value!r}"):
        _llm(bart_dir, value)


def test_runs_are_for_one_rank():
    from tandem.core.config import EngineConfig

    with pytest.raises(ValueError, match="num_scheduler_steps=2.*tensor_parallel_size=2"):
        EngineConfig(model="m", num_scheduler_steps=2, tensor_parallel_size=2)


def test_runs_while_requests_wait_for_a_sequence_slot(bart_dir, monkeypatch):
    """More requests than ``max_num_seqs``: the waiting ones cannot be admitted before a
    running one finishes, so runs go on; each waiting request is admitted when a slot frees."""
    params = [SamplingParams(temperature=0.0, max_tokens=8 + 3 * i, ignore_eos=True) for i in range(len(PROMPTS))]
    llm = _llm(bart_dir, 4, max_num_seqs=3)
    calls = _count_run_steps(llm, monkeypatch)
    got = _tokens(llm.generate(PROMPTS, params, use_tqdm=False))
    assert calls[0] > 0
    assert got == _tokens(_llm(bart_dir, 1, max_num_seqs=3).generate(PROMPTS, params, use_tqdm=False))


def test_each_step_of_a_run_is_screened_on_its_own(monkeypatch):
    """The LM-head screen (greedy steps of few rows) serves one step: each step of a run
    offers its own, the tokens are the unscreened engine's, and the screen's counts are
    of the steps it really served (no step counted twice)."""
    from pathlib import Path

    import tandem
    from tandem.core.worker.greedy_screen import StepScreen

    demo = Path(tandem.__file__).parent / "demo_model"
    kw = dict(model=str(demo), dtype="float32", seed=0, max_num_seqs=4)
    on = LLM(lm_head_screen="auto", num_scheduler_steps=4, **kw)
    calls = _count_run_steps(on, monkeypatch)
    served, offer = [0], StepScreen.offer

    def counted(self, *a, **k):
        out = offer(self, *a, **k)
        served[0] += out is not None
        return out

    monkeypatch.setattr(StepScreen, "offer", counted)
    prompts = [{"prompt": s} for s in ("the cat sat on the mat", "my dog ate the red apple",
                                      "we walked to the park today", "a b c d e f g")]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    got = _tokens(on.generate(prompts, params, use_tqdm=False))
    stats = on.llm_engine.worker.screen_stats
    assert calls[0] > 0 and stats.steps == served[0] > calls[0]
    off = LLM(lm_head_screen="off", num_scheduler_steps=1, **kw)
    assert got == _tokens(off.generate(prompts, params, use_tqdm=False))
