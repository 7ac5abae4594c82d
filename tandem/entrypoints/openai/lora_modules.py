"""The model names a server answers to: the base model's and its LoRA adapters'.

``tandem serve MODEL --enable-lora --lora-modules name=path ...`` serves each
adapter under its name: a request's ``model`` field picks it (completions and the
audio endpoints), ``/v1/models`` lists it with ``parent`` = the base model (as
vLLM does), and an unknown name is a 404 (as OpenAI answers). vLLM's
``POST /v1/load_lora_adapter`` ``{"lora_name", "lora_path"}`` and
``POST /v1/unload_lora_adapter`` ``{"lora_name"}`` change the set at run time,
behind the API key like every ``/v1/`` route.

Files: the operator's ``--lora-modules`` paths are the operator's. A client's
``lora_path`` never makes the server read a file the operator did not allow
(docs/serving.md, "Security"): runtime loading is off unless the operator gave
``--lora-allowed-dir DIR``, and then the path must lie inside DIR once ``..`` and
symlinks are resolved; any path outside gets one answer that does not depend on
what is on disk there (nothing outside DIR is looked at). Inside DIR the answer
may say what is wrong (no ``adapter_config.json``): the operator allowed it.
"""

from __future__ import annotations

import itertools
import json
import os
from typing import Any

from tandem.entrypoints.openai.media import _inside
from tandem.core.param_errors import shown
from tandem.entrypoints.openai.protocol import HTTPError, MAX_SHOWN_CHARS
from tandem.lora.adapter import AdapterError, parse_config
from tandem.lora.request import LoRARequest

# adapter_config.json is a few hundred bytes; anything this big is not one.
MAX_ADAPTER_CONFIG_BYTES = 1 << 20
MAX_NAME_CHARS = 256


def parse_lora_module(text: str) -> tuple[str, str]:
    """One ``--lora-modules`` value: ``name=path`` or vLLM's JSON
    ``{"name": ..., "path": ...}`` (``base_model_name`` allowed, ignored); ``ValueError`` naming it."""
    text = text.strip()
    if text.startswith("{"):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--lora-modules {text!r}: not valid JSON ({e})") from None
        except RecursionError:  # nested past the parser's recursion limit
            raise ValueError(f"--lora-modules {shown(text, MAX_SHOWN_CHARS)}: a JSON module is "
                             "{\"name\": ..., \"path\": ...}, not nested arrays or objects") from None
        if not isinstance(value, dict) or set(value) - {"name", "path", "base_model_name"}:
            raise ValueError(f"--lora-modules {text!r}: a JSON module is {{\"name\": ..., \"path\": ...}}")
        name, path = value.get("name"), value.get("path")
    else:
        name, sep, path = text.partition("=")
        if not sep:
            raise ValueError(f"--lora-modules {text!r}: expected name=path or {{\"name\": ..., \"path\": ...}}")
    if not isinstance(name, str) or not name.strip() or not isinstance(path, str) or not path.strip():
        raise ValueError(f"--lora-modules {text!r}: the name and the path must be non-empty strings")
    return name.strip(), path.strip()


