"""Attention backends shipped with tandem.

Each backend module is imported lazily through the backend registry, so that
importing tandem on a CPU machine never imports triton, xformers or flash-attn.
"""
