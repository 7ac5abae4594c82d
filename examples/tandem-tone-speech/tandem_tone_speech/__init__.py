"""Tone speech for tandem: an out-of-tree speech model plugin.

Kept empty on purpose: tandem imports ``tandem_tone_speech.plugin`` at start-up,
and the model module only when a tone-speech checkpoint is loaded.
"""

__version__ = "0.1.0"
