"""A mode added from outside ``tandem/`` (``forced_words_mode.py``) through the
``tandem_register_modes`` hook runs mixed with plain, n > 1 and beam requests,
against a plain greedy loop over HF's model with the forced tokens inserted; a
fault injected in each of its hooks fails only its request."""

from importlib.metadata import EntryPoint

import pytest
import torch

import forced_words_mode as fw
from helpers import make_bart
from tandem import SamplingParams
from tandem.core.config import EngineConfig
from tandem.core.engine import LLMEngine
from tandem.plugins import PluginManager, default_backend_registry, default_model_registry
from tandem.registry import AttentionBackendRegistry, ModelRegistry, ModeRegistry

EOS = 2


@pytest.fixture(scope="module")
def bart_dir(tmp_path_factory):
    return make_bart(tmp_path_factory.mktemp("bart") / "ckpt", seed=0)


@pytest.fixture(scope="module")
def engine(bart_dir):
    modes = ModeRegistry()
    manager = PluginManager(allow=None, entry_point_list=[
        EntryPoint(name="forced-words", value="forced_words_mode:plugin", group="tandem.plugins")])
    manager.load()
    manager.register_all(ModelRegistry(), AttentionBackendRegistry(), mode_registry=modes)
    assert "forced_words" in modes.names() and modes.owner("forced_words") == "forced-words"
    cfg = EngineConfig(model=str(bart_dir), dtype="float32", device="cpu")
    eng = LLMEngine(cfg, default_model_registry(), default_backend_registry(), modes)
    yield eng
    eng.shutdown()


def _oracle(bart_dir, prompt, max_tokens, forced):
    from transformers import BartForConditionalGeneration

    model = BartForConditionalGeneration.from_pretrained(str(bart_dir)).eval()
    dec, out = [2, 0], []
    with torch.no_grad():
        for n in range(max_tokens):
            tok = forced.get(n)
            if tok is None:
                logits = model(input_ids=torch.tensor([prompt]), decoder_input_ids=torch.tensor([dec])).logits
                tok = int(logits[0, -1].argmax())
            out.append(tok)
            dec.append(tok)
            if tok == EOS:
                break
    return out


def _run(engine, requests):
    for rid, prompt, params in requests:
        engine.add_request(rid, {"prompt_token_ids": prompt}, params)
    done = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o
    return done


PROMPTS = [[5, 17, 33, 8, 41, 2], [9, 12, 60, 3, 2], [44, 21, 7, 2]]


def test_forced_words_mixed_with_sampling_n_and_beams(engine, bart_dir):
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    n2 = SamplingParams(temperature=0.0, n=2, max_tokens=8)
    beams = SamplingParams(num_beams=3, max_tokens=8)
    sampled = SamplingParams(temperature=0.9, seed=1, max_tokens=8)
    done = _run(engine, [("forced-a", PROMPTS[0], greedy), ("plain-b", PROMPTS[1], greedy),
                         ("forced-c", PROMPTS[1], n2), ("forced-d", PROMPTS[2], beams),
                         ("forced-e", PROMPTS[2], sampled)])
    assert done["forced-a"].outputs[0].token_ids == _oracle(bart_dir, PROMPTS[0], 8, fw.FORCED)
    assert done["plain-b"].outputs[0].token_ids == _oracle(bart_dir, PROMPTS[1], 8, {})
    want = _oracle(bart_dir, PROMPTS[1], 8, fw.FORCED)
    assert [c.token_ids for c in done["forced-c"].outputs] == [want, want]
    for out in (done["forced-d"], done["forced-e"]):
        for c in out.outputs:
            for pos, tok in fw.FORCED.items():
                if pos < len(c.token_ids):
                    assert c.token_ids[pos] == tok, (out.request_id, c.token_ids)
    assert all(o.error is None for o in done.values())


def test_forced_words_with_structured_output_is_refused_naming_both(engine):
    from tandem.core.structured_params import StructuredOutputsParams

    p = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(choice=["a", "b"]))
    with pytest.raises(ValueError, match="forced_words.*structured_output"):
        engine.add_request("forced-so", {"prompt_token_ids": PROMPTS[0]}, p)


@pytest.mark.parametrize("hook", ["ready", "lookahead", "step_mode", "batch_items", "update"])
def test_a_fault_in_a_hook_fails_only_its_request(engine, bart_dir, hook):
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    fw.FAULT = (f"forced-bad-{hook}", hook)
    try:
        done = _run(engine, [(f"forced-bad-{hook}", PROMPTS[0], greedy), (f"forced-ok-{hook}", PROMPTS[1], greedy),
                             (f"plain-{hook}", PROMPTS[2], greedy)])
    finally:
        fw.FAULT = None
    assert "injected fault" in done[f"forced-bad-{hook}"].error
    assert done[f"forced-ok-{hook}"].outputs[0].token_ids == _oracle(bart_dir, PROMPTS[1], 8, fw.FORCED)
    assert done[f"plain-{hook}"].outputs[0].token_ids == _oracle(bart_dir, PROMPTS[2], 8, {})
    assert engine.block_manager.num_free_blocks() == engine.block_manager.num_total_blocks()
    # The engine serves on.
    assert _run(engine, [(f"again-{hook}", PROMPTS[0], greedy)])[f"again-{hook}"].error is None


