"""``LoRARequest``: which adapter a request runs with, as vLLM spells it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """A PEFT LoRA adapter a request runs with.

    ``lora_name``: the name it is known by (the server's model name for it);
    ``lora_int_id``: an integer >= 1 that identifies the adapter (two requests with the
    same id share the loaded adapter; 0 is the base model); ``lora_path``: a local PEFT
    adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``) or a
    Hugging Face Hub repo id, resolved as checkpoints are.
    """

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name={self.lora_name!r}: must be a non-empty string")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id={self.lora_int_id!r}: must be an integer >= 1 (0 is the base model)")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"lora_path={self.lora_path!r}: must be a local adapter directory or a Hub repo id")

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path


def check_lora_request(lora_request: object, *, enable_lora: bool, draft_model: str | None = None) -> None:
    """Raise ``ValueError`` / ``TypeError`` unless the engine can serve a request with
    ``lora_request`` (None: the base model, always served). ``draft_model``: the engine's
    speculative draft checkpoint, if any: a draft has no adapter, so its proposals would
    be the base model's, and such requests are refused rather than served slowly."""
    if lora_request is None:
        return
    if not isinstance(lora_request, LoRARequest):
        raise TypeError(f"lora_request must be a tandem.LoRARequest or None, got {type(lora_request).__name__}: "
                        f"{lora_request!r}")
    if not enable_lora:
        raise ValueError(f"lora_request {lora_request.lora_name!r}: LoRA is not enabled in this engine; "
                         "build it with enable_lora=True (tandem serve --enable-lora)")
    if draft_model is not None:
        raise ValueError(f"lora_request {lora_request.lora_name!r}: the engine speculates with a draft model "
                         f"({draft_model}), which has no adapter; LoRA requests are not served with "
                         "speculative_config method 'draft_model' (the 'ngram' method works with adapters)")


def lora_list(lora_request: object, n: int, what: str) -> list[LoRARequest | None]:
    """A frontend's ``lora_request`` argument for ``n`` inputs: one adapter (or None) for
    all, or a list of one (or None) per input. Another type is a ``TypeError`` naming it,
    a list of another length a ``ValueError`` (for the whole call, as sampling params are)."""
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * n
    if not isinstance(lora_request, (list, tuple)):
        raise TypeError(f"lora_request must be a LoRARequest, None, or a list of them (one per input), got "
                        f"{type(lora_request).__name__}: {_short(lora_request)}")
    bad = [(i, r) for i, r in enumerate(lora_request) if r is not None and not isinstance(r, LoRARequest)]
    if bad:
        i, r = bad[0]
        raise TypeError(f"lora_request[{i}] must be a LoRARequest or None, got {type(r).__name__}: {_short(r)}")
    if len(lora_request) != n:
        raise ValueError(f"got {len(lora_request)} LoRA requests for {n} {what}; pass one, or one per input")
    return list(lora_request)


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
