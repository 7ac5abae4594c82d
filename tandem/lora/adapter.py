"""Reading a PEFT LoRA adapter: ``adapter_config.json`` + ``adapter_model.safetensors``.

The result is plain data in the checkpoint's own (HF) module names: per module its
``A`` ``[r, in]``, its ``B`` ``[out, r]`` and its scaling (``lora_alpha / r``, or
``lora_alpha / sqrt(r)`` with rsLoRA, per module where ``rank_pattern`` /
``alpha_pattern`` say so, matched as PEFT's ``get_pattern_key`` does). Mapping those
names onto a model's (fused) layers is ``tandem.lora.mapping``'s job.

What PEFT can save but tandem cannot serve is refused with the reason
(:class:`AdapterError`): another PEFT type, DoRA, ``modules_to_save``, trained biases,
LoRA on embeddings, ``.bin``-only adapters (unpickling runs code; the same rule as
checkpoints), ranks above ``max_lora_rank``, NaN or inf weights.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from tandem.core.weight_loading import check_weight_values

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
MAX_CONFIG_BYTES = 1 << 20  # a PEFT config is ~2 KB; more is not a config

_PREFIX = "base_model.model."
_SUFFIXES = {".lora_A.weight": "A", ".lora_B.weight": "B"}
# PEFT options that change what the adapter computes in ways tandem does not reproduce:
# (field, what it means). Each must be absent, null, false or empty.
_UNSUPPORTED = (
    ("use_dora", "DoRA (use_dora) is not supported"),
    ("modules_to_save", "modules_to_save (fully trained copies of modules) is not supported"),
    ("lora_bias", "trained LoRA biases (lora_bias) are not supported"),
    ("fan_in_fan_out", "fan_in_fan_out (Conv1D-style weights) is not supported"),
    ("layer_replication", "layer_replication is not supported"),
    ("trainable_token_indices", "trainable_token_indices is not supported"),
    ("target_parameters", "target_parameters (LoRA on parameters) is not supported"),
    ("alora_invocation_tokens", "activated LoRA (alora_invocation_tokens) is not supported"),
    ("use_qalora", "QALoRA (use_qalora) is not supported"),
    ("use_bdlora", "use_bdlora is not supported"),
)


class AdapterError(ValueError):
    """Why an adapter cannot be served (the message is the reason alone: callers add
    the adapter's name and path)."""


def why_failed(req, e: BaseException | str) -> str:
    """A request's error for its adapter ``req`` (a ``LoRARequest``) that cannot be served:
    "LoRA adapter 'NAME' (PATH): reason", the reason an ``AdapterError``'s message, any
    other exception's type and message, or a reason given as text."""
    reason = e if isinstance(e, str) else str(e) if isinstance(e, AdapterError) else f"{type(e).__name__}: {e}"
    return f"LoRA adapter {req.lora_name!r} ({req.lora_path}): {reason}"


@dataclass
class ModuleLoRA:
    """One adapted module: ``a`` ``[r, in]``, ``b`` ``[out, r]`` (float32), ``scaling``."""

    a: torch.Tensor
    b: torch.Tensor
    scaling: float

    @property
    def rank(self) -> int:
        return self.a.shape[0]


@dataclass
class PeftLoRA:
    """An adapter as read: HF module name (without PEFT's ``base_model.model.``) -> its LoRA."""

    modules: dict[str, ModuleLoRA]
    max_rank: int


def read_config(folder: Path) -> dict:
    path = folder / CONFIG_FILE
    if not path.is_file():
        raise AdapterError(f"no {CONFIG_FILE} in {folder}: not a PEFT adapter directory")
    if path.stat().st_size > MAX_CONFIG_BYTES:
        raise AdapterError(f"{CONFIG_FILE} is {path.stat().st_size} bytes, more than a PEFT config can be "
                           f"({MAX_CONFIG_BYTES})")
    try:
        config = json.loads(path.read_text())
    except (ValueError, OSError) as e:
        raise AdapterError(f"{CONFIG_FILE} is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise AdapterError(f"{CONFIG_FILE} must hold a JSON object")
    peft_type = config.get("peft_type")
    if peft_type != "LORA":
        raise AdapterError(f"peft_type={peft_type!r}: only LORA adapters are supported")
    for field, why in _UNSUPPORTED:
        if config.get(field) not in (None, False, [], {}, ""):
            raise AdapterError(f"{why} ({field}={config[field]!r})")
    bias = config.get("bias", "none")
    if bias != "none":
        raise AdapterError(f"bias={bias!r}: trained biases are not supported (only bias='none')")
    return config


def _number(config: dict, field: str, value, *, positive_int: bool = False) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0
    if positive_int:
        ok = ok and isinstance(value, int)
    if not ok:
        kind = "a positive integer" if positive_int else "a positive number"
        raise AdapterError(f"{field}={value!r} in {CONFIG_FILE}: must be {kind}")
    return value


def _pattern_value(patterns, module: str, default):
    """PEFT's ``get_pattern_key``: the first pattern that matches the module name's tail."""
    if not isinstance(patterns, dict):
        return default
    for key, value in patterns.items():
        try:
            if re.match(rf"(.*\.)?({key})$", module):
                return value
        except re.error as e:
            raise AdapterError(f"pattern {key!r} in {CONFIG_FILE}: not a regular expression ({e})") from None
    return default


def scaling_of(config: dict, module: str) -> tuple[int, float]:
    """``(r, scaling)`` of ``module`` by the config (``rank_pattern`` / ``alpha_pattern``, rsLoRA)."""
    r = _number(config, "r", _pattern_value(config.get("rank_pattern"), module, config.get("r")), positive_int=True)
    alpha = _number(config, "lora_alpha", _pattern_value(config.get("alpha_pattern"), module,
                                                           config.get("lora_alpha", 8)))
    return r, alpha / (math.sqrt(r) if config.get("use_rslora") else r)


def read_adapter(folder: str | Path, max_rank: int) -> PeftLoRA:
    """Read the adapter in ``folder`` (a local directory), checking everything that does
    not depend on the model: the config, the tensor names, ranks against ``max_rank`` and
    ``r`` / ``rank_pattern``, A/B shapes against each other, NaN and inf."""
    folder = Path(folder)
    config = read_config(folder)
    weights = folder / WEIGHTS_FILE
    if not weights.is_file():
        if (folder / "adapter_model.bin").is_file():
            raise AdapterError(f"only adapter_model.bin in {folder}: pickled .bin adapters are refused (loading one "
                               f"can run code); save it with safetensors ({WEIGHTS_FILE})")
        raise AdapterError(f"no {WEIGHTS_FILE} in {folder}")
    from safetensors import SafetensorError, safe_open

    parts: dict[str, dict[str, torch.Tensor]] = {}
    try:
        with safe_open(str(weights), framework="pt") as f:
            names = list(f.keys())
            # Shapes first (from the header): nothing large is read for an adapter refused on them.
            for name in names:
                module, kind = _split(name)
                shape = f.get_slice(name).get_shape()
                if len(shape) != 2:
                    raise AdapterError(f"tensor {name!r} has shape {tuple(shape)}: a LoRA matrix is 2-D")
                rank = shape[0] if kind == "A" else shape[1]
                if rank > max_rank:
                    raise AdapterError(f"module {module!r} has rank {rank}, above max_lora_rank={max_rank}")
            for name in names:
                module, kind = _split(name)
                parts.setdefault(module, {})[kind] = f.get_tensor(name)
    except (SafetensorError, OSError) as e:
        raise AdapterError(f"cannot read {weights}: {e}") from None
    if not parts:
        raise AdapterError(f"{WEIGHTS_FILE} holds no LoRA weights")

    modules = {}
    for module, ab in sorted(parts.items()):
        if set(ab) != {"A", "B"}:
            missing = ({"A", "B"} - set(ab)).pop()
            raise AdapterError(f"module {module!r} has no lora_{missing}.weight")
        a, b = ab["A"], ab["B"]
        for kind, t in (("lora_A", a), ("lora_B", b)):
            try:
                check_weight_values(t, torch.float32)
            except ValueError as e:
                raise AdapterError(f"{module}.{kind}.weight {e}") from None
        r, scaling = scaling_of(config, module)
        if a.shape[0] != b.shape[1] or a.shape[0] != r:
            raise AdapterError(f"module {module!r}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not "
                               f"have the config's rank r={r}")
        modules[module] = ModuleLoRA(a.float(), b.float(), float(scaling))
    return PeftLoRA(modules, max(m.rank for m in modules.values()))


def _split(name: str) -> tuple[str, str]:
    """``base_model.model.<module>.lora_A.weight`` -> (``<module>``, "A")."""
    for suffix, kind in _SUFFIXES.items():
        if name.endswith(suffix):
            module = name[: -len(suffix)]
            return module.removeprefix(_PREFIX), kind
    if "lora_embedding_" in name:
        raise AdapterError(f"tensor {name!r}: LoRA on embeddings is not supported")
    raise AdapterError(f"tensor {name!r} is not a LoRA matrix (lora_A.weight / lora_B.weight): a full weight, as "
                       "PEFT saves for adapted embeddings, the LM head and modules_to_save, which are not supported "
                       "(only LoRA on linear layers is)")
