"""First run of the ``tandem`` command: the audio extra named before a model loads."""

import json
import subprocess
import sys

import pytest

from helpers import make_whisper, synth_audio

# Runs the CLI with the named modules made unimportable (a None entry in sys.modules
# makes ``import name`` raise ImportError), as on an install without the extra.
_WITHOUT = "import sys\nfor m in sys.argv[1].split(','):\n    if m: sys.modules[m] = None\n" \
           "from tandem.entrypoints.cli import main\nsys.exit(main(sys.argv[2:]))\n"


def _tandem_without(modules: list[str], *args):
    return subprocess.run([sys.executable, "-c", _WITHOUT, ",".join(modules), *args], capture_output=True, text=True)


@pytest.fixture(scope="module")
def whisper_and_wav(tmp_path_factory):
    import soundfile

    root = tmp_path_factory.mktemp("first_run")
    wav = root / "clip.wav"
    soundfile.write(wav, synth_audio(1.0), 16000)
    return make_whisper(root / "ckpt"), wav


# soundfile alone and both in the default run; soxr alone (the same check) is slow.
@pytest.mark.parametrize("missing", [["soundfile"], pytest.param(["soxr"], marks=pytest.mark.slow),
                                     ["soundfile", "soxr"]])
def test_transcribe_names_the_audio_extra_before_loading_the_model(whisper_and_wav, missing):
    model, wav = whisper_and_wav
    res = _tandem_without(missing, "transcribe", str(model), str(wav), "--dtype", "float32", "--no-progress")
    assert res.returncode == 2, res.stdout + res.stderr
    assert "engine ready" not in res.stderr and res.stdout == ""  # nothing loaded, no per-file errors
    (line,) = res.stderr.strip().splitlines()
    assert line.startswith("tandem transcribe: error: transcribing files needs the audio extra: "
                           "pip install 'tandem-engine[audio]' (missing: ")
    assert line.endswith(f"(missing: {', '.join(missing)})")


@pytest.mark.slow  # the transcribe command with the extra runs in the default run in test_whisper.py
def test_transcribe_with_the_extra_runs(whisper_and_wav):
    model, wav = whisper_and_wav
    res = _tandem_without([], "transcribe", str(model), str(wav), "--dtype", "float32", "--no-progress")
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith(f"{wav}\t")


def test_an_over_long_prompt_gets_tandems_error_without_transformers_warning(capfd, caplog):
    from tandem import LLM, SamplingParams
    from tandem.entrypoints.cli import DEMO_MODEL

    long = "the cat " * 100  # 200 words: over the demo tokenizer's model_max_length (64) and the model's positions
    res = subprocess.run([sys.executable, "-m", "tandem.entrypoints.cli", "generate", "--model", str(DEMO_MODEL),
                          "--dtype", "float32", "--json", long], capture_output=True, text=True)
    assert res.returncode == 1
    assert "encoder prompt has 202 tokens" in json.loads(res.stdout)["error"]
    assert "Token indices sequence length" not in res.stderr and "indexing errors" not in res.stderr, res.stderr
    # In a program too, where transformers logs through its own logger.
    llm = LLM(model=str(DEMO_MODEL), dtype="float32", device="cpu", num_kv_blocks=16)
    out = llm.generate([long], SamplingParams(max_tokens=2), use_tqdm=False)[0]
    assert "encoder prompt has 202 tokens" in out.error
    logged = capfd.readouterr().err + caplog.text
    assert "Token indices sequence length" not in logged
