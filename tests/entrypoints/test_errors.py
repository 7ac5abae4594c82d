"""Bad input gives a clear error naming the value; other requests keep going."""

import json
import shutil

import pytest

from helpers import hf_greedy, make_bart
from tandem import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(bart_dir):
    return LLM(model=str(bart_dir), dtype="float32", device="cpu")


def test_bad_prompts_are_reported_alone_and_the_rest_are_served(llm, bart_dir):
    good = [{"prompt_token_ids": [0, 11, 12, 13, 2]}, "the rain in spain"]
    bad = [
        {"prompt_token_ids": [0, 99999, 2]},  # outside the vocabulary
        {"prompt_token_ids": [0] + [5] * 200 + [2]},  # longer than 128 positions
        {"prompt_token_ids": []},  # empty
        "",  # empty text
        {"encoder_prompt": "the sun", "decoder_prompt": {"prompt_token_ids": [2, -1]}},
        {"bogus": 1},
        42,
    ]
    prompts = [good[0], *bad, good[1]]
    params = SamplingParams(temperature=0.0, max_tokens=8)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert len(outs) == len(prompts)
    first, *rejected, last = outs
    messages = [o.error for o in rejected]
    assert all(m for m in messages)
    # one output per requested one, empty, saying why: vLLM's `o.outputs[0].text` reads "" (docs/from_vllm.md)
    for o in rejected:
        assert [(c.index, c.text, c.token_ids, c.finish_reason, c.error) for c in o.outputs] == \
            [(0, "", [], "error", o.error)]
    assert "99999" in messages[0] and "vocabulary" in messages[0]
    assert "202 tokens" in messages[1] and "128" in messages[1]
    assert "empty" in messages[2] and "empty" in messages[3]
    assert "-1" in messages[4]
    assert "bogus" in messages[5]
    assert "int" in messages[6]
    for o in (first, last):
        assert o.error is None
        ref = hf_greedy(bart_dir, o.encoder_prompt_token_ids, o.prompt_token_ids, 8)
        assert o.outputs[0].token_ids == ref


def test_a_refused_request_has_an_error_output_per_requested_output(llm):
    out = llm.generate({"prompt_token_ids": [0, 99999, 2]}, SamplingParams(n=3, temperature=1.0, max_tokens=4),
                       use_tqdm=False)[0]
    assert "99999" in out.error
    assert [(c.index, c.text, c.finish_reason, c.error) for c in out.outputs] == \
        [(i, "", "error", out.error) for i in range(3)]


def test_decoder_budget_and_sampling_params_errors(llm):
    out = llm.generate("the sun", SamplingParams(max_tokens=127), use_tqdm=False)[0]
    assert "max_tokens (127)" in out.error and "128" in out.error
    with pytest.raises(ValueError, match=r"max_tokens=0"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match=r"top_p=1.5"):
        SamplingParams(top_p=1.5)
    with pytest.raises(ValueError, match=r"min_tokens=9"):
        SamplingParams(min_tokens=9, max_tokens=4)
    with pytest.raises(ValueError, match=r"temperature=-1"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="2 sampling params for 1 prompts"):
        llm.generate(["a"], [SamplingParams(), SamplingParams()], use_tqdm=False)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(dtype="float8"), "dtype='float8'"),
        (dict(device="tpu"), "device='tpu'"),
        (dict(block_size=0), "block_size=0"),
        (dict(num_kv_blocks=-3), "num_kv_blocks=-3"),
        (dict(kv_cache_memory=0), "kv_cache_memory=0"),
        (dict(swap_space=-1), "swap_space=-1"),
        (dict(max_num_seqs=0), "max_num_seqs=0"),
        (dict(max_num_batched_tokens=4, max_num_seqs=8), "max_num_batched_tokens=4"),
        (dict(attention_backend="nope"), "attention_backend='nope'.*torch_sdpa"),
        (dict(preemption_mode="drop"), "preemption_mode='drop'"),
    ],
)
def test_engine_arguments_are_validated(bart_dir, kwargs, match):
    with pytest.raises(ValueError, match=match):
        LLM(model=str(bart_dir), **kwargs)


