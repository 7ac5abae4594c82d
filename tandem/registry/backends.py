"""Attention backends by name, and how one is chosen."""

from __future__ import annotations

import os

import torch

from tandem.core.attention import AttentionBackend, AttentionType
from tandem.registry._lazy import LazyRegistry

_BUILTIN_BACKENDS = {
    "torch_sdpa": "tandem.backends.torch_sdpa:TorchSDPABackend",
}

# Preference order when nothing is asked for explicitly.
_PREFERENCE = ("flash_attn", "xformers", "triton", "torch_sdpa")

ENV_VAR = "TANDEM_ATTENTION_BACKEND"


class BackendUnavailableError(ValueError):
    pass


class AttentionBackendRegistry(LazyRegistry[AttentionBackend]):
    kind = "attention backend"

    def __init__(self, builtin: bool = True) -> None:
        super().__init__()
        if builtin:
            for name, path in _BUILTIN_BACKENDS.items():
                self.register(name, path)

    def register_backend(self, name: str, target: str | type, *, override: bool = False) -> None:
        self.register(name, target, override=override)

    def select(
        self,
        requested: str | None,
        device: torch.device,
        dtype: torch.dtype,
        head_size: int,
        attn_types: frozenset[AttentionType],
    ) -> type[AttentionBackend]:
        """Explicit name, then ``$TANDEM_ATTENTION_BACKEND``, then the best that can serve."""
        name = requested or os.environ.get(ENV_VAR) or None
        if name is not None:
            source = "attention_backend" if requested else ENV_VAR
            if name not in self:
                raise BackendUnavailableError(
                    f"{source}={name!r} is not a registered attention backend; "
                    f"registered: {', '.join(self.names())}"
                )
            backend = self.load(name)
            reasons = backend.unsupported_reasons(device, dtype, head_size, attn_types)
            if reasons:
                raise BackendUnavailableError(
                    f"{source}={name!r} cannot serve this model: {'; '.join(reasons)}"
                )
            return backend
        tried = []
        order = [n for n in _PREFERENCE if n in self] + [n for n in self.names() if n not in _PREFERENCE]
        for candidate in order:
            try:
                backend = self.load(candidate)
            except ImportError as e:
                tried.append(f"{candidate}: {e}")
                continue
            reasons = backend.unsupported_reasons(device, dtype, head_size, attn_types)
            if not reasons:
                return backend
            tried.append(f"{candidate}: {'; '.join(reasons)}")
        raise BackendUnavailableError("no attention backend can serve this model: " + " | ".join(tried))
