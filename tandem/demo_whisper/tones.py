"""Tone speech: the audio the demo Whisper checkpoint in this folder was trained to transcribe.

Each of 20 words is a pair of sine tones (as a telephone's keys are) held for
about 0.2 s; a sentence is its words at a steady rate of one every 0.3 s, with
small random shifts and light noise. ``synthesize("three one four")`` makes 16 kHz samples offline;
``tools/train_demo_whisper.py`` trains the checkpoint on such audio.
"""

from __future__ import annotations

import wave
from pathlib import Path

import numpy as np

SAMPLE_RATE = 16000
SLOT = 0.3  # seconds from one word's start to the next

# word -> (low Hz, high Hz): 4 low x 5 high tones, far apart on the mel scale.
_LOW = (310.0, 450.0, 640.0, 900.0)
_HIGH = (1250.0, 1700.0, 2300.0, 3100.0, 4200.0)
WORDS = tuple("zero one two three four five six seven eight nine "
              "hello world yes no stop go up down left right".split())
TONES = {w: (_LOW[i % 4], _HIGH[i // 4]) for i, w in enumerate(WORDS)}


def unknown_words(words: list[str] | str) -> list[str]:
    """The words of ``words`` that are not in ``WORDS``, in order."""
    return [w for w in (words.split() if isinstance(words, str) else words) if w not in TONES]


def synthesize(words: list[str] | str, seed: int = 0, sr: int = SAMPLE_RATE, *, plan: bool = False):
    """Tone speech for ``words``: float32 mono samples at ``sr`` (and, with ``plan``,
    each word's (start, end) in seconds). The same ``seed`` gives the same audio.
    Raises ValueError naming the words outside ``WORDS``."""
    if isinstance(words, str):
        words = words.split()
    unknown = unknown_words(words)
    if unknown:
        raise ValueError(f"not in the demo vocabulary: {', '.join(unknown)} (known: {' '.join(WORDS)})")
    rng = np.random.default_rng(seed)
    spans = []
    audio = np.zeros(int((0.2 + SLOT * len(words)) * sr), np.float32)
    for k, w in enumerate(words):
        n = int(rng.uniform(0.18, 0.22) * sr)
        at = int((0.1 + SLOT * k + rng.uniform(-0.02, 0.02)) * sr + (SLOT * sr - n) / 2)
        t = np.arange(n) / sr
        lo, hi = (f * rng.uniform(0.98, 1.02) for f in TONES[w])
        x = rng.uniform(0.5, 1.0) * np.sin(2 * np.pi * lo * t) + rng.uniform(0.5, 1.0) * np.sin(2 * np.pi * hi * t)
        ramp = min(n // 2, int(0.01 * sr))
        env = np.ones(n)
        env[:ramp] = np.linspace(0, 1, ramp)
        env[n - ramp:] = np.linspace(1, 0, ramp)
        x *= env * rng.uniform(0.1, 0.25)
        audio[at: at + n] += x.astype(np.float32)
        spans.append((at / sr, (at + n) / sr))
    audio += rng.uniform(0.001, 0.01) * rng.standard_normal(audio.shape).astype(np.float32)
    audio = audio.astype(np.float32)
    return (audio, spans) if plan else audio


def write_wav(path: str | Path, audio: np.ndarray, sr: int = SAMPLE_RATE) -> Path:
    """Write mono float samples in [-1, 1] as a 16-bit PCM WAV file (standard library only)."""
    pcm = np.clip(np.round(np.asarray(audio, dtype=np.float64) * 32767.0), -32768, 32767).astype("<i2")
    with wave.open(str(path), "wb") as f:
        f.setnchannels(1)
        f.setsampwidth(2)
        f.setframerate(sr)
        f.writeframes(pcm.tobytes())
    return Path(path)
