"""``dtype="auto"``: which compute dtype the engine runs in, and why.

- On a GPU: the checkpoint's own dtype (``config.json``'s ``dtype`` /
  ``torch_dtype``), float32 when it names none.
- On a CPU: bfloat16 only where the CPU computes it natively (AVX512-BF16 or
  AMX tiles: oneDNN then runs bf16 GEMMs at about twice the fp32 rate);
  everywhere else float32, because bf16 there is emulated by conversions and
  runs several times slower than fp32 (measured in docs/performance.md).
- Anywhere: ``$TANDEM_AUTO_DTYPE`` (``float32``, ``bfloat16`` or ``float16``),
  when set, is what ``"auto"`` means instead, whatever the machine. CI sets
  ``TANDEM_AUTO_DTYPE=bfloat16`` to run the suite as an avx512_bf16 CPU would
  on any CPU. An explicit dtype is never overridden.
- With ``quantization="int8"``: float32 always, because int8 dynamic
  quantization computes in float32 (its kernel takes and returns float32);
  ``$TANDEM_AUTO_DTYPE`` does not change that, so a CI run that makes "auto"
  mean bfloat16 still runs int8. An explicit dtype other than float32 with
  int8 is an error (EngineConfig).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path

import torch

_NAMES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# The environment variable that overrides what dtype="auto" resolves to.
AUTO_DTYPE_ENV = "TANDEM_AUTO_DTYPE"


def auto_dtype_override(environ: Mapping[str, str] | None = None) -> tuple[torch.dtype, str] | None:
    """``$TANDEM_AUTO_DTYPE`` as a dtype with its reason, or None when unset or empty.

    Raises ValueError naming the variable and its value for anything but
    ``float32``, ``bfloat16`` or ``float16``."""
    value = (os.environ if environ is None else environ).get(AUTO_DTYPE_ENV, "")
    if value == "":
        return None
    if value not in _NAMES:
        raise ValueError(
            f"{AUTO_DTYPE_ENV}={value!r}: must be one of {', '.join(_NAMES)} (or unset), "
            'the dtype that dtype="auto" then means'
        )
    return _NAMES[value], f"{AUTO_DTYPE_ENV}={value} overrides auto"


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


def resolve_auto_dtype(
    model_dir: str | None, device: torch.device, quantization: str | None = None
) -> tuple[torch.dtype, str]:
    """The dtype ``"auto"`` means here, with the reason the engine logs: float32
    for int8, else ``$TANDEM_AUTO_DTYPE`` when set, else what the device and
    checkpoint call for. ``model_dir`` None: no checkpoint at hand (``tandem
    plugins``), so on a GPU bfloat16 stands for the checkpoint's dtype."""
    override = auto_dtype_override()
    if quantization == "int8":
        ignored = f"; {AUTO_DTYPE_ENV}={_name(override[0])} does not apply to int8" if override else ""
        return torch.float32, f"float32: int8 dynamic quantization computes in float32{ignored}"
    if override is not None:
        return override
    if device.type != "cpu":
        if model_dir is None:
            return torch.bfloat16, "the checkpoint's dtype on GPU (bfloat16 shown)"
        found = checkpoint_dtype(model_dir)
        if found is None:
            return torch.float32, "the checkpoint names no dtype"
        return found, "the checkpoint's dtype"
    native, why = cpu_native_bf16()
    if native:
        return torch.bfloat16, f"bfloat16 on CPU: {why}"
    return torch.float32, f"float32 on CPU: {why}, so bfloat16 would be emulated"


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
