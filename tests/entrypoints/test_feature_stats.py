"""The optional features are named in the start-up line and counted in ``get_stats()``
(and so in ``/metrics``): kv_compress's compressed requests and the blocks that freed
(against the block manager's own accounting), the LM-head screen's rows (against the
rows the step sampled), the adapters a step runs."""

from __future__ import annotations

import logging
from pathlib import Path

import tandem
from tandem import LLM, SamplingParams

DEMO = Path(tandem.__file__).parent / "demo_model"
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)
PROMPTS = ["the cat sat on the mat and then it slept all afternoon in the warm sun",
           "my dog ate the red apple that fell from the old tree behind our house"]


def test_kv_compress_is_named_at_start_and_its_savings_counted(caplog):
    with caplog.at_level(logging.INFO, logger="tandem"):
        llm = LLM(model=str(DEMO), dtype="float32", device="cpu", block_size=4, num_kv_blocks=400, swap_space=0.01,
                  encoder_cache_blocks=0, kv_compress={"keep_fraction": 0.3, "window": 2, "min_keep": 1})
    ready = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("engine ready"))
    assert "kv_compress" in ready
    before = llm.get_stats()
    assert before["kv_compress_requests"] == before["kv_compress_blocks_freed"] == 0
    session = llm.engine
    for i, p in enumerate(PROMPTS):
        session.add_request(f"c{i}", p, GREEDY)
    free_before_compress = None
    while session.has_unfinished_requests():
        stats = session.get_stats()
        if stats["kv_compress_requests"] == 0:
            free_before_compress = stats["kv_blocks_free"]
        session.step()
    stats = llm.get_stats()
    assert stats["kv_compress_requests"] == len(PROMPTS)
    assert stats["kv_compress_blocks_freed"] > 0
    assert free_before_compress is not None and stats["kv_blocks_free"] == stats["kv_blocks_total"]


def test_the_lm_head_screen_is_named_at_start_and_its_rows_counted(caplog):
    with caplog.at_level(logging.INFO, logger="tandem"):
        on = LLM(model=str(DEMO), dtype="float32", device="cpu", seed=0, max_num_seqs=4, lm_head_screen="auto")
    ready = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("engine ready"))
    if not on.engine.worker.has_lm_head_screen:  # the screen did not set up on this CPU: nothing to count
        assert "LM-head int8 screen" not in ready
        return
    assert "LM-head int8 screen" in ready
    outs = on.generate(PROMPTS, GREEDY, use_tqdm=False)
    stats = on.get_stats()
    sampled = sum(len(o.outputs[0].token_ids) for o in outs)
    assert 0 < stats["lm_head_screen_rows"] + stats["lm_head_screen_full_rows"] <= sampled
    off = LLM(model=str(DEMO), dtype="float32", device="cpu", seed=0, max_num_seqs=4, lm_head_screen="off")
    off.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert off.get_stats()["lm_head_screen_rows"] == off.get_stats()["lm_head_screen_full_rows"] == 0


def test_a_plain_engine_counts_nothing_and_names_no_feature(caplog):
    with caplog.at_level(logging.INFO, logger="tandem"):
        llm = LLM(model=str(DEMO), dtype="float32", device="cpu", lm_head_screen="off",
                  structured_outputs_disable_jump_forward=True)
    ready = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("engine ready"))
    assert "; with " not in ready
    llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    stats = llm.get_stats()
    for name in ("kv_compress_requests", "kv_compress_blocks_freed", "lora_adapters_running",
                 "lm_head_screen_rows", "lm_head_screen_full_rows"):
        assert stats[name] == 0, name


def test_lora_is_named_at_start_and_the_step_adapters_counted(tmp_path, caplog):
    """Two adapters and the base model in one run of equal-length requests: the steps
    that run both adapters count 2, and no step counts more."""
    from tandem import LoRARequest

    import lora_adapters
    from transformers import BartConfig, BartForConditionalGeneration

    base = tmp_path / "base"
    cfg = BartConfig(vocab_size=300, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                     decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64)
    BartForConditionalGeneration(cfg).save_pretrained(base)
    adapters = [lora_adapters.make_peft_adapter(base, tmp_path / f"a{i}", seed=i) for i in (1, 2)]
    with caplog.at_level(logging.INFO, logger="tandem"):
        llm = LLM(model=str(base), dtype="float32", device="cpu", enable_lora=True, max_loras=2)
    ready = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("engine ready"))
    assert "LoRA (max_loras=2)" in ready
    loras = [LoRARequest(f"a{i}", i, str(p)) for i, p in enumerate(adapters, start=1)]
    params = SamplingParams(temperature=0.0, max_tokens=6, min_tokens=6, ignore_eos=True)
    prompts = [{"prompt_token_ids": [0, 5 + i, 6, 2]} for i in range(3)]
    # Adapters are read in the background: a request waits until its adapter is in, so
    # the steps before both are in run one (or none). Once both are, a step runs both.
    engine, seen, outs = llm.llm_engine, [], []
    for i, (prompt, lora) in enumerate(zip(prompts, [loras[0], None, loras[1]])):
        engine.add_request(str(i), prompt, params, lora_request=lora)
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.finished]
        seen.append(engine.get_stats()["lora_adapters_running"])
    assert len(outs) == 3 and all(o.error is None for o in outs)
    assert max(seen) == 2 and set(seen) <= {0, 1, 2}, seen
