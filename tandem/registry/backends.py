"""Attention backends by name, and how one is chosen."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from tandem.core.attention import AttentionBackend, AttentionType
from tandem.registry._lazy import LazyRegistry

ENV_VAR = "TANDEM_ATTENTION_BACKEND"


class BackendUnavailableError(ValueError):
    pass


@dataclass(frozen=True)
class BackendSelection:
    """The chosen backend and why (the engine logs it)."""

    backend: type[AttentionBackend]
    reason: str


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
        *,
        device: torch.device,
        dtype: torch.dtype,
        head_size: int,
        attn_types: frozenset[AttentionType],
        block_size: int,
        kv_cache_dtype: torch.dtype | None = None,
        attn_features: frozenset[str] = frozenset(),
    ) -> BackendSelection:
        """Explicit name, then ``$TANDEM_ATTENTION_BACKEND``, then the highest-priority
        backend that can serve (ties by name). ``attn_features``: the attention features
        the model needs (``EncoderDecoderModel.attn_features``); a backend that does not
        declare them cannot serve."""
        kv_dtype = dtype if kv_cache_dtype is None else kv_cache_dtype

        def reasons_of(backend: type[AttentionBackend]) -> list[str]:
            reasons = backend.unsupported_reasons(device, dtype, head_size, attn_types, block_size, kv_dtype)
            return reasons + backend.feature_reasons(frozenset(attn_features))

        name = requested or os.environ.get(ENV_VAR) or None
        if name is not None:
            source = "attention_backend" if requested else ENV_VAR
            if name not in self:
                raise BackendUnavailableError(
                    f"{source}={name!r} is not a registered attention backend; "
                    f"registered: {', '.join(self.names())}"
                )
            try:
                backend = self.load(name)
            except ImportError as e:
                raise BackendUnavailableError(f"{source}={name!r} cannot be loaded: {e}") from e
            reasons = reasons_of(backend)
            if reasons:
                raise BackendUnavailableError(
                    f"{source}={name!r} cannot serve this model: {'; '.join(reasons)}"
                )
            return BackendSelection(backend, f"asked for by {'$' + ENV_VAR if source == ENV_VAR else source}")
        if not self.names():
            raise BackendUnavailableError(
                "no attention backend is registered. Is tandem installed (pip install -e .) so its "
                "'tandem.plugins' entry points exist, and does $TANDEM_PLUGINS allow one?"
            )
        tried, candidates = [], []
        for candidate in sorted(self.names()):
            try:
                candidates.append(self.load(candidate))
            except ImportError as e:
                tried.append(f"{candidate}: {e}")
        ranked = []
        for backend in candidates:
            prio = backend.auto_priority(device, dtype)
            if prio is None:
                tried.append(f"{backend.name}: chosen only when asked for by name on {device.type}/"
                             f"{str(dtype).removeprefix('torch.')}")
            else:
                ranked.append((prio, backend))
        ranked.sort(key=lambda pb: (-pb[0], pb[1].name))
        for prio, backend in ranked:
            reasons = reasons_of(backend)
            if not reasons:
                served = f"{device.type}/{str(dtype).removeprefix('torch.')}"
                why = f"the highest priority ({prio}) of those that can serve {served}"
                if tried:
                    why += "; passed over: " + " | ".join(tried)
                return BackendSelection(backend, why)
            tried.append(f"{backend.name} (priority {prio}): {'; '.join(reasons)}")
        raise BackendUnavailableError("no attention backend can serve this model: " + " | ".join(tried))
