"""VAD-batched long-form: speech regions become chunks decoded in parallel.

faster-whisper's ``BatchedInferencePipeline``, on the engine's scheduler: a voice
activity detector finds each input's speech regions (``tandem.entrypoints.vad``, or
a callable the caller gives); consecutive regions are joined, silence between
them dropped, into chunks of at most the model's window (30 s for Whisper,
faster-whisper's ``collect_chunks``); every chunk is one input of its own to the
model's transcription session, and all of them go to the engine at once. Each
chunk's transcript comes back in the chunk's own time (its speech only, from
0) and is mapped back to the input's: a time inside the chunk's k-th region is
that region's start plus the time since the region began in the chunk
(faster-whisper's ``SpeechTimestampsMap``; a time on the boundary of two
regions is the end of the first when it is an end, the start of the next
otherwise).

With ``language=None`` on a checkpoint of several languages the first chunk
is decoded first and its detected language is given to the others (detected
once per input, over its first 30 s of speech, as faster-whisper does).
"""

from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass
from typing import Any, Callable

import torch

from tandem.core.transcription import Transcription

logger = logging.getLogger("tandem.transcribe")

#: A caller's own detector: ``(waveform [n] float32 numpy, sample_rate) -> [(start, end), ...]``
#: speech regions in samples, ``end`` exclusive, in order, not overlapping.
Detector = Callable[[Any, int], Any]


@dataclass(frozen=True)
class Chunk:
    """Consecutive speech regions of one input, decoded as one input: ``waveform`` is
    their samples back to back; ``regions`` their ``(start, end)`` in the input (samples)."""

    waveform: torch.Tensor
    regions: tuple[tuple[int, int], ...]
    sample_rate: int

    def span(self) -> tuple[float, float]:
        """Its first region's start and last region's end, seconds in the input."""
        return self.regions[0][0] / self.sample_rate, self.regions[-1][1] / self.sample_rate

    def to_input_time(self, t: float, end: bool = False, region: int | None = None) -> float:
        """A time of the chunk's transcript (seconds from the chunk's start) in the input's
        time; ``end``: a time on a boundary between regions belongs to the earlier one;
        ``region``: the region to map through (default: the one ``t`` falls in)."""
        starts = self._starts()
        if region is None:
            region = self._region(starts, t, end)
        return (self.regions[region][0] + t * self.sample_rate - starts[region]) / self.sample_rate

    def region_of(self, t: float) -> int:
        """The region a time of the chunk falls in (the last one past the end)."""
        return self._region(self._starts(), t, end=False)

    def _starts(self) -> list[int]:
        starts = [0]  # where each region begins in the chunk (samples)
        for s, e in self.regions[:-1]:
            starts.append(starts[-1] + e - s)
        return starts

    def _region(self, starts: list[int], t: float, end: bool) -> int:
        x = round(t * self.sample_rate)  # whole samples: a boundary given in seconds lands on it exactly
        i = bisect.bisect_left(starts, x) - 1 if end else bisect.bisect_right(starts, x) - 1
        return min(max(i, 0), len(self.regions) - 1)


def check_regions(regions: Any, num_samples: int) -> list[tuple[int, int]]:
    """A detector's regions as ``[(start, end), ...]``, or ``ValueError`` naming the bad one:
    integers, ``0 <= start < end <= num_samples``, in order, not overlapping."""
    try:
        pairs = [(r["start"], r["end"]) if isinstance(r, dict) else tuple(r) for r in regions]
    except (TypeError, KeyError) as e:
        raise ValueError(f"the VAD's speech regions must be (start, end) sample pairs, got {regions!r}") from e
    out: list[tuple[int, int]] = []
    for pair in pairs:
        if len(pair) != 2 or not all(isinstance(v, int) and not isinstance(v, bool) for v in pair):
            raise ValueError(f"the VAD's speech region {pair!r}: must be two integer sample indices (start, end)")
        s, e = pair
        if not 0 <= s < e <= num_samples:
            raise ValueError(f"the VAD's speech region ({s}, {e}): needs 0 <= start < end <= {num_samples} "
                             "(the waveform's samples)")
        if out and s < out[-1][1]:
            raise ValueError(f"the VAD's speech region ({s}, {e}) starts before the previous one ends "
                             f"({out[-1][1]}): regions must be in order, not overlapping")
        out.append((s, e))
    return out


def collect_chunks(waveform: torch.Tensor, regions: list[tuple[int, int]], max_samples: int,
                   sample_rate: int) -> list[Chunk]:
    """Regions joined in order into chunks of at most ``max_samples`` speech samples
    (faster-whisper's ``collect_chunks``); a region longer than that alone is a chunk of
    its own (the session decodes it window by window)."""
    chunks: list[Chunk] = []
    group: list[tuple[int, int]] = []
    size = 0
    for s, e in regions:
        if group and size + (e - s) > max_samples:
            chunks.append(_chunk(waveform, group, sample_rate))
            group, size = [], 0
        group.append((s, e))
        size += e - s
    if group:
        chunks.append(_chunk(waveform, group, sample_rate))
    return chunks