def test_unknown_architecture_lists_supported(tmp_path, bart_dir):
    d = tmp_path / "m"
    shutil.copytree(bart_dir, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["FancyNewModel"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"FancyNewModel.*supported: .*BartForConditionalGeneration"):
        LLM(model=str(d))


def test_missing_and_corrupt_weights(tmp_path, bart_dir):
    from tandem.core.checkpoint import WeightLoadError

    missing = tmp_path / "missing"
    shutil.copytree(bart_dir, missing)
    (missing / "model.safetensors").unlink()
    with pytest.raises(WeightLoadError, match="no weights in"):
        LLM(model=str(missing))

    corrupt = tmp_path / "corrupt"
    shutil.copytree(bart_dir, corrupt)
    (corrupt / "model.safetensors").write_bytes(b"\x00garbage" * 10)
    with pytest.raises(WeightLoadError, match="model.safetensors"):
        LLM(model=str(corrupt))

    with pytest.raises(ValueError, match="not a local checkpoint directory"):
        LLM(model=str(tmp_path / "nowhere"))


def test_pool_too_small_for_a_request_is_rejected(bart_dir):
    llm = LLM(model=str(bart_dir), dtype="float32", device="cpu", block_size=4, num_kv_blocks=8)
    outs = llm.generate(
        [{"prompt_token_ids": [0] + [5] * 60 + [2]}, {"prompt_token_ids": [0, 5, 2]}],
        SamplingParams(temperature=0.0, max_tokens=4),
        use_tqdm=False,
    )
    assert "KV blocks" in outs[0].error
    assert outs[1].error is None and len(outs[1].outputs[0].token_ids) >= 1


def test_pytorch_bin_and_sharded_checkpoints(tmp_path):
    from transformers import BartForConditionalGeneration

    src = make_bart(tmp_path / "src", seed=3)
    model = BartForConditionalGeneration.from_pretrained(src)
    prompts = [{"prompt_token_ids": [0, 7, 8, 9, 2]}, {"prompt_token_ids": [0, 30, 2]}]
    params = SamplingParams(temperature=0.0, max_tokens=10)
    ref = [o.outputs[0].token_ids for o in LLM(model=str(src), dtype="float32", device="cpu").generate(prompts, params, use_tqdm=False)]

    sharded = tmp_path / "sharded"
    model.save_pretrained(sharded, max_shard_size="20KB")
    assert (sharded / "model.safetensors.index.json").exists()
    shutil.copy(src / "tokenizer.json", sharded)
    out = LLM(model=str(sharded), dtype="float32", device="cpu").generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in out] == ref

    import torch

    binary = tmp_path / "bin"
    binary.mkdir()
    shutil.copy(src / "config.json", binary)
    torch.save(model.state_dict(), binary / "pytorch_model.bin")
    out = LLM(model=str(binary), dtype="float32", device="cpu").generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in out] == ref


def test_requests_whose_recompute_would_exceed_the_token_budget_are_rejected(bart_dir):
    llm = LLM(model=str(bart_dir), dtype="float32", device="cpu", max_num_seqs=4, max_num_batched_tokens=40)
    outs = llm.generate(
        [{"prompt_token_ids": [0, 5, 6, 2]}, {"prompt_token_ids": [0, 5, 6, 2]}],
        [SamplingParams(max_tokens=40), SamplingParams(temperature=0.0, max_tokens=30)],
        use_tqdm=False,
    )
    assert "45 tokens in one step" in outs[0].error and "max_num_batched_tokens=40" in outs[0].error
    assert outs[1].error is None


def test_pool_size_from_memory_blocks_or_the_default(bart_dir):
    # tiny model: 2 layers x K,V x 16 slots x 4 heads x 8 dims x 4 bytes = 8 KiB a block
    sized = LLM(model=str(bart_dir), dtype="float32", device="cpu", kv_cache_memory=0.5 / 1024)
    assert sized.engine.block_manager.num_total_blocks() == 64
    explicit = LLM(model=str(bart_dir), dtype="float32", device="cpu", num_kv_blocks=123)
    assert explicit.engine.block_manager.num_total_blocks() == 123
    default = LLM(model=str(bart_dir), dtype="float32", device="cpu", max_num_seqs=10)
    # 10 requests x (128 / 16 encoder + 128 / 16 decoder blocks), plus 2%
    assert default.engine.block_manager.num_total_blocks() == int(10 * 16 * 1.02) + 1
    assert default.engine.kv_caches[0].shape[1] == int(10 * 16 * 1.02) + 1
