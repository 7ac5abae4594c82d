"""The ``triton`` attention backend. Importing this package does not import
triton: the kernels load when the backend is first used."""

from tandem.backends.triton.backend import TritonBackend

__all__ = ["TritonBackend"]
