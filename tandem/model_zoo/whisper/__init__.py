"""Whisper: the model (``model.py``), its special tokens and prompts (``prompts.py``),
timestamp rules and HF's segment logic (``timestamps.py``), audio and the one log-mel
function (``audio.py``), fixed numbers (``constants.py``), and the long-form
transcription session behind ``SupportsTranscription`` (``transcription.py``)."""

from tandem.model_zoo.whisper.constants import TASKS
from tandem.model_zoo.whisper.model import WhisperForConditionalGeneration
from tandem.model_zoo.whisper.prompts import WhisperPrompts

__all__ = ["TASKS", "WhisperForConditionalGeneration", "WhisperPrompts"]
