"""tandem: a pluggable inference engine for encoder/decoder transformers.

The names exported here are the public API, for users and for plugin authors.
"""

from importlib.metadata import PackageNotFoundError, version

from tandem.core.attention import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadata,
    AttentionMetadataBuilder,
    AttentionType,
    BackendCapabilities,
    StepInputs,
)
from tandem.core.inputs import ExplicitEncoderDecoderPrompt, TextPrompt, TokensPrompt
from tandem.core.layers import Attention
from tandem.core.model import EncoderDecoderModel, KVCacheSpec, ModelContext
from tandem.core.outputs import CompletionOutput, RequestOutput
from tandem.core.engine import LLMEngine
from tandem.core.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams
from tandem.entrypoints.async_llm import AsyncLLM, EngineDeadError
from tandem.entrypoints.llm import LLM
from tandem.logger import configure_library_logging
from tandem.plugins.hookspecs import hookimpl

configure_library_logging()

try:
    __version__ = version("tandem-engine")
except PackageNotFoundError:  # a source tree on sys.path without an install
    __version__ = "0.0.0+unknown"

__all__ = [
    "LLM",
    "AsyncLLM",
    "EngineDeadError",
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
    "KVCacheSpec",
    "ModelContext",
    "RequestOutput",
    "RequestOutputKind",
    "SamplingParams",
    "BeamSearchParams",
    "StepInputs",
    "TextPrompt",
    "TokensPrompt",
    "hookimpl",
]