@pytest.mark.parametrize("hook", ["before_schedule", "logits_transform"])
def test_a_fault_in_a_mode_level_hook_fails_only_that_modes_requests(engine, bart_dir, hook):
    """A mode's own batch hook concerns every request of the mode it was given that
    step: those fail; a request of no mode of that kind finishes as without the fault."""
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    fw.FAULT = (f"forced-bad-{hook}", hook)
    try:
        done = _run(engine, [(f"forced-bad-{hook}", PROMPTS[0], greedy), (f"forced-also-{hook}", PROMPTS[1], greedy),
                             (f"plain-{hook}", PROMPTS[2], greedy)])
    finally:
        fw.FAULT = None
    for rid in (f"forced-bad-{hook}", f"forced-also-{hook}"):
        assert f"mode 'forced_words': {hook} failed: RuntimeError: injected fault in {hook}" in done[rid].error
    assert done[f"plain-{hook}"].error is None
    assert done[f"plain-{hook}"].outputs[0].token_ids == _oracle(bart_dir, PROMPTS[2], 8, {})
    assert engine.block_manager.num_free_blocks() == engine.block_manager.num_total_blocks()
    assert _run(engine, [(f"forced-again-{hook}", PROMPTS[1], greedy)])[f"forced-again-{hook}"].outputs[0].token_ids \
        == _oracle(bart_dir, PROMPTS[1], 8, fw.FORCED)


def test_beam_requests_declare_final_whole_outputs(engine):
    """The output processor names no mode: beam search's shape (nothing until the
    end, no stop strings cutting a hypothesis) comes from its mode, carried in the
    request's info; a plain request streams its n completions."""
    from tandem.core.core_outputs import OutputShape
    from tandem.core.sampling_params import RequestOutputKind

    beams = SamplingParams(num_beams=3, n=2, max_tokens=6, output_kind=RequestOutputKind.CUMULATIVE)
    plain = SamplingParams(temperature=0.0, n=2, max_tokens=6, output_kind=RequestOutputKind.CUMULATIVE)
    info_b = engine.add_request("shape-beams", {"prompt_token_ids": PROMPTS[0]}, beams)
    info_p = engine.add_request("forced-shape-plain", {"prompt_token_ids": PROMPTS[1]}, plain)
    assert info_b.shape == OutputShape(0, streams=False, stop_strings=False)
    assert info_p.shape == OutputShape(2)  # the forced-words mode leaves the shape as it is
    seen: dict[str, list] = {"shape-beams": [], "forced-shape-plain": []}
    while engine.has_unfinished_requests():
        for o in engine.step():
            seen[o.request_id].append(o)
    assert len(seen["shape-beams"]) == 1 and seen["shape-beams"][0].finished
    assert len(seen["shape-beams"][0].outputs) == 2
    assert len(seen["forced-shape-plain"]) > 1 and all(len(o.outputs) == 2 for o in seen["forced-shape-plain"])


@pytest.fixture(scope="module")
def spec_engine(bart_dir):
    modes = ModeRegistry()
    manager = PluginManager(allow=None, entry_point_list=[
        EntryPoint(name="forced-words", value="forced_words_mode:plugin", group="tandem.plugins")])
    manager.load()
    manager.register_all(ModelRegistry(), AttentionBackendRegistry(), mode_registry=modes)
    cfg = EngineConfig(model=str(bart_dir), dtype="float32", device="cpu",
                       speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2})
    eng = LLMEngine(cfg, default_model_registry(), default_backend_registry(), modes)
    yield eng
    eng.shutdown()


def test_forced_words_yields_to_speculation(spec_engine, bart_dir):
    """The mode declares ``yields_to={"speculative"}``: where speculation runs a
    request, the forced words step aside (the request decodes as plain greedy, its
    drafts verified); where speculation does not apply (a request with a logits
    processor), the words are forced. Prompts repeat tokens so ngram drafts exist."""
    assert "speculative" in fw.ForcedWordsMode.yields_to
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    with_proc = greedy.replace(logits_processors=[lambda ids, logits: logits])
    prompt = [5, 17, 33, 5, 17, 33, 5, 17, 2]
    before = spec_engine.get_stats()["spec_draft_tokens"]
    done = _run(spec_engine, [("forced-spec", prompt, greedy), ("forced-nospec", prompt, with_proc),
                              ("plain-spec", PROMPTS[1], greedy)])
    assert all(o.error is None for o in done.values())
    assert done["forced-spec"].outputs[0].token_ids == _oracle(bart_dir, prompt, 8, {})
    assert done["forced-nospec"].outputs[0].token_ids == _oracle(bart_dir, prompt, 8, fw.FORCED)
    assert done["plain-spec"].outputs[0].token_ids == _oracle(bart_dir, PROMPTS[1], 8, {})
    assert spec_engine.get_stats()["spec_draft_tokens"] > before  # speculation did run
    assert spec_engine.block_manager.num_free_blocks() == spec_engine.block_manager.num_total_blocks()
