"""tandem: a pluggable inference engine for encoder/decoder transformers.

The names exported here are the public API, for users and for plugin authors.
They load on first use: ``import tandem`` (and a backend plugin's
``from tandem import AttentionBackend``) imports neither the engine nor the
scheduler, worker, models or kernels.
"""

from __future__ import annotations

import importlib
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING

from tandem.logger import configure_library_logging

if TYPE_CHECKING:
    from tandem.core.attention import (
        AttentionBackend,
        AttentionImpl,
        AttentionMetadata,
        AttentionMetadataBuilder,
        AttentionType,
        BackendCapabilities,
        SizeRule,
        StepInputs,
    )
    from tandem.core.engine import LLMEngine
    from tandem.core.inputs import ExplicitEncoderDecoderPrompt, PromptType, TextPrompt, TokensPrompt
    from tandem.core.layers import Attention
    from tandem.core.model import EncoderDecoderModel, KVCacheSpec, ModelContext
    from tandem.core.outputs import CompletionOutput, RequestOutput
    from tandem.core.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams
    from tandem.core.structured_params import StructuredOutputsParams
    from tandem.entrypoints.async_llm import AsyncLLM, EngineDeadError
    from tandem.entrypoints.llm import LLM
    from tandem.entrypoints.vllm_compat import EngineArgs
    from tandem.lora import LoRARequest
    from tandem.plugins.hookspecs import hookimpl

# Public name -> the module that defines it.
_LAZY = {
    "AttentionBackend": "tandem.core.attention",
    "AttentionImpl": "tandem.core.attention",
    "AttentionMetadata": "tandem.core.attention",
    "AttentionMetadataBuilder": "tandem.core.attention",
    "AttentionType": "tandem.core.attention",
    "BackendCapabilities": "tandem.core.attention",
    "SizeRule": "tandem.core.attention",
    "StepInputs": "tandem.core.attention",
    "ExplicitEncoderDecoderPrompt": "tandem.core.inputs",
    "PromptType": "tandem.core.inputs",
    "TextPrompt": "tandem.core.inputs",
    "TokensPrompt": "tandem.core.inputs",
    "Attention": "tandem.core.layers",
    "EncoderDecoderModel": "tandem.core.model",
    "KVCacheSpec": "tandem.core.model",
    "ModelContext": "tandem.core.model",
    "CompletionOutput": "tandem.core.outputs",
    "RequestOutput": "tandem.core.outputs",
    "LLMEngine": "tandem.core.engine",
    "BeamSearchParams": "tandem.core.sampling_params",
    "RequestOutputKind": "tandem.core.sampling_params",
    "SamplingParams": "tandem.core.sampling_params",
    "StructuredOutputsParams": "tandem.core.structured_params",
    "AsyncLLM": "tandem.entrypoints.async_llm",
    "EngineDeadError": "tandem.entrypoints.async_llm",
    "LLM": "tandem.entrypoints.llm",
    "EngineArgs": "tandem.entrypoints.vllm_compat",
    "hookimpl": "tandem.plugins.hookspecs",
    "LoRARequest": "tandem.lora",
}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'tandem' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


configure_library_logging()

try:
    __version__ = version("tandem-engine")
except PackageNotFoundError:  # a source tree on sys.path without an install
    __version__ = "0.0.0+unknown"

__all__ = [
    "LLM",
    "LoRARequest",
    "AsyncLLM",
    "EngineDeadError",
    "EngineArgs",
    "LLMEngine",
    "Attention",
    "AttentionBackend",
    "AttentionImpl",
    "AttentionMetadata",
    "AttentionMetadataBuilder",
    "AttentionType",
    "BackendCapabilities",
    "CompletionOutput",
    "EncoderDecoderModel",
    "ExplicitEncoderDecoderPrompt",
    "PromptType",
    "KVCacheSpec",
    "ModelContext",
    "RequestOutput",
    "RequestOutputKind",
    "SamplingParams",
    "StructuredOutputsParams",
    "BeamSearchParams",
    "SizeRule",
    "StepInputs",
    "TextPrompt",
    "TokensPrompt",
    "hookimpl",
]
