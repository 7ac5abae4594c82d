"""Marian / OPUS-MT for tandem: an out-of-tree model plugin.

Kept empty on purpose: tandem imports ``tandem_marian.plugin`` at start-up, and
the model module (torch, transformers) only when a Marian checkpoint is loaded.
"""

__version__ = "0.1.0"
