"""``lora_column``: a Ray Data column names each row's LoRA adapter. The predictor is
called in this process on a batch as Ray Data hands it over (a dict of numpy columns,
or pandas), so no Ray start-up; what reached the worker (each ``ScheduledGroup``'s
``lora_request``) is read through a spy on the executor, and the outputs equal
``LLM.generate`` with the same adapters."""

import numpy as np
import pytest

from lora_adapters import make_peft_adapter
from tandem import LLM, LoRARequest, SamplingParams

ENGINE = dict(dtype="float32", device="cpu", attention_backend="torch_sdpa", enable_lora=True, max_loras=2)
PARAMS = {"temperature": 0.0, "max_tokens": 5}


@pytest.fixture(scope="module")
def adapters(bart_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("ray_lora")
    return {name: str(make_peft_adapter(bart_dir, root / name, seed=i)) for i, name in enumerate(("x", "y"), 1)}


def spy(llm) -> dict:
    seen = {}
    real = llm.llm_engine.executor.execute_model

    def execute_model(out, *args, **kwargs):
        for sg in out.scheduled:
            seen[sg.request_id] = sg.lora_request
        return real(out, *args, **kwargs)

    llm.llm_engine.executor.execute_model = execute_model
    return seen


@pytest.mark.parametrize("batch_format", ["numpy", "pandas"])
def test_the_column_picks_each_rows_adapter(bart_dir, adapters, batch_format):
    from tandem.integrations.ray.data import TandemPredictor

    prompts = ["the rain", "a cat sat", "red blue", "the moon", "green"]
    names = ["x", None, "y", "x", "nope"]
    batch = {"prompt": np.array(prompts, dtype=object), "adapter": np.array(names, dtype=object)}
    if batch_format == "pandas":
        pd = pytest.importorskip("pandas")  # Ray Data's pandas batches: pandas comes with the ray extra

        batch = pd.DataFrame(batch)
    predictor = TandemPredictor(str(bart_dir), sampling_params=PARAMS, lora_column="adapter",
                                lora_modules=adapters, **ENGINE)
    seen = spy(predictor.llm)
    out = predictor(batch)
    errors = [None if isinstance(e, float) else e for e in out["error"]]  # pandas shows None as NaN
    assert errors[:4] == [None] * 4
    assert "'nope'" in errors[4] and "lora_modules" in errors[4] and "row 4" in errors[4]
    assert {getattr(r, "lora_name", None) for r in seen.values()} == {None, "x", "y"}
    assert sorted(r.lora_int_id for r in seen.values() if r is not None) == [1, 1, 2]  # one id per adapter
    llm = LLM(str(bart_dir), **ENGINE)
    loras = [None if n is None else LoRARequest(n, i, adapters[n]) for n, i in zip(names[:4], (1, 0, 2, 1))]
    ref = llm.generate(prompts[:4], SamplingParams(**PARAMS), lora_request=loras, use_tqdm=False)
    assert [list(t) for t in out["generated_token_ids"][:4]] == [r.outputs[0].token_ids for r in ref]


def test_a_path_in_the_column_without_modules(bart_dir, adapters):
    from tandem.integrations.ray.data import TandemPredictor

    predictor = TandemPredictor(str(bart_dir), sampling_params=PARAMS, lora_column="adapter", **ENGINE)
    seen = spy(predictor.llm)
    out = predictor({"prompt": np.array(["a", "b"], dtype=object),
                     "adapter": np.array([adapters["y"], ""], dtype=object)})
    assert list(out["error"]) == [None, None]
    assert {getattr(r, "lora_path", None) for r in seen.values()} == {adapters["y"], None}


def test_bad_options_are_refused_at_construction(bart_dir, adapters):
    from tandem.integrations.ray.data import TandemPredictor

    with pytest.raises(ValueError, match="needs enable_lora=True"):
        TandemPredictor(str(bart_dir), lora_column="adapter", dtype="float32")
    with pytest.raises(ValueError, match="lora_modules without lora_column"):
        TandemPredictor(str(bart_dir), lora_modules=adapters, **ENGINE)


def test_the_transcriber_takes_the_column_too(tmp_path):
    from tandem.demo_whisper import PATH as WHISPER
    from tandem.integrations.ray.data_audio import TandemTranscriber

    adapter = str(make_peft_adapter(WHISPER, tmp_path / "accent", seed=4))
    wav = (WHISPER / "hello_world.wav").read_bytes()
    transcriber = TandemTranscriber(str(WHISPER), audio_column="bytes", lora_column="adapter",
                                    lora_modules={"accent": adapter}, dtype="float32", device="cpu",
                                    enable_lora=True, transcribe_options={"language": "en"})
    seen = spy(transcriber.llm)
    out = transcriber({"bytes": np.array([wav, wav, wav], dtype=object),
                       "adapter": np.array(["accent", None, "other"], dtype=object)})
    assert list(out["error"][:2]) == [None, None] and "'other'" in out["error"][2]
    assert {getattr(r, "lora_name", None) for r in seen.values()} == {"accent", None}
