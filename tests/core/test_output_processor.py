"""The frontend's output state, fed plain core results by hand (no model).

Oracle: the tokenizer's own ``decode`` of the whole token list; DELTA chunks must
add up to exactly the final text, which equals that decode."""

from __future__ import annotations

import random

import pytest

from helpers import make_tokenizer
from tandem.core.core_outputs import CompletionDelta, OutputShape, RequestInfo, RequestResult
from tandem.core.output_processor import OutputProcessor, RequestState
from tandem.core.sampling_params import RequestOutputKind, SamplingParams


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer(96)


def _info(rid="r", shape=None, **params) -> RequestInfo:
    return RequestInfo(rid, SamplingParams(**params), "the rain", [0, 4, 5, 2], None, [2, 0], shape=shape)


def _feed(state: RequestState, ids_per_step: list[list[int]], index: int = 0, finish_last: str = "length"):
    outs, hits = [], {}
    for k, ids in enumerate(ids_per_step):
        last = k == len(ids_per_step) - 1
        d = CompletionDelta(index, ids, None, None, finish_last if last else None)
        hits.update(state.update(RequestResult("r", [d], last)))
        out = state.step_output()
        if out is not None:
            outs.append(out)
        if state.finished:
            break
    return outs, hits


@pytest.mark.parametrize("seed", range(5))
def test_delta_chunks_add_up_to_the_final_text_which_is_the_tokenizers_decode(tok, seed):
    rng = random.Random(seed)
    ids = [rng.randrange(4, 96) for _ in range(rng.randrange(1, 30))]
    steps, i = [], 0
    while i < len(ids):  # several tokens a step, as speculation will report them
        k = rng.randrange(1, 4)
        steps.append(ids[i:i + k])
        i += k
    delta = RequestState(_info(output_kind=RequestOutputKind.DELTA), tok)
    outs, _ = _feed(delta, steps)
    final = RequestState(_info(output_kind=RequestOutputKind.FINAL_ONLY), tok)
    (last,), _ = _feed(final, steps)
    expected = tok.decode(ids, skip_special_tokens=True)
    assert "".join(o.outputs[0].text for o in outs) == expected
    assert [t for o in outs for t in o.outputs[0].token_ids] == ids
    assert last.outputs[0].text == expected and last.outputs[0].token_ids == ids
    assert last.finished and last.outputs[0].finish_reason == "length"


def test_a_stop_string_cuts_the_text_and_is_reported_to_the_core_once(tok):
    words = "the rain in spain falls mainly on the plain".split()
    ids = tok.convert_tokens_to_ids(words)
    state = RequestState(_info(stop=["spain falls"], output_kind=RequestOutputKind.DELTA, n=2), tok)
    sent, hits_seen = "", []
    for k, t in enumerate(ids):
        hits = state.update(RequestResult("r", [CompletionDelta(0, [t], None, None),
                                                CompletionDelta(1, [t], None, None)]))
        hits_seen.append(hits)
        out = state.step_output()
        sent += out.outputs[0].text
        if out.outputs[0].finish_reason is not None:
            break
    assert hits_seen[-1] == {0: "spain falls", 1: "spain falls"}
    assert all(not h for h in hits_seen[:-1])
    assert sent == "the rain in "  # cut before the match; the held-back prefix never leaked
    assert out.outputs[0].stop_reason == "spain falls" and out.finished
    # The core may report a token more before it learns of the stop: it is ignored.
    assert state.update(RequestResult("r", [CompletionDelta(0, [ids[-1]], None, None)])) == {}
    assert state.completions[0].token_ids == ids[: k + 1]


def test_beam_results_show_nothing_until_the_end_then_replace(tok):
    # The shape beam search declares (BeamSearchMode.output_shape; the engine's
    # test_beam_requests_declare_final_whole_outputs checks it).
    shape = OutputShape(0, streams=False, stop_strings=False)
    state = RequestState(_info(shape=shape, num_beams=2, temperature=0.0, n=2,
                               output_kind=RequestOutputKind.CUMULATIVE), tok)
    assert state.update(RequestResult("r")) == {} and state.step_output() is None
    final = RequestResult("r", [CompletionDelta(0, [10, 11], None, -1.5, "stop", replace=True),
                                CompletionDelta(1, [12], None, -2.5, "length", replace=True)], True)
    state.update(final)
    out = state.step_output()
    assert out.finished
    assert [(c.token_ids, c.text, c.cumulative_logprob, c.finish_reason) for c in out.outputs] == [
        ([10, 11], tok.decode([10, 11]), -1.5, "stop"), ([12], tok.decode([12]), -2.5, "length")]


def test_the_processor_drops_results_of_requests_it_no_longer_follows(tok):
    op = OutputProcessor(tok)
    op.add_request(_info("a"))
    op.add_request(_info("b"))
    aborted = op.abort("a", error="why")
    assert aborted.finished and aborted.error == "why"
    done = op.process([RequestResult("a", [CompletionDelta(0, [5], None, None, "length")], True),
                       RequestResult("b", [CompletionDelta(0, [6], None, None, "length")], True)])
    assert [o.request_id for o in done.outputs] == ["b"] and done.stops == {} and done.failed == {}
    assert op.requests == {}


def test_outputs_go_to_their_requests_queue_and_a_broken_one_fails_alone(tok):
    """The one processor of both frontends: a request given a queue (AsyncLLM's) gets
    its outputs there, one without (LLM's) in the step's list; a request whose output
    cannot be built gets an error output and is reported failed, the others not."""
    import queue

    op = OutputProcessor(tok)
    q = queue.SimpleQueue()
    op.add_request(_info("queued"), q)
    op.add_request(_info("listed"))
    broken = op.add_request(_info("broken"))

    def fail(result):
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "bad byte")

    broken.apply = fail  # applying its step (its tokens, before any text) raises
    done = op.process([RequestResult(rid, [CompletionDelta(0, [7], None, None, "length")], True)
                       for rid in ("queued", "broken", "listed")])
    assert [(o.request_id, o.error) for o in done.outputs] == [
        ("listed", None), ("broken", "building its output failed: UnicodeDecodeError: 'utf-8' codec can't decode "
                                     "byte 0xff in position 0: bad byte")]
    assert done.failed == {"broken": done.outputs[1].error} and done.stops == {}
    out = q.get_nowait()
    assert out.request_id == "queued" and out.finished and out.outputs[0].token_ids == [7] and q.empty()
    assert op.requests == {}


def test_a_sequence_the_batch_detokenizer_cannot_decode_fails_its_request_alone(tok):
    """A fast tokenizer's requests are detokenized together in one batch: a token id no
    decode takes (negative) fails its own request, the step's others get their text."""
    op = OutputProcessor(tok)
    assert op.batch is not None
    for rid in ("a", "bad", "b"):
        op.add_request(_info(rid, output_kind=RequestOutputKind.DELTA))
    done = op.process([RequestResult(rid, [CompletionDelta(0, ids, None, None)])
                       for rid, ids in (("a", [7, 8]), ("bad", [9, -1]), ("b", [10]))])
    assert [o.request_id for o in done.outputs] == ["a", "b", "bad"]
    assert [o.outputs[0].text for o in done.outputs[:2]] == [tok.decode([7, 8]), tok.decode([10])]
    assert done.outputs[2].finished and done.outputs[2].error.startswith("building its output failed: ")
    assert set(done.failed) == {"bad"} and set(op.requests) == {"a", "b"}
