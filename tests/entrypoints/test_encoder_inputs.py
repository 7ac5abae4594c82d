"""Encoder inputs are the model class's to make: it says what the encoder runs on
and how many encoder positions that yields, and the engine sizes cross tables,
budgets and checks by it."""

from __future__ import annotations

import pytest
import torch

from helpers import hf_greedy
from tandem import LLM, SamplingParams
from tandem.core.kv.block_manager import BlockManager
from tandem.core.kv.block_pool import blocks_for
from tandem.core.inputs import EncoderInputs
from tandem.core.sampling_params import SamplingParams as SP
from tandem.core.sequence import Sequence, SequenceGroup
from tandem.model_zoo.bart import BartForConditionalGeneration as Bart

DOCS = [[0, *range(10, 10 + n), 2] for n in (3, 17, 30, 41)]


def _first_half(cls, config, token_ids):
    return EncoderInputs.from_token_ids(token_ids[: (len(token_ids) + 1) // 2])


def test_a_model_that_shortens_its_encoder_input_is_served_as_it_says(bart_dir, monkeypatch):
    monkeypatch.setattr(Bart, "get_encoder_inputs", classmethod(_first_half))
    llm = LLM(model=str(bart_dir), dtype="float32", device="cpu", block_size=4)
    outs = llm.generate([{"prompt_token_ids": d} for d in DOCS], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    for doc, o in zip(DOCS, outs):
        assert o.encoder_prompt_token_ids == doc  # the request as given ...
        half = doc[: (len(doc) + 1) // 2]  # ... and what the encoder ran on
        assert o.outputs[0].token_ids == hf_greedy(bart_dir, half, o.prompt_token_ids, 8)
    assert llm.get_stats()["encoder_tokens_computed"] == sum((len(d) + 1) // 2 for d in DOCS)


def _group(rid: str, enc: EncoderInputs) -> SequenceGroup:
    return SequenceGroup(rid, enc, [Sequence(hash(rid) % 10_000, [2, 0])], SP(), 0.0)


def test_cross_tables_are_sized_by_encoder_positions_and_shared_by_content():
    bm = BlockManager(block_size=4, num_device_blocks=64, num_host_blocks=0)
    frames = torch.randn(3000, 8)
    # An audio-like input: many frames, fewer positions.
    a = _group("a", EncoderInputs(num_positions=10, features=frames))
    b = _group("b", EncoderInputs(num_positions=10, features=frames.clone()))  # equal content
    c = _group("c", EncoderInputs(num_positions=10, features=frames + 1))
    assert bm.allocate(a) is True  # runs its encoder
    assert len(bm.get_cross_block_table(a)) == blocks_for(10, 4)
    assert bm.allocate(b) is False  # shares a's cross table and encoder run
    assert bm.get_cross_block_table(b) == bm.get_cross_block_table(a)
    assert bm.allocate(c) is True
    assert set(bm.get_cross_block_table(c)).isdisjoint(bm.get_cross_block_table(a))
    # Token inputs and feature inputs never share, even at equal lengths.
    t = _group("t", EncoderInputs.from_token_ids(list(range(10))))
    assert bm.allocate(t) is True


def _features(cls, config, token_ids):
    return EncoderInputs(num_positions=len(token_ids) * 2, features=torch.zeros(len(token_ids), 4))


def test_vocabulary_checks_apply_to_token_inputs_only(bart_dir, monkeypatch):
    llm = LLM(model=str(bart_dir), dtype="float32", device="cpu")
    with pytest.raises(ValueError, match="encoder prompt token id 500 at position 1 is outside the vocabulary"):
        llm.llm_engine.add_request("tok", {"prompt_token_ids": [0, 500, 2]})
    monkeypatch.setattr(Bart, "get_encoder_inputs", classmethod(_features))
    eng = LLM(model=str(bart_dir), dtype="float32", device="cpu").llm_engine
    eng.add_request("feat", {"prompt_token_ids": [0, 500, 2]})  # not token inputs: no vocabulary
    assert eng.scheduler.groups["feat"].encoder_len == 6
    eng.abort_request("feat")
    # Positions, not prompt tokens, are held against the model's limit (128 here).
    with pytest.raises(ValueError, match="encoder prompt has 130 encoder positions; the model accepts at most 128"):
        eng.add_request("long", {"prompt_token_ids": list(range(65))})
