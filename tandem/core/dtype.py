"""``dtype="auto"``: which compute dtype the engine runs in, and why.

- On a GPU: the checkpoint's own dtype (``config.json``'s ``dtype`` /
  ``torch_dtype``), float32 when it names none.
- On a CPU: bfloat16 only where the CPU computes it natively (AVX512-BF16 or
  AMX tiles: oneDNN then runs bf16 GEMMs at about twice the fp32 rate);
  everywhere else float32, because bf16 there is emulated by conversions and
  runs several times slower than fp32 (measured in docs/performance.md).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

_NAMES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def checkpoint_dtype(model_dir: str) -> torch.dtype | None:
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None  # the loader reports a missing or broken config.json itself
    name = config.get("dtype") or config.get("torch_dtype") if isinstance(config, dict) else None
    return _NAMES.get(str(name).removeprefix("torch.")) if name else None


def cpu_native_bf16() -> tuple[bool, str]:
    """Whether this CPU computes bfloat16 natively, and the evidence."""
    if torch.cpu._is_amx_tile_supported():
        return True, "the CPU has AMX tiles"
    if torch.cpu._is_avx512_bf16_supported():
        return True, "the CPU has avx512_bf16"
    return False, f"the CPU has neither avx512_bf16 nor AMX (capability {torch.backends.cpu.get_cpu_capability()})"


def resolve_auto_dtype(model_dir: str, device: torch.device) -> tuple[torch.dtype, str]:
    """The dtype ``"auto"`` means here, with the reason the engine logs."""
    if device.type != "cpu":
        found = checkpoint_dtype(model_dir)
        if found is None:
            return torch.float32, "the checkpoint names no dtype"
        return found, "the checkpoint's dtype"
    native, why = cpu_native_bf16()
    if native:
        return torch.bfloat16, f"bfloat16 on CPU: {why}"
    return torch.float32, f"float32 on CPU: {why}, so bfloat16 would be emulated"
