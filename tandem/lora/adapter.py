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

Reading an adapter is bounded whatever its files hold (it runs on a thread of the
engine's process, beside the step):

- the config: at most ``MAX_CONFIG_BYTES``, nested at most ``MAX_CONFIG_DEPTH`` levels;
- ``rank_pattern`` / ``alpha_pattern``: at most ``MAX_PATTERNS`` keys of at most
  ``MAX_PATTERN_CHARS`` characters each, matched with the ``regex`` module, which
  releases the GIL while it matches (the engine's thread runs meanwhile), under a
  time budget of ``PATTERN_BUDGET_S`` for the whole adapter: a pattern that backtracks
  without bound (``(.*)*X``) is refused, naming it;
- the weights: every shape is checked from the safetensors header (2-D, ranks, A/B
  pairs, the config's ``r``, dimensions of at most ``MAX_FEATURES``, and the model's
  own layers when the reader is given ``fits``) before any tensor is read.
"""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from tandem.core.weight_loading import check_weight_values

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
MAX_CONFIG_BYTES = 1 << 20  # a PEFT config is ~2 KB; more is not a config
# PEFT's configs nest 2 levels (rank_pattern's object, target_modules' list); 16 leaves room.
MAX_CONFIG_DEPTH = 16
# rank_pattern / alpha_pattern: PEFT writes one key per module at most (a few hundred for
# large models); keys are module names or short regular expressions.
MAX_PATTERNS = 4096
MAX_PATTERN_CHARS = 512
# Matching every module name against every key, for one adapter: plain names take
# microseconds each, so only a pattern that backtracks without bound comes near it.
PATTERN_BUDGET_S = 1.0
# A LoRA matrix's other dimension is a linear layer's width (bart-base 768 / 3072, the
# largest LLMs' feed-forward layers ~50K); a larger one is not an adapter's.
MAX_FEATURES = 1 << 20
# A module name longer than this is no model's.
MAX_MODULE_CHARS = 1024

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


def parse_config(text: str) -> dict:
    """``adapter_config.json``'s text as a JSON object nested at most ``MAX_CONFIG_DEPTH``
    levels (an :class:`AdapterError` naming the field that nests deeper)."""
    try:
        config = json.loads(text)
    except RecursionError:  # deeper than the parser's recursion limit (~1000 levels)
        raise AdapterError(_too_deep(_deep_field(text))) from None
    except ValueError as e:
        raise AdapterError(f"{CONFIG_FILE} is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise AdapterError(f"{CONFIG_FILE} must hold a JSON object")
    for field, value in config.items():
        if _depth(value) > MAX_CONFIG_DEPTH - 1:
            raise AdapterError(_too_deep(field))
    return config


def _too_deep(field: str | None) -> str:
    where = f"the value of {field!r}" if field is not None else "it"
    return (f"{CONFIG_FILE}: {where} nests arrays or objects more than {MAX_CONFIG_DEPTH} levels deep (a PEFT "
            f"config nests 2)")


def _depth(value) -> int:
    """How many levels of arrays / objects ``value`` nests (0: a scalar), without recursion."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, (dict, list)):
            d += 1
            deepest = max(deepest, d)
            if d > MAX_CONFIG_DEPTH:
                return d
            stack.extend((c, d) for c in (v.values() if isinstance(v, dict) else v))
    return deepest


_JSON_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"\s*:?|[\[\]{}]')


def _deep_field(text: str) -> str | None:
    """The top-level field of a JSON object whose value nests beyond ``MAX_CONFIG_DEPTH``
    (the error path only: the scan stops there)."""
    depth, field = 0, None
    for m in _JSON_TOKEN.finditer(text):
        tok = m.group()
        if tok in "[{":
            depth += 1
            if depth > MAX_CONFIG_DEPTH:
                return field
        elif tok in "]}":
            depth -= 1
        elif depth == 1 and tok.endswith(":"):
            try:
                field = json.loads(tok[:-1].rstrip())
            except ValueError:
                field = None
    return field


def read_config(folder: Path) -> dict:
    path = folder / CONFIG_FILE
    if not path.is_file():
        raise AdapterError(f"no {CONFIG_FILE} in {folder}: not a PEFT adapter directory")
    if path.stat().st_size > MAX_CONFIG_BYTES:
        raise AdapterError(f"{CONFIG_FILE} is {path.stat().st_size} bytes, more than a PEFT config can be "
                           f"({MAX_CONFIG_BYTES})")
    try:
        text = path.read_text()
    except (ValueError, OSError) as e:  # UnicodeDecodeError is a ValueError
        raise AdapterError(f"{CONFIG_FILE} cannot be read as text: {e}") from None
    config = parse_config(text)
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


class Scalings:
    """``(r, scaling)`` per module by a config: ``r`` / ``lora_alpha``, overridden where a
    key of ``rank_pattern`` / ``alpha_pattern`` matches, as PEFT's ``get_pattern_key``
    matches (``re.match(rf"(.*\\.)?({key})$", module)``: the first key, in order, that
    matches the module name's tail), and rsLoRA. The keys are checked and compiled once;
    matches run under one time budget for the whole adapter (the module docstring)."""

    def __init__(self, config: dict) -> None:
        self.config = config
        self.patterns = {field: _compile_patterns(config, field) for field in ("rank_pattern", "alpha_pattern")}
        self.deadline: float | None = None  # set by the first match

    def _value(self, field: str, module: str, default):
        import regex

        for key, compiled, value in self.patterns[field]:
            if self.deadline is None:
                self.deadline = time.monotonic() + PATTERN_BUDGET_S
            left = self.deadline - time.monotonic()
            try:
                if left <= 0:
                    raise TimeoutError
                # concurrent: the match releases the GIL, so the engine's thread steps meanwhile.
                if compiled.match(module, timeout=left, concurrent=True):
                    return value
            except TimeoutError:
                raise AdapterError(f"{field} key {key!r} in {CONFIG_FILE}: matching the module names took longer "
                                   f"than {PATTERN_BUDGET_S:g} s (a pattern that backtracks without bound); use "
                                   f"module names or simple patterns") from None
            except regex.error as e:  # raised while matching by a few constructs
                raise AdapterError(f"{field} key {key!r} in {CONFIG_FILE}: not a regular expression ({e})") from None
        return default

    def of(self, module: str) -> tuple[int, float]:
        config = self.config
        r = _number(config, "r", self._value("rank_pattern", module, config.get("r")), positive_int=True)
        alpha = _number(config, "lora_alpha", self._value("alpha_pattern", module, config.get("lora_alpha", 8)))
        return r, alpha / (math.sqrt(r) if config.get("use_rslora") else r)


def _compile_patterns(config: dict, field: str) -> list:
    """``[(key, compiled pattern, value)]`` of ``config[field]`` (absent or null: none)."""
    import regex

    patterns = config.get(field)
    if patterns is None:
        return []
    if not isinstance(patterns, dict):
        raise AdapterError(f"{field}={_shown(patterns)} in {CONFIG_FILE}: must be an object of module name "
                           f"(pattern) -> value")
    if len(patterns) > MAX_PATTERNS:
        raise AdapterError(f"{field} in {CONFIG_FILE} has {len(patterns)} keys, more than {MAX_PATTERNS}")
    out = []
    for key, value in patterns.items():
        if len(key) > MAX_PATTERN_CHARS:
            raise AdapterError(f"{field} key {_shown(key)} in {CONFIG_FILE} is {len(key)} characters, more than "
                               f"{MAX_PATTERN_CHARS}")
        try:
            compiled = regex.compile(rf"(.*\.)?({key})$")
        except (regex.error, RecursionError, OverflowError, ValueError) as e:
            raise AdapterError(f"{field} key {_shown(key)} in {CONFIG_FILE}: not a regular expression "
                               f"({e})") from None
        out.append((key, compiled, value))
    return out


def _shown(value, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def scaling_of(config: dict, module: str) -> tuple[int, float]:
    """``(r, scaling)`` of ``module`` by the config (``rank_pattern`` / ``alpha_pattern``, rsLoRA)."""
    return Scalings(config).of(module)


# safetensors dtype names of the float types a LoRA matrix may be saved in.
_FLOAT_DTYPES = {"F16", "BF16", "F32", "F64"}

Fits = Callable[[str, tuple[int, int], tuple[int, int]], None]


def read_adapter(folder: str | Path, max_rank: int, fits: Fits | None = None) -> PeftLoRA:
    """Read the adapter in ``folder`` (a local directory), checking everything that does
    not depend on the model: the config, the tensor names, ranks against ``max_rank`` and
    ``r`` / ``rank_pattern``, A/B shapes against each other, NaN and inf. ``fits(module,
    a_shape, b_shape)``, when given, raises an :class:`AdapterError` for a module the
    model cannot take; like every shape check, it runs on the safetensors header, before
    any tensor is read."""
    folder = Path(folder)
    config = read_config(folder)
    scalings = Scalings(config)
    weights = folder / WEIGHTS_FILE
    if not weights.is_file():
        if (folder / "adapter_model.bin").is_file():
            raise AdapterError(f"only adapter_model.bin in {folder}: pickled .bin adapters are refused (loading one "
                               f"can run code); save it with safetensors ({WEIGHTS_FILE})")
        raise AdapterError(f"no {WEIGHTS_FILE} in {folder}")
    from safetensors import SafetensorError, safe_open

    modules = {}
    try:
        with safe_open(str(weights), framework="pt") as f:
            names = list(f.keys())
            # Every check that shapes allow, from the header: nothing is read for an adapter refused on them.
            shapes: dict[str, dict[str, tuple[int, ...]]] = {}
            for name in names:
                module, kind = _split(name)
                part = f.get_slice(name)
                shape, dtype = tuple(part.get_shape()), part.get_dtype()
                if len(shape) != 2:
                    raise AdapterError(f"tensor {name!r} has shape {shape}: a LoRA matrix is 2-D")
                if dtype not in _FLOAT_DTYPES:
                    raise AdapterError(f"tensor {name!r} has dtype {dtype}: a LoRA matrix is float16, bfloat16, "
                                       f"float32 or float64")
                rank, width = (shape[0], shape[1]) if kind == "A" else (shape[1], shape[0])
                if rank > max_rank:
                    raise AdapterError(f"module {module!r} has rank {rank}, above max_lora_rank={max_rank}")
                if width > MAX_FEATURES:
                    raise AdapterError(f"tensor {name!r} has shape {shape}: {width} features, more than any linear "
                                       f"layer has ({MAX_FEATURES})")
                shapes.setdefault(module, {})[kind] = shape
            if not shapes:
                raise AdapterError(f"{WEIGHTS_FILE} holds no LoRA weights")
            scaling = {}
            for module, ab in sorted(shapes.items()):
                if set(ab) != {"A", "B"}:
                    missing = ({"A", "B"} - set(ab)).pop()
                    raise AdapterError(f"module {module!r} has no lora_{missing}.weight")
                if fits is not None:  # first: the patterns below are then matched against real module names
                    fits(module, ab["A"], ab["B"])
                r, scaling[module] = scalings.of(module)
                if ab["A"][0] != ab["B"][1] or ab["A"][0] != r:
                    raise AdapterError(f"module {module!r}: lora_A {ab['A']} and lora_B {ab['B']} do not "
                                       f"have the config's rank r={r}")
            tensors: dict[str, dict[str, torch.Tensor]] = {}
            for name in names:
                module, kind = _split(name)
                tensors.setdefault(module, {})[kind] = f.get_tensor(name)
    except (SafetensorError, OSError) as e:
        raise AdapterError(f"cannot read {weights}: {e}") from None

    for module, ab in sorted(tensors.items()):
        a, b = ab["A"], ab["B"]
        for kind, t in (("lora_A", a), ("lora_B", b)):
            try:
                check_weight_values(t, torch.float32)
            except ValueError as e:
                raise AdapterError(f"{module}.{kind}.weight {e}") from None
        modules[module] = ModuleLoRA(a.float(), b.float(), float(scaling[module]))
    return PeftLoRA(modules, max(m.rank for m in modules.values()))


def _split(name: str) -> tuple[str, str]:
    """``base_model.model.<module>.lora_A.weight`` -> (``<module>``, "A")."""
    for suffix, kind in _SUFFIXES.items():
        if name.endswith(suffix):
            module = name[: -len(suffix)].removeprefix(_PREFIX)
            if len(module) > MAX_MODULE_CHARS:
                raise AdapterError(f"tensor {name[:80]!r}... has a {len(module)}-character module name: no model's")
            return module, kind
    if "lora_embedding_" in name:
        raise AdapterError(f"tensor {name!r}: LoRA on embeddings is not supported")
    raise AdapterError(f"tensor {name!r} is not a LoRA matrix (lora_A.weight / lora_B.weight): a full weight, as "
                       "PEFT saves for adapted embeddings, the LM head and modules_to_save, which are not supported "
                       "(only LoRA on linear layers is)")
