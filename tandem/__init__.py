"""tandem: a pluggable inference engine for encoder/decoder transformers."""

from tandem.core.inputs import ExplicitEncoderDecoderPrompt, TextPrompt, TokensPrompt
from tandem.core.outputs import CompletionOutput, RequestOutput
from tandem.core.sampling_params import SamplingParams
from tandem.entrypoints.llm import LLM

__version__ = "0.1.0"

__all__ = [
    "LLM",
    "CompletionOutput",
    "ExplicitEncoderDecoderPrompt",
    "RequestOutput",
    "SamplingParams",
    "TextPrompt",
    "TokensPrompt",
]
