"""Batched incremental detokenization (``BatchDetokenizer``) against the per-sequence
path (``IncrementalDetokenizer``: the tokenizers library's ``DecodeStream``).

Oracle: ``DecodeStream`` fed the same tokens one sequence at a time. On random token
sequences (special tokens among them, several tokens a step, sequences starting and
ending at different steps, both ``skip_special_tokens`` values in one batch, non-text
tokens) every sequence's text after every step is the same, and a sequence that the
per-sequence path fails on (``DecodeStream``'s invalid prefix) fails alone in the batch.
Tokenizers: word-level with a WordPiece decoder (spaces between words), byte-level BPE
(characters split across tokens), and a SentencePiece-style Metaspace + byte-fallback
decoder (a leading space stripped only at the start)."""

from __future__ import annotations

import random

import pytest

from helpers import make_byte_tokenizer, make_tokenizer
from tandem.core.detokenizer import BatchDetokenizer, IncrementalDetokenizer

SPECIALS = ["<s>", "<pad>", "</s>", "<unk>"]


def _sentencepiece_tokenizer():
    """Metaspace words, <0xNN> byte tokens and Llama's decoder chain."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIALS)}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for w in "the rain in spain falls mainly on plain ▁ a b c".split() + ["▁"]:
        for piece in (f"▁{w}", w):
            vocab.setdefault(piece, len(vocab))
    tok = Tokenizer(models.BPE(vocab, [], byte_fallback=True, unk_token="<unk>"))
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens(SPECIALS)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   unk_token="<unk>")


TOKENIZERS = {"wordlevel": lambda: make_tokenizer(96), "bytelevel": make_byte_tokenizer,
              "sentencepiece": _sentencepiece_tokenizer}


@pytest.fixture(scope="module", params=sorted(TOKENIZERS))
def tok(request):
    return TOKENIZERS[request.param]()


def _random_sequences(rng: random.Random, vocab: int, n: int) -> list[dict]:
    seqs = []
    for _ in range(n):
        length = rng.randrange(0, 40)
        # Special ids (0-3) now and then, as a model may write them mid-output.
        ids = [rng.randrange(0, 4) if rng.random() < 0.1 else rng.randrange(4, vocab) for _ in range(length)]
        steps, i = [], 0
        while i < len(ids):
            k = 1 if rng.random() < 0.7 else rng.randrange(2, 5)  # several a step: speculation, a stream catching up
            steps.append(ids[i:i + k])
            i += k
        seqs.append({"start": rng.randrange(0, 5), "steps": steps, "skip": rng.random() < 0.6,
                     "non_text": {5, 6} if rng.random() < 0.2 else ()})
    return seqs


def _run_reference(tok, seqs):
    """Per-sequence DecodeStream: each sequence's text after each of its steps, or the
    step at which it failed."""
    out = []
    for s in seqs:
        d = IncrementalDetokenizer(tok, s["skip"], s["non_text"])
        texts = []
        try:
            for ids in s["steps"]:
                d.add(ids)
                texts.append(d.text)
        except Exception:  # noqa: BLE001 - DecodeStream's own error
            texts.append("failed")
        out.append(texts)
    return out


def _run_batched(tok, seqs):
    batch = BatchDetokenizer(tok)
    streams = [batch.stream(s["skip"], s["non_text"]) for s in seqs]
    out = [[] for _ in seqs]
    dead = set()
    last = max((s["start"] + len(s["steps"]) for s in seqs), default=0)
    for step in range(last):
        items = [(st, s["steps"][step - s["start"]]) for i, (st, s) in enumerate(zip(streams, seqs))
                 if i not in dead and 0 <= step - s["start"] < len(s["steps"])]
        failed = batch.add(items)
        for i, (st, s) in enumerate(zip(streams, seqs)):
            if i in dead or not 0 <= step - s["start"] < len(s["steps"]):
                continue
            if st in failed:
                out[i].append("failed")
                dead.add(i)
            else:
                out[i].append(st.text)
    return out


@pytest.mark.parametrize("seed", range(6))
def test_batched_text_equals_decodestream_after_every_step(tok, seed):
    vocab = len(tok.get_vocab())
    seqs = _random_sequences(random.Random(seed), vocab, 48)
    assert _run_batched(tok, seqs) == _run_reference(tok, seqs)


@pytest.mark.parametrize("name", ["wordlevel", "bytelevel"])
def test_the_final_text_is_the_tokenizers_decode(name):
    """(Not the SentencePiece-style decoder: its Strip takes a leading space off each
    window DecodeStream decodes, so its streamed text may lack spaces the whole decode
    has; the batched text is DecodeStream's there too, above.)"""
    tok = TOKENIZERS[name]()
    for seed in range(100):  # a sequence DecodeStream takes whole (random bytes may make an invalid prefix)
        rng = random.Random(seed)
        ids = [rng.randrange(4, len(tok.get_vocab())) for _ in range(30)] + [2, 0]
        refs = {skip: IncrementalDetokenizer(tok, skip) for skip in (True, False)}
        try:
            for ref in refs.values():
                ref.add(ids)
            break
        except Exception:  # noqa: BLE001 - DecodeStream's invalid prefix: try another
            continue
    batch = BatchDetokenizer(tok)
    for skip, ref in refs.items():
        s = batch.stream(skip)
        for t in ids:
            s.add([t])
        assert s.text == ref.text
        full = tok.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)
        if not full.endswith("\ufffd"):  # no partial character at the end, which a stream holds back
            assert s.text == full


