"""The tone-speech config: Whisper's transformer sizes, its own front-end and window.

``num_mel_bins`` is the number of frequency bands of the features, and the window
is ``2 * max_source_positions`` frames of 10 ms (the second convolution halves
them), so a checkpoint says how long its window is (1 s for 50 positions).
"""

from transformers import WhisperConfig

MODEL_TYPE = "tone_speech"


class ToneSpeechConfig(WhisperConfig):
    model_type = MODEL_TYPE