def check_adapter_dir(path: str, max_rank: int) -> None:
    """``ValueError`` unless ``path`` is a directory with a LoRA ``adapter_config.json``
    whose rank is at most ``max_rank`` (the worker checks the weights when it loads them)."""
    if not os.path.isdir(path):
        raise ValueError(f"{path!r} is not a directory (a PEFT adapter directory holds adapter_config.json)")
    config = os.path.join(path, "adapter_config.json")
    try:
        if os.path.getsize(config) > MAX_ADAPTER_CONFIG_BYTES:
            raise ValueError(f"{config!r} is over {MAX_ADAPTER_CONFIG_BYTES} bytes: not a PEFT adapter config")
        with open(config, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise ValueError(f"{path!r} has no adapter_config.json: not a PEFT adapter directory") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{config!r} cannot be read as JSON ({e})") from None
    try:
        value = parse_config(text)  # a JSON object, its nesting bounded
    except AdapterError as e:
        raise ValueError(f"{config!r}: {e}") from None
    kind = value.get("peft_type", "LORA")
    if kind != "LORA":
        raise ValueError(f"{config!r}: peft_type={kind!r}; only LoRA adapters (peft_type 'LORA') are served")
    rank = value.get("r")
    if isinstance(rank, int) and rank > max_rank:
        raise ValueError(f"{config!r}: rank r={rank} is above max_lora_rank={max_rank} (--max-lora-rank)")


class ServedModels:
    """The names a server answers to. ``resolve(model)`` is the adapter a request's
    ``model`` field picks (None: the base model), or a 404."""

    def __init__(self, base_name: str, root: str, *, enable_lora: bool, max_lora_rank: int,
                 lora_modules: list[tuple[str, str]] = (), allowed_dir: str | None = None) -> None:
        self.base_name, self.root = base_name, root
        self.enable_lora, self.max_lora_rank = enable_lora, max_lora_rank
        self.allowed_dir = allowed_dir
        if lora_modules and not enable_lora:
            raise ValueError("--lora-modules needs --enable-lora")
        if allowed_dir is not None and not enable_lora:
            raise ValueError("--lora-allowed-dir needs --enable-lora")
        # Ids are never reused: a name loaded again (another path, maybe) is another adapter
        # to the engine's caches and the worker's adapter manager.
        self._ids = itertools.count(1)
        self.adapters: dict[str, LoRARequest] = {}
        for name, path in lora_modules:
            if name == base_name or name in self.adapters:
                raise ValueError(f"--lora-modules: the name {name!r} is given twice (or is the base model's)")
            if os.path.exists(path):  # else a Hub repo id, resolved as checkpoints are
                check_adapter_dir(path, max_lora_rank)
            self.adapters[name] = LoRARequest(name, next(self._ids), path)

    def resolve(self, model: str | None) -> LoRARequest | None:
        if model is None or model == self.base_name:
            return None
        lora = self.adapters.get(model)
        if lora is None:
            names = [self.base_name, *self.adapters]
            listed = ", ".join(repr(n) for n in names[:20]) + (f" and {len(names) - 20} more" if len(names) > 20 else "")
            # OpenAI answers an unknown model with 404 (vLLM too).
            raise HTTPError(404, f"model={shown(model, MAX_SHOWN_CHARS)}: this server serves {listed}", param="model")
        return lora

    def cards(self) -> list[dict[str, Any]]:
        """``/v1/models``' entries: the base model, then each adapter with ``parent``."""
        base = {"id": self.base_name, "object": "model", "created": 0, "owned_by": "tandem", "root": self.root,
                "parent": None}
        return [base] + [{"id": name, "object": "model", "created": 0, "owned_by": "tandem", "root": lora.lora_path,
                          "parent": self.base_name} for name, lora in self.adapters.items()]

    # -- vLLM's runtime endpoints -------------------------------------------------------
    def load(self, body: Any) -> str:
        """``POST /v1/load_lora_adapter``: the message of success, or an ``HTTPError``."""
        name, path = _field(body, "lora_name"), _field(body, "lora_path")
        unknown = set(body) - {"lora_name", "lora_path", "load_inplace"}
        if unknown:
            raise HTTPError(400, f"unknown field {sorted(unknown)[0][:80]!r} (fields: lora_name, lora_path)")
        if name == self.base_name or name in self.adapters:
            raise HTTPError(400, f"lora_name={shown(name, MAX_SHOWN_CHARS)}: a model of that name is already served; "
                                 "unload it first", param="lora_name")
        real = self._allowed(path)
        try:
            check_adapter_dir(real, self.max_lora_rank)
        except ValueError as e:
            raise HTTPError(400, f"lora_path: {e}", param="lora_path") from None
        self.adapters[name] = LoRARequest(name, next(self._ids), real)
        return f"Success: LoRA adapter '{name}' added successfully."

    def unload(self, body: Any) -> str:
        """``POST /v1/unload_lora_adapter``: requests already running with it finish with it."""
        name = _field(body, "lora_name")
        unknown = set(body) - {"lora_name", "lora_int_id"}
        if unknown:
            raise HTTPError(400, f"unknown field {sorted(unknown)[0][:80]!r} (fields: lora_name)")
        if self.adapters.pop(name, None) is None:
            raise HTTPError(404, f"lora_name={shown(name, MAX_SHOWN_CHARS)}: no LoRA adapter of that name is served",
                            param="lora_name")
        return f"Success: LoRA adapter '{name}' removed successfully."

    def _allowed(self, path: str) -> str:
        """The real path of ``path`` when it lies inside the allowed directory; one
        refusal for every other path, whatever is there."""
        root = self.allowed_dir
        if root is None:
            raise HTTPError(403, "loading LoRA adapters at run time is off on this server: its operator allows it "
                                 "with --lora-allowed-dir DIR (adapters inside DIR), or serves adapters with "
                                 "--lora-modules", param="lora_path")
        refusal = HTTPError(403, "lora_path: this server loads adapters only from inside the directory its "
                                 "operator allowed (--lora-allowed-dir)", param="lora_path")
        if "\0" in path:
            raise refusal
        try:
            lexical = os.path.normpath(os.path.join(root, path))  # an absolute path stays itself
            if not _inside(lexical, root):
                raise refusal
            real = os.path.realpath(lexical)  # symlinks resolved: one may point out of the directory
        except (OSError, ValueError):
            raise refusal from None
        if not _inside(real, root):
            raise refusal
        return real


def _field(body: Any, name: str) -> str:
    if not isinstance(body, dict):
        raise HTTPError(400, "the body must be a JSON object")
    value = body.get(name)
    if not isinstance(value, str) or not value or len(value) > (4096 if name == "lora_path" else MAX_NAME_CHARS):
        raise HTTPError(400, f"{name} must be a non-empty string (at most "
                             f"{4096 if name == 'lora_path' else MAX_NAME_CHARS} characters)", param=name)
    return value


def check_lora_flags(base_name: str, root: str, engine_args: dict, lora_modules: list[tuple[str, str]],
                     allowed_dir: str | None) -> None:
    """The LoRA server options checked before any engine is built (``tandem serve``, a Ray
    Serve deployment), so a mistake costs no model load: raises ``ValueError`` naming it.
    ``engine_args``: the engine options given; the others take ``EngineConfig``'s defaults."""
    from dataclasses import fields

    from tandem.core.config import EngineConfig

    defaults = {f.name: f.default for f in fields(EngineConfig) if f.name in ("enable_lora", "max_lora_rank")}
    ServedModels(base_name, root, enable_lora=engine_args.get("enable_lora", defaults["enable_lora"]),
                 max_lora_rank=engine_args.get("max_lora_rank", defaults["max_lora_rank"]),
                 lora_modules=lora_modules, allowed_dir=allowed_dir)