def _chunk(waveform: torch.Tensor, group: list[tuple[int, int]], sample_rate: int) -> Chunk:
    wave = torch.cat([waveform[s:e] for s, e in group]) if len(group) > 1 else waveform[group[0][0]:group[0][1]]
    return Chunk(wave.contiguous(), tuple(group), sample_rate)


class VadPlan:
    """One call's VAD: how each input is cut into chunks. :meth:`create` checks the options
    (``None`` when ``vad_filter`` is off)."""

    def __init__(self, detect: Callable[[Any], Any], sample_rate: int, window_seconds: float) -> None:
        self.detect, self.sample_rate = detect, sample_rate
        self.max_samples = int(round(window_seconds * sample_rate))

    @classmethod
    def create(cls, vad_filter: Any, vad_parameters: Any, sample_rate: int, window_seconds: float) -> "VadPlan | None":
        if vad_filter is False or vad_filter is None:
            if vad_parameters is not None:
                raise ValueError("vad_parameters without vad_filter=True: give vad_filter=True to use them")
            return None
        if callable(vad_filter):
            if vad_parameters is not None:
                raise ValueError("vad_parameters are the built-in Silero VAD's: with a callable vad_filter (your own "
                                 "detector) give none")
            return cls(lambda wave: vad_filter(wave, sample_rate), sample_rate, window_seconds)
        if vad_filter is not True:
            raise TypeError(f"vad_filter={vad_filter!r}: must be True, False or a callable (waveform, sample_rate) -> "
                            "speech regions")
        from tandem.entrypoints.vad import SAMPLE_RATE, SileroVad, VadOptions

        options = VadOptions.from_dict(vad_parameters, max_speech_duration_s=window_seconds)
        if sample_rate != SAMPLE_RATE:
            raise ValueError(f"vad_filter=True: Silero VAD takes {SAMPLE_RATE} Hz waveforms and this model's are "
                             f"{sample_rate} Hz")
        vad = SileroVad()
        return cls(lambda wave: vad(wave, options), sample_rate, window_seconds)

    def chunks(self, waveform: torch.Tensor, what: str = "the audio") -> list[Chunk]:
        """The input's chunks (none when it has no speech, with a warning naming ``what``:
        its transcript is then empty); ``ValueError`` names what failed."""
        wave = waveform.detach().to(torch.float32).cpu().reshape(-1)
        regions = check_regions(self.detect(wave.numpy()), wave.numel())
        chunks = collect_chunks(wave, regions, self.max_samples, self.sample_rate)
        if not chunks:
            logger.warning("vad_filter found no speech in %s (%.1f s): its transcript is empty; lower the VAD's "
                           "threshold (vad_parameters) or transcribe without vad_filter to decode it all", what,
                           wave.numel() / self.sample_rate)
        return chunks


def merge(chunks: list[Chunk], results: list[Transcription], *, timestamps: bool, word_timestamps: bool,
          language: str | None) -> Transcription:
    """One input's transcript from its chunks' (in order), times in the input's time.
    ``language``: the input's when it has no chunks (no speech)."""
    for k, (chunk, r) in enumerate(zip(chunks, results)):
        if r.error is not None:
            a, b = chunk.span()
            return Transcription(error=f"speech chunk {k} ({a:.2f}-{b:.2f} s): {r.error}")
    pairs = list(zip(chunks, results))
    return Transcription(
        text=" ".join(r.text for r in results if r.text),
        token_ids=[t for r in results for t in r.token_ids],
        language=results[0].language if results else language,
        segments=[_segment(c, s) for c, r in pairs for s in r.segments or ()] if timestamps else None,
        words=[_word(c, w) for c, r in pairs for w in r.words or ()] if word_timestamps else None,
        windows=sum(r.windows for r in results),
    )


def chunk_segments(chunk: Chunk, result: Transcription) -> list[dict]:
    """A finished chunk's segments in the input's time (its timestamped segments, or one
    segment spanning the chunk): what a stream sends as the chunk's delta."""
    if result.segments is not None:
        return [_segment(chunk, s) for s in result.segments]
    a, b = chunk.span()
    return [{"start": round(a, 3), "end": round(b, 3), "text": result.text, "token_ids": list(result.token_ids)}]


def _segment(chunk: Chunk, seg: dict) -> dict:
    out = dict(seg)
    out["start"] = round(chunk.to_input_time(seg["start"]), 3)
    out["end"] = round(chunk.to_input_time(seg["end"], end=True), 3)
    if "token_timestamps" in seg:
        out["token_timestamps"] = [round(chunk.to_input_time(t, end=True), 3) for t in seg["token_timestamps"]]
    if seg.get("words") is not None:
        out["words"] = [_word(chunk, w) for w in seg["words"]]
    return out


def _word(chunk: Chunk, word: dict) -> dict:
    # Both ends through the region the word's middle is in, as faster-whisper does.
    region = chunk.region_of((word["start"] + word["end"]) / 2)
    return {**word, "start": round(chunk.to_input_time(word["start"], region=region), 3),
            "end": round(chunk.to_input_time(word["end"], region=region), 3)}
