"""A Ray Data column that names each row's LoRA adapter (``lora_column``).

A row's value is the adapter's name: a key of ``lora_modules`` (``{name: path}``)
when the job gives them, else the adapter's path itself (a local PEFT directory
or a Hub repo id; a Ray job owns its disk, as ``LLM`` callers do). ``None``, an
empty string or a missing value (pandas' NaN) is the base model. Each distinct
adapter gets one id for the actor's life, so rows naming it share the loaded
adapter and its cached encoder outputs and prompt blocks. An unknown name is
that row's error; the other rows go on.
"""

from __future__ import annotations

import itertools
from typing import Any

from tandem.integrations.ray.batches import column, plain
from tandem.lora.request import LoRARequest


class LoRAColumn:
    def __init__(self, name: str | None, modules: dict[str, str] | None, engine_args: dict[str, Any]) -> None:
        if modules is not None and name is None:
            raise ValueError("lora_modules without lora_column: name the column whose values pick the adapters")
        if name is not None and not engine_args.get("enable_lora"):
            raise ValueError(f"lora_column={name!r} needs enable_lora=True among the engine options")
        if modules is not None and (not isinstance(modules, dict)
                                    or not all(isinstance(k, str) and isinstance(v, str) for k, v in modules.items())):
            raise TypeError(f"lora_modules must be a dict of adapter name -> path, got {modules!r:.200}")
        self.name, self.modules = name, modules
        self._ids = itertools.count(1)
        self._known: dict[str, LoRARequest] = {}

    def values(self, cols: dict[str, Any]) -> Any:
        """The batch's column (None without ``lora_column``)."""
        return None if self.name is None else column(cols, self.name, "lora_column")

    def request(self, values: Any, i: int) -> LoRARequest | None:
        """Row ``i``'s adapter; ``ValueError`` / ``TypeError`` naming a bad value."""
        if values is None:
            return None
        value = plain(values[i])
        if value is None or value == "" or (isinstance(value, float) and value != value):
            return None
        if not isinstance(value, str):
            raise TypeError(f"{self.name}: an adapter name must be a str, got {type(value).__name__}: {value!r:.200}")
        lora = self._known.get(value)
        if lora is None:
            if self.modules is not None and value not in self.modules:
                raise ValueError(f"{self.name}: no LoRA adapter named {value[:200]!r} in lora_modules "
                                 f"({', '.join(repr(k) for k in list(self.modules)[:20])})")
            path = value if self.modules is None else self.modules[value]
            lora = self._known[value] = LoRARequest(value, next(self._ids), path)
        return lora
