"""The ``cpu_paged`` attention backend. Importing this package builds nothing:
the C++ op is built (or loaded from torch's extension cache) when the backend
is first considered for a CPU model."""

from tandem.backends.cpu_paged.backend import CPUPagedBackend

__all__ = ["CPUPagedBackend"]
