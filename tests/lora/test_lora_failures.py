"""An adapter that cannot be served fails only the requests naming it, with
"LoRA adapter 'NAME' (PATH): reason"; the rest of the batch is served as if alone.
Also: the adapter cache (resident slots, CPU LRU) and the scalings PEFT itself computes."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers import make_bart
from lora_adapters import edit_config, hf_model, make_adapter
from tandem import LLM, LoRARequest, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=6)
PROMPTS = [{"prompt_token_ids": [5, 17, 33, 9, 41]}, {"prompt_token_ids": [60, 7, 7, 12]},
           {"prompt_token_ids": [11, 90, 4]}]


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def _tamper(path, fn):
    f = path / "adapter_model.safetensors"
    tensors = load_file(f)
    fn(tensors)
    save_file(tensors, f)


def _cases(root, base, good):
    """name -> (adapter path, words its error must hold)."""
    c = {}
    c["missing"] = (root / "nowhere", "not a local adapter directory (no such directory)")
    c["rank"] = (make_adapter(base, root / "rank", ["q_proj"], r=8), "rank 8, above max_lora_rank=4")
    c["lm_head"] = (make_adapter(base, root / "lm_head", ["q_proj", "lm_head"]), "lm_head.base_layer.weight' is not a LoRA")
    other = make_bart(root / "other_base", encoder_layers=3, with_tokenizer=False)
    c["layers"] = (make_adapter(other, root / "layers", ["fc1"]), "'model.encoder.layers.2.fc1': the model has no linear")
    narrow = make_bart(root / "narrow_base", d_model=16, encoder_attention_heads=2, decoder_attention_heads=2,
                       with_tokenizer=False)
    c["shape"] = (make_adapter(narrow, root / "shape", ["fc2"]), "does not fit the model's layer")

    def nan(t):
        next(v for k, v in t.items() if "lora_B" in k)[0, 0] = float("nan")
    c["nan"] = (_copy(good, root / "nan"), "holds NaN values")
    _tamper(c["nan"][0], nan)
    for name, fields, words in [("dora", {"use_dora": True}, "DoRA (use_dora) is not supported"),
                                ("save", {"modules_to_save": ["lm_head"]}, "modules_to_save"),
                                ("bias", {"bias": "all"}, "bias='all'"),
                                ("ia3", {"peft_type": "IA3"}, "peft_type='IA3': only LORA")]:
        c[name] = (_copy(good, root / name), words)
        edit_config(c[name][0], **fields)
    c["bin"] = (_copy(good, root / "bin"), "pickled .bin adapters are refused")
    (c["bin"][0] / "adapter_model.safetensors").rename(c["bin"][0] / "adapter_model.bin")
    return c


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_fail")
    base = make_bart(root / "base", seed=4)
    good = make_adapter(base, root / "good", ["q_proj", "v_proj", "fc1"], seed=7)
    llm = LLM(str(base), dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=4)
    ok = LoRARequest("good", 1, str(good))
    alone = [llm.generate([p], GREEDY, lora_request=lora, use_tqdm=False)[0].outputs[0].token_ids
             for p, lora in zip(PROMPTS, [ok, None, ok])]
    return llm, ok, alone, _cases(root, base, good)


CASES = ["missing", "rank", "lm_head", "layers", "shape", "nan", "dora", "save", "bias", "ia3", "bin"]


@pytest.mark.parametrize("case", CASES)
def test_a_bad_adapter_fails_its_request_and_the_batch_is_served(setup, case):
    llm, ok, alone, cases = setup
    path, words = cases[case]
    bad = LoRARequest(f"bad-{case}", 100 + CASES.index(case), str(path))
    outs = llm.generate(PROMPTS + PROMPTS[:1], GREEDY, lora_request=[ok, None, ok, bad], use_tqdm=False)
    assert outs[3].error is not None
    assert outs[3].error.startswith(f"LoRA adapter 'bad-{case}' ({path}): "), outs[3].error
    assert words in outs[3].error, outs[3].error
    assert [o.error for o in outs[:3]] == [None] * 3
    assert [o.outputs[0].token_ids for o in outs[:3]] == alone
    assert not llm.llm_engine.has_unfinished_requests()


def test_adapters_beyond_the_slots_load_on_demand_from_the_cpu_cache(tmp_path):
    base = make_bart(tmp_path / "base", seed=4)
    loras = [LoRARequest(f"a{i}", i, str(make_adapter(base, tmp_path / f"a{i}", ["q_proj", "fc2"], seed=i)))
             for i in (1, 2, 3)]
    llm = LLM(str(base), dtype="float32", enable_lora=True, max_loras=1, max_cpu_loras=2)
    manager, reads = llm.llm_engine.executor.worker.lora, llm.llm_engine.lora_loads
    first = {i: llm.generate(PROMPTS[:1], GREEDY, lora_request=loras[i], use_tqdm=False)[0].outputs[0].token_ids
             for i in range(3)}  # a1, a2, a3 read from disk: the CPU cache keeps a2, a3
    assert reads.loads == 3 and list(manager.cpu) == [2, 3]
    again = llm.generate(PROMPTS[:1], GREEDY, lora_request=loras[1], use_tqdm=False)[0].outputs[0].token_ids
    assert reads.loads == 3 and again == first[1]  # from the CPU cache, into the one slot
    llm.generate(PROMPTS[:1], GREEDY, lora_request=loras[0], use_tqdm=False)
    assert reads.loads == 4 and list(manager.cpu) == [2, 1]  # a3 was least recently used
    assert manager.loads == 0  # every read ran off the step (tandem.lora.loader), none inside it
    # One slot, three adapters in one call: the scheduler runs them a step at a time, outputs unchanged.
    outs = llm.generate(PROMPTS[:1] * 3, GREEDY, lora_request=loras, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [first[0], first[1], first[2]]
    assert len({tuple(t) for t in first.values()}) > 1


def test_scalings_are_peft_own(tmp_path):
    """lora_alpha / r, rsLoRA's lora_alpha / sqrt(r), rank_pattern and alpha_pattern, per module,
    as PEFT's loaded LoRA layers hold them."""
    from peft import PeftModel
    from peft.tuners.lora import LoraLayer

    from tandem.lora.adapter import read_adapter

    base = make_bart(tmp_path / "base", seed=4)
    path = make_adapter(base, tmp_path / "a", ["q_proj", "v_proj", "fc1"], r=4, alpha=6, use_rslora=True,
                        rank_pattern={"fc1": 2, "decoder.layers.0.self_attn.q_proj": 3},
                        alpha_pattern={"v_proj": 10})
    peft = PeftModel.from_pretrained(hf_model(base), str(path))
    want = {name.removeprefix("base_model.model."): m.scaling["default"]
            for name, m in peft.named_modules() if isinstance(m, LoraLayer)}
    got = read_adapter(path, max_rank=4).modules
    assert set(got) == set(want) and len({round(v, 6) for v in want.values()}) >= 3
    for name, scaling in want.items():
        assert got[name].scaling == pytest.approx(scaling, rel=1e-12), name
        assert got[name].rank == peft.get_submodule("base_model.model." + name).r["default"]
    assert torch.equal(got["model.encoder.layers.0.fc1"].a,
                       peft.get_submodule("base_model.model.model.encoder.layers.0.fc1").lora_A["default"].weight)
