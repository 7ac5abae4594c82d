"""The demo Whisper checkpoint (this folder) and the tone speech it transcribes.

``tandem demo --whisper`` runs it; ``tandem demo --whisper --path`` prints this
folder for ``tandem transcribe`` / ``tandem serve``. See TRAINING.md.
"""

from pathlib import Path

from tandem.demo_whisper.tones import SAMPLE_RATE, TONES, WORDS, synthesize, unknown_words, write_wav

PATH = Path(__file__).resolve().parent

__all__ = ["PATH", "SAMPLE_RATE", "TONES", "WORDS", "synthesize", "unknown_words", "write_wav"]
