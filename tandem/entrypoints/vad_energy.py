"""An energy voice-activity detector: a ``vad_filter`` callable for audio Silero does not
take for speech (the demo Whisper's tone speech), or where the ``vad`` extra is not
installed. numpy only.

A 32 ms frame (Silero's) counts as speech when its RMS level (dBFS) is at least
``QUIET_TO_LOUD`` of the way from the input's quiet level (its 10th-percentile
frame) to its loudest frame's, and at least ``floor_db``; the frames then become
regions by the same rules as Silero's probabilities (``vad.speech_regions_from_probs``
with ``VadOptions``: a short silence does not end a region, short regions are
dropped, each is padded). It knows loudness only: noise as loud as the speech is
speech to it, quiet speech under a loud noise is not, and an input with no pause at
all (no quiet tenth) loses its quieter half.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tandem.entrypoints.vad import FRAME_SAMPLES, SAMPLE_RATE, VadOptions, speech_regions_from_probs

# Between the quiet level and the loudest: below halfway, so a word 14 dB under the
# loudest still counts over a noise floor 28 dB under it (the demo's tone speech at its
# extremes), above noise that is a third of the way up.
QUIET_TO_LOUD = 0.4


class EnergyVad:
    """``EnergyVad()(waveform, sample_rate)`` -> speech regions ``[(start, end), ...]`` in
    samples, for ``LLM.transcribe(..., vad_filter=EnergyVad())`` and ``tandem transcribe
    --vad-filter --vad-method energy``. ``options``: ``VadOptions`` (or a dict of its
    fields; ``threshold`` is unused, a frame is speech or not) over the batched
    pipeline's defaults."""

    def __init__(self, options: VadOptions | dict | None = None, *, floor_db: float = -60.0) -> None:
        if not isinstance(options, VadOptions):
            options = VadOptions.from_dict(options)
        if isinstance(floor_db, bool) or not isinstance(floor_db, (int, float)) or not np.isfinite(floor_db):
            raise ValueError(f"EnergyVad floor_db={floor_db!r}: must be a finite level in dBFS")
        self.options, self.floor_db = options, float(floor_db)

    def levels(self, waveform: Any, sample_rate: int = SAMPLE_RATE) -> np.ndarray:
        """Each frame's RMS level in dBFS (frames of 32 ms at ``sample_rate``, the last zero-padded)."""
        audio = np.asarray(waveform, dtype=np.float64)
        if audio.ndim != 1:
            raise ValueError(f"the VAD takes a 1-D waveform, got shape {tuple(audio.shape)}")
        if not np.isfinite(audio).all():
            raise ValueError(f"the VAD's waveform has {int((~np.isfinite(audio)).sum())} NaN or infinite samples")
        frame = max(1, round(FRAME_SAMPLES * sample_rate / SAMPLE_RATE))
        n_frames = -(-audio.size // frame)
        padded = np.zeros(n_frames * frame)
        padded[: audio.size] = audio
        rms = np.sqrt(np.mean(padded.reshape(n_frames, frame) ** 2, axis=1))
        return 20 * np.log10(np.maximum(rms, 1e-10))

    def __call__(self, waveform: Any, sample_rate: int = SAMPLE_RATE) -> list[tuple[int, int]]:
        levels = self.levels(waveform, sample_rate)
        if levels.size == 0:
            return []
        quiet, loud = np.percentile(levels, 10), levels.max()
        speech = levels >= max(self.floor_db, quiet + QUIET_TO_LOUD * (loud - quiet))
        # The region rules count in 16 kHz samples of 512-sample frames: convert back after.
        num = np.asarray(waveform).size
        at_16k = round(num * SAMPLE_RATE / sample_rate)
        regions = speech_regions_from_probs(speech.astype(np.float64), at_16k, self.options)
        scale = sample_rate / SAMPLE_RATE
        return [(min(num, round(s * scale)), min(num, round(e * scale))) for s, e in regions]
