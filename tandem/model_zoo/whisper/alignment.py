"""Token timestamps from cross-attention: HF's ``return_token_timestamps``.

The cross-attention probabilities of the checkpoint's ``alignment_heads``
(``[heads, tokens, 1500]``, one row per decoder query) are cut to the input's
audio frames, normalized over the tokens (zero mean, unit population std),
median-filtered along time (``median_filter_width``), averaged over the heads,
and aligned to time by dynamic time warping on the negated matrix. Each token's
time is where the warping path first reaches its row, in 20 ms steps, as
transformers' ``WhisperGenerationMixin._extract_token_timestamps``.

The warping runs over anti-diagonals (every cell of one depends only on the two
before), with the same float32 costs and tie rules as HF's cell-by-cell loop,
so the path is the same.
"""

from __future__ import annotations

import numpy as np
import torch

TIME_PRECISION = 0.02  # seconds per encoder position


def median_filter(x: torch.Tensor, width: int) -> torch.Tensor:
    """Median over a sliding window of odd ``width`` along the last dimension, the
    edges reflected (unchanged when the dimension is too short to reflect)."""
    if width <= 0 or width % 2 != 1:
        raise ValueError(f"median_filter_width={width}: must be a positive odd number")
    half = width // 2
    if x.shape[-1] <= half:
        return x
    padded = torch.nn.functional.pad(x, (half, half), mode="reflect")
    return padded.unfold(-1, width, 1).sort(dim=-1).values[..., half]


def dtw(cost_matrix: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The warping path ``(text_indices, time_indices)`` through ``cost_matrix``
    ``[tokens, frames]`` (float64), minimising the summed cost; steps are diagonal,
    down (next token) or right (next frame), ties going right, then down."""
    rows, cols = cost_matrix.shape
    cost = np.full((rows + 1, cols + 1), np.inf, dtype=np.float32)
    trace = np.full((rows + 1, cols + 1), -1, dtype=np.int8)
    cost[0, 0] = 0
    for k in range(2, rows + cols + 1):  # the cells with i + j == k
        i = np.arange(max(1, k - cols), min(rows, k - 1) + 1)
        j = k - i
        diag, down, right = cost[i - 1, j - 1], cost[i - 1, j], cost[i, j - 1]
        step = np.where((diag < down) & (diag < right), 0, np.where((down < diag) & (down < right), 1, 2))
        best = np.choose(step, (diag, down, right))
        cost[i, j] = cost_matrix[i - 1, j - 1] + best.astype(np.float64)  # stored as float32, as HF's
        trace[i, j] = step
    trace[0, :] = 2
    trace[:, 0] = 1
    i, j = rows, cols
    text, time = [], []
    while i > 0 or j > 0:
        text.append(i - 1)
        time.append(j - 1)
        t = trace[i, j]
        if t == 0:
            i, j = i - 1, j - 1
        elif t == 1:
            i -= 1
        else:
            j -= 1
    return np.array(text[::-1]), np.array(time[::-1])


def token_timestamps(weights: torch.Tensor, num_prompt: int, num_generated: int, *,
                     median_filter_width: int, num_frames: int | None) -> list[float]:
    """Seconds from the window's start for each of the ``num_prompt + num_generated``
    decoder tokens, as HF: 0 for the prompt, then the time where the path enters the
    row of the query that *reads* each generated token (the last generated token,
    never read, repeats the one before).

    ``weights``: ``[heads, num_generated - 1, 1500]``, the alignment heads'
    cross-attention probabilities of the queries at the generated tokens but the last
    (heads in ``alignment_heads`` order). ``num_frames``: the input's log-mel frames
    from the window's start (HF's attention-mask length); the attention is cut to
    ``num_frames // 2`` positions (None: all)."""
    out = [0.0] * (num_prompt + num_generated)
    if weights.shape[1] == 0:
        return out
    if num_frames is not None:
        # HF cuts twice (once for the batch, once per item): the same cut when the window
        # starts inside the audio; a window past the audio's end (short audio is padded to
        # 30 s) has num_frames < 0, and HF's second cut leaves no positions at all, so
        # every token lands one step before the window. Mirrored to stay equal to HF.
        weights = weights[..., : num_frames // 2][..., : num_frames // 2]
    if weights.shape[-1]:
        std = torch.std(weights, dim=-2, keepdim=True, correction=0)
        mean = torch.mean(weights, dim=-2, keepdim=True)
        weights = median_filter((weights - mean) / std, median_filter_width)
    weights = weights.mean(dim=0)
    text, time = dtw(-weights.cpu().double().numpy())
    jumps = np.diff(text, prepend=-1).astype(bool)  # the first cell of each row
    times = (time[jumps] * TIME_PRECISION).tolist()
    out[num_prompt : num_prompt + len(times)] = times
    out[num_prompt + len(times) :] = [times[-1]] * (num_generated - len(times))
    return out


def alignment_heads(generation_config, hf_config) -> list[tuple[int, int]]:
    """The checkpoint's ``generation_config.alignment_heads`` as ``(layer, head)`` pairs,
    checked against the decoder's size."""
    heads = getattr(generation_config, "alignment_heads", None) if generation_config is not None else None
    if not heads:
        raise ValueError(
            "word_timestamps=True: the generation config has no alignment_heads (the [layer, head] pairs of decoder "
            "cross-attention that follow the audio; openai's checkpoints list them in generation_config.json)"
        )
    layers, per_layer = int(hf_config.decoder_layers), int(hf_config.decoder_attention_heads)
    pairs = []
    for pair in heads:
        if (not isinstance(pair, (list, tuple)) or len(pair) != 2
                or not all(isinstance(x, int) and not isinstance(x, bool) for x in pair)
                or not (0 <= pair[0] < layers and 0 <= pair[1] < per_layer)):
            raise ValueError(f"generation_config.alignment_heads: {pair!r} is not a [layer, head] pair of this "
                             f"decoder ({layers} layers of {per_layer} heads)")
        pairs.append((pair[0], pair[1]))
    return pairs
