"""``LLM.generate`` keeps the objects alive at its start out of the garbage collector's
way for the call (a full collection walked them all), and leaves them collectable after."""

import gc

from tandem import LLM, SamplingParams


def test_the_heap_is_frozen_for_the_call_only(bart_dir, monkeypatch):
    llm = LLM(model=str(bart_dir), dtype="float32", device="cpu")
    engine, real_step, seen = llm.llm_engine, llm.llm_engine.step, []

    def step():
        seen.append(gc.get_freeze_count())
        return real_step()

    monkeypatch.setattr(engine, "step", step)
    assert gc.get_freeze_count() == 0
    outs = llm.generate([{"prompt_token_ids": [0, 5, 6, 2]}] * 3, SamplingParams(max_tokens=4), use_tqdm=False)
    assert all(o.error is None for o in outs)
    assert seen and min(seen) > 0  # the objects alive at the start, frozen during every step
    assert gc.get_freeze_count() == 0
    # A caller that froze the heap itself (as `tandem serve` does) keeps it frozen.
    gc.freeze()
    try:
        llm.generate({"prompt_token_ids": [0, 5, 2]}, SamplingParams(max_tokens=2), use_tqdm=False)
        assert gc.get_freeze_count() > 0  # not unfrozen by the call (objects freed since leave the count)
    finally:
        gc.unfreeze()
    # And an exception inside the call unfreezes too.
    monkeypatch.setattr(engine, "step", lambda: (_ for _ in ()).throw(RuntimeError("boom")))
    try:
        llm.generate({"prompt_token_ids": [0, 5, 2]}, SamplingParams(max_tokens=2), use_tqdm=False)
    except RuntimeError:
        pass
    assert gc.get_freeze_count() == 0
