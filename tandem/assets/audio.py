"""``AudioAsset``: vLLM's audio assets by vLLM's names, with vLLM's interface.

vLLM downloads its clips (``mary_had_lamb.ogg``, ``winning_call.ogg``, ...) on first use;
tandem reaches no network. An asset is read from the assets folder when its recording is
there (``$TANDEM_ASSETS_CACHE``, default ``~/.cache/tandem/assets``: copy vLLM's file in
under the same name, or point the variable at vLLM's own cache,
``~/.cache/vllm/assets/vllm_public_assets``). Otherwise it is a stand-in: a few seconds of
the demo Whisper's tone speech (``tandem.demo_whisper``), which that checkpoint transcribes,
and one warning line per asset says so and where the recording would go.
"""

from __future__ import annotations

import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

logger = logging.getLogger("tandem.assets")

ENV_VAR = "TANDEM_ASSETS_CACHE"
EXTENSIONS = (".ogg", ".wav", ".flac", ".mp3")  # vLLM's files are .ogg; any of these is read

# name -> (the stand-in's words, its synthesis seed, the demo Whisper's clip of exactly that, if shipped)
STAND_INS: dict[str, tuple[str, int, str | None]] = {
    "mary_had_lamb": ("three one four one five nine", 0, "three_one_four.wav"),
    "winning_call": ("hello world", 1, "hello_world.wav"),
    "azacinto_foscolo": ("yes no stop go", 2, None),
}
_warned: set[str] = set()


def assets_dir() -> Path:
    """Where real recordings are looked for: ``$TANDEM_ASSETS_CACHE`` or ``~/.cache/tandem/assets``."""
    return Path(os.environ.get(ENV_VAR) or Path.home() / ".cache" / "tandem" / "assets").expanduser()


@dataclass(frozen=True)
class AudioAsset:
    """One of vLLM's example clips by name: ``AudioAsset("mary_had_lamb").audio_and_sample_rate``
    (float32 mono samples and their rate) or ``.get_local_path()`` (an audio file)."""

    name: str

    def __post_init__(self) -> None:
        if self.name not in STAND_INS:
            raise ValueError(f"AudioAsset({self.name!r}): unknown asset; known: {', '.join(STAND_INS)}")

    @property
    def filename(self) -> str:
        """vLLM's file name for the recording."""
        return f"{self.name}.ogg"

    @property
    def recording(self) -> Path | None:
        """The real recording in the assets folder, if it is there."""
        folder = assets_dir()
        for ext in EXTENSIONS:
            path = folder / f"{self.name}{ext}"
            if path.is_file():
                return path
        return None

    @property
    def is_stand_in(self) -> bool:
        return self.recording is None

    @property
    def audio_and_sample_rate(self) -> tuple[np.ndarray, int]:
        """``(samples, sampling_rate)``: the recording at 16 kHz, or the stand-in's tone speech."""
        path = self.recording
        if path is not None:
            from tandem.audio.io import load_audio

            return load_audio(path).numpy(), 16000
        from tandem.demo_whisper import SAMPLE_RATE, synthesize

        words, seed, _ = STAND_INS[self.name]
        self._warn()
        return synthesize(words, seed=seed), SAMPLE_RATE

    def get_local_path(self) -> Path:
        """An audio file of this asset: the recording, or the stand-in as a 16 kHz WAV file
        (the demo Whisper's own clip where it ships one, else written once to a temporary folder)."""
        path = self.recording
        if path is not None:
            return path
        from tandem.demo_whisper import PATH, synthesize, write_wav

        words, seed, shipped = STAND_INS[self.name]
        self._warn()
        if shipped is not None:
            return PATH / shipped
        out = Path(tempfile.gettempdir()) / "tandem-assets" / f"{self.name}-stand-in.wav"
        if not out.is_file():
            out.parent.mkdir(parents=True, exist_ok=True)
            tmp = out.with_suffix(f".{os.getpid()}.tmp")
            write_wav(tmp, synthesize(words, seed=seed))
            os.replace(tmp, out)  # whole or absent, for a concurrent reader
        return out

    def _warn(self) -> None:
        if self.name in _warned:
            return
        _warned.add(self.name)
        words = STAND_INS[self.name][0]
        logger.warning(
            "AudioAsset(%r): no recording at %s, so a stand-in is used: tone speech of %r (what the demo Whisper "
            "transcribes); put vLLM's %s there (or set $%s to its folder) for the real recording",
            self.name, assets_dir() / self.filename, words, self.filename, ENV_VAR,
        )
