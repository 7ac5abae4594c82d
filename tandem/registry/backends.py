"""Attention backends by name, and how one is chosen."""

from __future__ import annotations

import os

import torch

from tandem.core.attention import AttentionBackend, AttentionType
from tandem.registry._lazy import LazyRegistry

# Preference order when nothing is asked for explicitly.
_PREFERENCE = ("flash_attn", "xformers", "triton", "torch_sdpa")

ENV_VAR = "TANDEM_ATTENTION_BACKEND"


class BackendUnavailableError(ValueError):
    pass


class AttentionBackendRegistry(LazyRegistry[AttentionBackend]):
    kind = "attention backend"

    def register_backend(self, name: str, target: str | type, *, override: bool = False) -> None:
        self.register(name, target, override=override)

    def load(self, name: str) -> type[AttentionBackend]:
        """The backend class registered as ``name``, checked to be an ``AttentionBackend``
        subclass whose ``name`` attribute is ``name``."""
        cls = super().load(name)
        if not (isinstance(cls, type) and issubclass(cls, AttentionBackend)):
            raise TypeError(f"{self.origin(name)} resolves to {cls!r}, not an AttentionBackend subclass")
        # The engine reports (and users check) the chosen backend by its class's ``name``,
        # so it must be the name users select it by.
        declared = getattr(cls, "name", None)
        if declared != name:
            raise ValueError(
                f"{self.origin(name)}: {cls.__module__}.{cls.__qualname__}.name is "
                f"{'not set' if declared is None else repr(declared)}, "
                f"not {name!r}; a backend class's name must be the name it is registered under"
            )
        return cls

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
        if not self.names():
            raise BackendUnavailableError(
                "no attention backend is registered. Is tandem installed (pip install -e .) so its "
                "'tandem.plugins' entry points exist, and does $TANDEM_PLUGINS allow one?"
            )
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
