"""Ray Data with ``TandemPredictor`` (one engine per actor) gives what ``LLM.generate``
gives on the same prompts, row for row, and a row that cannot be served carries its
error without stopping the job."""

import random

import pytest

pytest.importorskip("ray")

from helpers import WORDS  # noqa: E402

from tandem import LLM, SamplingParams  # noqa: E402

# torch_sdpa: no C++ op to build or load in each actor.
ENGINE = dict(dtype="float32", device="cpu", max_num_seqs=16, attention_backend="torch_sdpa")
PARAMS = {"temperature": 0.0, "max_tokens": 8}


def _prompts(n: int) -> list[str]:
    rng = random.Random(0)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 12))) for _ in range(n)]


def test_ray_data_equals_llm_generate(ray_local, bart_dir):
    from tandem.integrations.ray.data import TandemPredictor

    prompts = _prompts(64)
    too_long = "the " * 200  # over the checkpoint's 128 positions: that row's error, not the job's
    rows = [{"id": i, "prompt": p} for i, p in enumerate(prompts)] + [{"id": 64, "prompt": too_long}]
    # Two actors, batches of 16: each engine sees its own share of the rows, in batches
    # unlike the single in-process call below.
    out = ray_local.data.from_items(rows).map_batches(
        TandemPredictor,
        fn_constructor_kwargs=dict(model=str(bart_dir), sampling_params=PARAMS, **ENGINE),
        compute=ray_local.data.ActorPoolStrategy(size=2),
        batch_size=16,
    ).take_all()
    out = sorted(out, key=lambda r: r["id"])
    ref = LLM(str(bart_dir), **ENGINE).generate(prompts, SamplingParams(**PARAMS), use_tqdm=False)
    assert [r["id"] for r in out] == list(range(65))
    for row, want in zip(out, ref):
        assert row["error"] is None
        assert row["prompt"] == want.encoder_prompt
        assert list(row["generated_token_ids"]) == want.outputs[0].token_ids
        assert row["generated_text"] == want.outputs[0].text
        assert row["finish_reason"] == want.outputs[0].finish_reason
    bad = out[64]
    assert "202 tokens" in bad["error"] and "128" in bad["error"]
    assert bad["generated_text"] is None and bad["generated_token_ids"] is None


@pytest.mark.parametrize("batch_format", ["numpy", "pandas"])
def test_predictor_prompt_forms_and_bad_rows(ray_local, bart_dir, batch_format):
    """A batch as Ray Data hands it over (``take_batch``: a struct column of prompt
    dicts, a key one row lacks ``None`` there), through the predictor in this process:
    encoder/decoder pairs, token ids and per-row sampling params are served as
    ``LLM.generate`` serves them; the bad rows (an id outside the vocabulary, a
    prompt that is a number, a bad sampling value) each get their own error."""
    from tandem.integrations.ray.data import TandemPredictor

    good = [
        {"encoder_prompt": "the rain in spain", "decoder_prompt": "a cat"},
        {"prompt_token_ids": [5, 6, 7, 8]},
        {"prompt": "red blue green"},
        {"prompt": "the moon"},
    ]
    good_params = [{"max_tokens": 8}] * 3 + [{"max_tokens": 3}]
    rows = [{"id": i, "prompt": p, "params": q} for i, (p, q) in enumerate(zip(good, good_params))]
    rows += [{"id": 4, "prompt": {"prompt_token_ids": [5, 10**6]}, "params": {"max_tokens": 8}},
             {"id": 5, "prompt": {"prompt": "the sun"}, "params": {"max_tokens": -1}}]
    batch = ray_local.data.from_items(rows).take_batch(len(rows), batch_format=batch_format)
    out = TandemPredictor(str(bart_dir), sampling_params=PARAMS, sampling_params_column="params", **ENGINE)(batch)
    if batch_format == "pandas":  # pandas shows a missing value as NaN (a str column's, at least)
        out = {name: [None if _nan(v) else v for v in out[name]] for name in out.columns}
    assert list(out["id"]) == list(range(6))
    ref = LLM(str(bart_dir), **ENGINE).generate(
        good, [SamplingParams(**{**PARAMS, **q}) for q in good_params], use_tqdm=False)
    for i, want in enumerate(ref):
        assert out["error"][i] is None
        assert list(out["generated_token_ids"][i]) == want.outputs[0].token_ids
        assert out["generated_text"][i] == want.outputs[0].text
    assert len(out["generated_token_ids"][3]) == 3  # its own max_tokens, over the shared 8
    assert "1000000" in out["error"][4] and "vocabulary" in out["error"][4]
    assert "max_tokens" in out["error"][5] and "-1" in out["error"][5]
    for i in (4, 5):
        assert out["generated_text"][i] is None and out["generated_token_ids"][i] is None


def _nan(value) -> bool:
    return isinstance(value, float) and value != value


def test_predictor_rejects_a_prompt_that_is_no_prompt(bart_dir):
    """A number or a bare list of ids is that row's error (a list of ints would
    otherwise read as a list of prompts); the batch's other rows are served."""
    import numpy as np

    from tandem.integrations.ray.data import TandemPredictor

    batch = {"prompt": np.array([7, "the rain", None], dtype=object)}
    out = TandemPredictor(str(bart_dir), sampling_params=PARAMS, **ENGINE)(batch)
    assert "row 0" in out["error"][0] and "int: 7" in out["error"][0]
    assert out["error"][1] is None and len(out["generated_token_ids"][1]) == 8
    assert "NoneType" in out["error"][2]


def test_predictor_names_a_missing_column(bart_dir):
    import numpy as np

    from tandem.integrations.ray.data import TandemPredictor

    predictor = TandemPredictor(str(bart_dir), prompt_column="text", **ENGINE)
    with pytest.raises(KeyError, match=r"no column 'text' \(prompt_column\); its columns: \['prompt'\]"):
        predictor({"prompt": np.array(["the rain"], dtype=object)})
