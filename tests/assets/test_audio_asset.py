"""tandem.assets.audio.AudioAsset: vLLM's names and interface; the real recording from the
assets folder when it is there, else the demo Whisper's tone speech with one warning line."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from tandem.assets import audio as assets
from tandem.assets.audio import AudioAsset
from tandem.audio.io import load_audio
from tandem.demo_whisper import PATH as DEMO, SAMPLE_RATE, synthesize, write_wav


@pytest.fixture
def folder(tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_ASSETS_CACHE", str(tmp_path))
    monkeypatch.setattr(assets, "_warned", set())
    return tmp_path


@pytest.mark.parametrize("name, words, seed, shipped", [
    ("mary_had_lamb", "three one four one five nine", 0, "three_one_four.wav"),
    ("winning_call", "hello world", 1, "hello_world.wav"),
])
def test_stand_in_is_the_demos_tone_speech_with_one_warning(folder, caplog, name, words, seed, shipped):
    with caplog.at_level(logging.WARNING, logger="tandem.assets"):
        audio, sr = AudioAsset(name).audio_and_sample_rate
        path = AudioAsset(name).get_local_path()
        AudioAsset(name).audio_and_sample_rate
    assert sr == SAMPLE_RATE == 16000 and audio.dtype == np.float32
    np.testing.assert_array_equal(audio, synthesize(words, seed=seed))
    assert path == DEMO / shipped
    np.testing.assert_allclose(load_audio(path).numpy(), audio, atol=1e-4)  # the file is the same audio
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1, lines
    assert "stand-in" in lines[0] and str(folder / f"{name}.ogg") in lines[0] and words in lines[0]


def test_stand_in_without_a_shipped_clip_is_written_once(folder):
    asset = AudioAsset("azacinto_foscolo")
    path = asset.get_local_path()
    assert path.is_file() and path == asset.get_local_path()
    np.testing.assert_allclose(load_audio(path).numpy(), asset.audio_and_sample_rate[0], atol=1e-4)


def test_the_real_recording_is_read_from_the_assets_folder(folder, caplog):
    t = np.arange(SAMPLE_RATE) / SAMPLE_RATE
    tone = (0.3 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)
    write_wav(folder / "winning_call.wav", tone)
    with caplog.at_level(logging.WARNING, logger="tandem.assets"):
        audio, sr = AudioAsset("winning_call").audio_and_sample_rate
        path = AudioAsset("winning_call").get_local_path()
    assert sr == 16000 and path == folder / "winning_call.wav"
    np.testing.assert_allclose(audio, tone, atol=1e-4)
    assert not AudioAsset("winning_call").is_stand_in and AudioAsset("mary_had_lamb").is_stand_in
    assert caplog.records == []


def test_unknown_asset_is_refused_listing_the_names():
    with pytest.raises(ValueError, match=r"AudioAsset\('mary'\).*mary_had_lamb, winning_call"):
        AudioAsset("mary")
