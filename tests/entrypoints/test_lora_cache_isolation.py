"""End to end, with the adapters' math (tandem/lora): a request never reads another
adapter's (or the base model's) cached encoder output or prompt blocks. The oracle
is each request run alone in a fresh engine; the encoder cache and the prefix cache
are on (their defaults) and hold the earlier requests' blocks when the next comes."""

from __future__ import annotations

from lora_adapters import make_peft_adapter
from tandem import LLM, LoRARequest, SamplingParams

PARAMS = SamplingParams(temperature=0.0, max_tokens=6)
# 20 decoder-prompt tokens: one full block of 16 the prefix cache keeps.
PROMPT = {"encoder_prompt": {"prompt_token_ids": [0] + list(range(20, 40)) + [2]},
          "decoder_prompt": {"prompt_token_ids": [2, 0] + list(range(40, 58))}}


def _tokens(llm, lora):
    out = llm.generate([PROMPT], PARAMS, lora_request=lora, use_tqdm=False)[0]
    assert out.error is None, out.error
    return out.outputs[0].token_ids


def test_cached_encoder_outputs_and_prompt_blocks_stay_with_their_adapter(bart_dir, tmp_path):
    # k/v/fc1 targets: the adapter changes both the cross K/V and the decoder's self K/V.
    a = LoRARequest("a", 1, str(make_peft_adapter(bart_dir, tmp_path / "a", seed=1,
                                                  target_modules=("q_proj", "k_proj", "v_proj", "fc1"))))
    b = LoRARequest("b", 2, str(make_peft_adapter(bart_dir, tmp_path / "b", seed=2,
                                                  target_modules=("q_proj", "k_proj", "v_proj", "fc1"))))
    alone = {}
    for name, lora in (("a", a), ("b", b), ("base", None)):
        alone[name] = _tokens(LLM(str(bart_dir), dtype="float32", num_kv_blocks=64, swap_space=0, enable_lora=True), lora)
    assert len({tuple(t) for t in alone.values()}) == 3  # the adapters change the output: the test can fail

    llm = LLM(str(bart_dir), dtype="float32", num_kv_blocks=64, swap_space=0, enable_lora=True)
    assert _tokens(llm, a) == alone["a"]
    assert _tokens(llm, b) == alone["b"]  # a's encoder output and prompt blocks are kept, not taken
    assert _tokens(llm, None) == alone["base"]
    assert llm.get_stats()["encoder_tokens_reused"] == 0
    assert _tokens(llm, a) == alone["a"]  # a takes its own kept encoder output back
    assert llm.get_stats()["encoder_tokens_reused"] == 22
