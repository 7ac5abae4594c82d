"""HF's Whisper timestamp rules and segment logic, on tandem's per-request processors."""

from __future__ import annotations

import torch

from tandem.model_zoo.whisper.constants import FRAME_SECONDS, INPUT_STRIDE, TIME_PRECISION
from tandem.model_zoo.whisper.prompts import WhisperPrompts


class TimestampRules:
    """HF's ``WhisperTimeStampLogitsProcessor`` as a per-request logits processor
    (tandem's three-argument signature; ``prompt_ids`` is the window's decoder
    prompt, so HF's ``begin_index`` is its length): timestamps come in pairs except
    before EOS, never decrease, the first token is a timestamp at most
    ``max_initial_timestamp_index`` steps in, and a timestamp is forced when the
    timestamps' total probability beats every text token's."""

    def __init__(self, prompts: WhisperPrompts) -> None:
        self.no_timestamps = prompts.no_timestamps
        self.tb = prompts.timestamp_begin
        self.eos = prompts.eos
        self.max_initial = prompts.max_initial_timestamp_index

    def __call__(self, prompt_ids: list[int], output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        tb, inf = self.tb, -float("inf")
        logits[self.no_timestamps] = inf
        seq = output_ids
        last_ts = len(seq) >= 1 and seq[-1] >= tb
        penultimate_ts = len(seq) < 2 or seq[-2] >= tb
        if last_ts:
            if penultimate_ts:
                logits[tb:] = inf
            else:
                logits[: self.eos] = inf
        stamps = [t for t in seq if t >= tb]
        if stamps:
            last = stamps[-1] if (last_ts and not penultimate_ts) else stamps[-1] + 1
            logits[tb:last] = inf
        if not seq:
            logits[:tb] = inf
            if self.max_initial is not None:
                logits[tb + self.max_initial + 1:] = inf
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        if logprobs[tb:].logsumexp(dim=-1) > logprobs[:tb].max():
            logits[:tb] = inf
        return logits


def retrieve_segments(
    tokens: list[int], tb: int, time_offset: float, seek_num_frames: int
) -> tuple[list[dict], int]:
    """HF's ``_retrieve_segment`` for one window's generated tokens (trailing EOS
    removed): its timestamp segments and how many frames the input seeks forward."""
    is_ts = [t >= tb for t in tokens]
    single_ending = is_ts[-2:] == [False, True]
    cuts = [i + 1 for i in range(len(is_ts) - 1) if is_ts[i] and is_ts[i + 1]]
    if cuts:
        segments = []
        if single_ending:
            cuts.append(len(tokens))
        else:
            cuts[-1] += 1
        last = 0
        for k, cut in enumerate(cuts):
            piece = tokens[last:cut]
            end_at = -1 if (k < len(cuts) - 1 or single_ending) else -2
            segments.append({
                "start": time_offset + (piece[0] - tb) * TIME_PRECISION,
                "end": time_offset + (piece[end_at] - tb) * TIME_PRECISION,
                "tokens": piece,
            })
            last = cut
        if single_ending:
            offset = seek_num_frames
        else:
            offset = (tokens[last - 2] - tb) * INPUT_STRIDE
        return segments, offset
    stamps = [i for i, t in enumerate(is_ts) if t]
    end = seek_num_frames * FRAME_SECONDS
    if stamps and tokens[stamps[-1]] != tb:
        end = (tokens[stamps[-1]] - tb) * TIME_PRECISION
    return [{"start": time_offset, "end": time_offset + end, "tokens": list(tokens)}], seek_num_frames