def test_a_bad_token_fails_its_sequence_alone():
    tok = make_tokenizer(96)
    batch = BatchDetokenizer(tok)
    good, bad = batch.stream(True), batch.stream(True)
    failed = batch.add([(good, [7, 8]), (bad, [-1])])  # a negative id: decode_batch raises for the batch
    assert set(failed) == {bad}
    ref = IncrementalDetokenizer(tok, True)
    ref.add([7, 8])
    assert good.text == ref.text


# -- the output processor: batched against per-request, stop strings included ------------
def _processor_run(tok, seqs, batched: bool, stops: list[list[str]], kind):
    """Every request's outputs (text, token ids, finish and stop reasons) and the stop
    hits reported, stepping the sequences of ``_random_sequences`` together."""
    from tandem.core.core_outputs import CompletionDelta, RequestInfo, RequestResult
    from tandem.core.output_processor import OutputProcessor
    from tandem.core.sampling_params import SamplingParams

    op = OutputProcessor(tok)
    if not batched:
        op.batch = None  # each completion its own IncrementalDetokenizer
    assert (op.batch is not None) == batched
    for i, s in enumerate(seqs):
        params = SamplingParams(output_kind=kind, stop=stops[i], skip_special_tokens=s["skip"])
        op.add_request(RequestInfo(f"r{i}", params, None, [0, 2], None, [2, 0], non_text_token_ids=s["non_text"]))
    seen: dict[str, list] = {f"r{i}": [] for i in range(len(seqs))}
    hits: list = []
    last = max((s["start"] + len(s["steps"]) for s in seqs), default=0)
    for step in range(last):
        results = []
        for i, s in enumerate(seqs):
            k = step - s["start"]
            if 0 <= k < len(s["steps"]):
                done = k == len(s["steps"]) - 1
                results.append(RequestResult(f"r{i}", [CompletionDelta(0, s["steps"][k], None, None,
                                                                       "length" if done else None)], done))
        processed = op.process(results)
        hits.append(processed.stops)
        for out in processed.outputs:
            c = out.outputs[0]
            # A failed request's error names the exception's type: DecodeStream's is a plain Exception.
            error = out.error and out.error.replace("InvalidPrefixError: ", "Exception: ")
            seen[out.request_id].append((c.text, c.token_ids, c.finish_reason, c.stop_reason, out.finished, error))
    return seen, hits


@pytest.mark.parametrize("seed", range(4))
def test_the_processor_streams_the_same_batched_as_per_request(tok, seed):
    from tandem.core.sampling_params import RequestOutputKind

    vocab = len(tok.get_vocab())
    rng = random.Random(100 + seed)
    seqs = _random_sequences(rng, vocab, 40)
    # Two requests in three stop on three characters from the middle of their own text,
    # which may span tokens; the others have none.
    stops = [[t[-1][len(t[-1]) // 2 - 1:][:3]] if i % 3 and t and len(t[-1]) > 4 and t[-1] != "failed" else []
             for i, t in enumerate(_run_reference(tok, seqs))]
    for kind in (RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE, RequestOutputKind.FINAL_ONLY):
        batched = _processor_run(tok, seqs, True, stops, kind)
        assert batched == _processor_run(tok, seqs, False, stops, kind)
        if kind is RequestOutputKind.DELTA:
            assert any(h for h in batched[1]), "no stop string was hit: the test checks nothing of them"
