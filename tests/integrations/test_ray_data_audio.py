"""``TandemTranscriber`` over batches as Ray Data hands them over: the shipped demo
Whisper's samples, as file bytes and as sample arrays, transcribe to their known
text as ``LLM.transcribe`` does, and an undecodable row carries its own error."""

import json

import numpy as np
import pytest

pytest.importorskip("ray")
pytest.importorskip("soundfile")

from tandem import LLM  # noqa: E402
from tandem.demo_whisper import PATH  # noqa: E402

SAMPLES = json.loads((PATH / "demo_samples.json").read_text())
ENGINE = dict(dtype="float32", device="cpu", attention_backend="torch_sdpa")


def test_transcriber_bytes_and_samples(ray_local):
    import soundfile

    from tandem.integrations.ray.data_audio import TandemTranscriber

    files = [PATH / s["file"] for s in SAMPLES]
    ref = LLM(str(PATH), **ENGINE).transcribe([str(f) for f in files], timestamps=True, use_tqdm=False)
    transcriber = TandemTranscriber(str(PATH), transcribe_options={"timestamps": True}, sampling_rate_column="sr",
                                    **ENGINE)

    # An encoded file's rate is its header's: the column's value is not used for bytes.
    rows = [{"id": i, "audio": f.read_bytes(), "sr": 1} for i, f in enumerate(files)]
    rows.append({"id": 9, "audio": b"not audio", "sr": 1})
    batch = ray_local.data.from_items(rows).take_batch(len(rows))
    out = transcriber(batch)
    assert list(out["id"]) == [0, 1, 9]
    for i, (sample, want) in enumerate(zip(SAMPLES, ref)):
        assert out["error"][i] is None
        assert out["text"][i] == want.text == sample["expected"]  # the demo's own transcript
        assert out["language"][i] == "en"
        assert [s["text"] for s in out["segments"][i]] == [s["text"] for s in want.segments]
    assert out["text"][2] is None and out["error"][2]

    decoded = [soundfile.read(str(f), dtype="float32") for f in files]
    rows = [{"id": i, "audio": x, "sr": rate} for i, (x, rate) in enumerate(decoded)]
    batch = ray_local.data.from_items(rows).take_batch(len(rows))
    out = transcriber(batch)
    assert [out["error"][i] for i in range(2)] == [None, None]
    assert list(out["text"]) == [s["expected"] for s in SAMPLES]


def test_transcriber_samples_need_a_rate(ray_local):
    from tandem.integrations.ray.data_audio import TandemTranscriber

    transcriber = TandemTranscriber(str(PATH), **ENGINE)
    out = transcriber({"audio": np.array([np.zeros(1600, dtype=np.float32), 3], dtype=object)})
    assert "row 0" in out["error"][0] and "sampling_rate" in out["error"][0]
    assert "row 1" in out["error"][1] and "int: 3" in out["error"][1]
    with pytest.raises(ValueError, match=r"transcribe_options\['audio'\]"):
        TandemTranscriber(str(PATH), transcribe_options={"audio": "x"}, **ENGINE)
