"""The interface model authors implement."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from tandem.core.attention import AttentionBackend, AttentionMetadata, KVCacheSpec
from tandem.core.inputs import EncoderInputs, PromptSlot

if TYPE_CHECKING:
    from transformers import PretrainedConfig


@dataclass(frozen=True)
class ModelContext:
    """What a model needs to build its layers: the attention backend, dtype, device."""

    attn_backend: type[AttentionBackend]
    dtype: torch.dtype
    device: torch.device


class EncoderDecoderModel(nn.Module, ABC):
    """An encoder/decoder model tandem can serve.

    ``forward`` takes packed decoder tokens (``input_ids``, ``positions``:
    ``[num_tokens]``) and the packed encoder tokens of the groups whose
    encoder runs this step (``[num_encoder_tokens]``, possibly empty), one KV
    cache tensor per decoder layer, and the backend's metadata. It returns
    decoder hidden states ``[num_tokens, hidden]``. When no encoder runs, the
    cross-attention cache is the only encoder information the decoder reads.
    """

    def __init__(self, config: "PretrainedConfig", ctx: ModelContext) -> None:
        super().__init__()
        self.config = config
        self.ctx = ctx

    @abstractmethod
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        encoder_input_ids: torch.Tensor,
        encoder_positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor: ...

    @abstractmethod
    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[num_seqs, hidden] -> [num_seqs, vocab]`` logits."""
        ...

    @abstractmethod
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Consume checkpoint ``(name, tensor)`` pairs; return the parameter names filled."""
        ...

    def encoder_modules(self) -> list[nn.Module]:
        """The submodules that run only over whole encoder inputs (many rows per call:
        the source's tokens, Whisper's 1500 frames), never in a decode step. Their
        linear layers are packed for large GEMMs whatever ``max_num_seqs`` is
        (``tandem.core.layers.kernel_setup``). By default every submodule whose
        attribute name is ``encoder`` (BART's ``model.encoder``, T5's ``encoder``);
        a model that names its encoder otherwise overrides this."""
        return [m for name, m in self.named_modules() if name.rsplit(".", 1)[-1] == "encoder"]

    @classmethod
    @abstractmethod
    def kv_cache_spec(cls, config: "PretrainedConfig") -> KVCacheSpec: ...

    @classmethod
    def attn_features(cls, config: "PretrainedConfig") -> frozenset[str]:
        """Attention features beyond plain scaled dot-product attention this model needs
        from its backend (``BackendCapabilities.attn_features``), e.g.
        ``{"relative_position_bias"}`` (T5). Backends that do not declare them are passed
        over; naming one is an error that says so. None by default."""
        return frozenset()

    # Integer config fields that set the model's size; size errors name them with their values.
    config_size_fields: tuple[str, ...] = ()

    @classmethod
    def check_config(cls, config: "PretrainedConfig") -> None:
        """Raise ``ValueError`` naming the field and its value when the model cannot be built
        from ``config``. Runs before anything is built or allocated: arithmetic only."""

    @classmethod
    def check_size_fields(cls, config: "PretrainedConfig") -> None:
        """``ValueError`` naming the first of :attr:`config_size_fields` that is not a positive
        integer; a ``check_config`` override calls it first."""
        for field in cls.config_size_fields:
            value = getattr(config, field, None)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"config.json: {field}={value!r} must be a positive integer")

    # Methods a frontend may run on the loaded model between steps, by name with plain
    # arguments (tandem/core/model_call.py): each runs on every tensor-parallel rank and
    # must return the whole answer on rank 0 (gathering what its shard holds).
    model_calls: tuple[str, ...] = ()

    # Config fields tensor parallelism splits across ranks (heads, FFN widths): each must be
    # divisible by ``tensor_parallel_size``. The vocabulary is padded per rank, never split unevenly.
    tensor_parallel_fields: tuple[str, ...] = ()

    @classmethod
    def check_tensor_parallel(cls, config: "PretrainedConfig", tp_size: int) -> None:
        """``ValueError`` naming the first of :attr:`tensor_parallel_fields` that ``tp_size``
        does not divide. Arithmetic only, before any rank is started."""
        for field in cls.tensor_parallel_fields:
            value = getattr(config, field, None)
            if isinstance(value, int) and value % tp_size:
                raise ValueError(
                    f"config.json: {field}={value} is not divisible by tensor_parallel_size={tp_size}; each rank "
                    f"holds an equal share of the {field.replace('_', ' ')}"
                )

    @classmethod
    def num_parameters(cls, config: "PretrainedConfig") -> int | None:
        """Parameter elements a checkpoint must store for ``config`` (tied weights counted
        once, buffers not at all), or None when unknown. Called after :meth:`check_config`;
        the loader rejects configs that the weight files or the device memory cannot hold."""
        return None

    @classmethod
    def get_encoder_inputs(cls, config: "PretrainedConfig", token_ids: list[int]) -> EncoderInputs:
        """Turn an encoder prompt into what this model's encoder runs on, and say how
        many encoder positions it yields (cross tables are sized by that). Text
        encoders: the token ids, one position each. Override for other inputs."""
        return EncoderInputs.from_token_ids(token_ids)

    @classmethod
    def get_audio_encoder_inputs(cls, config: "PretrainedConfig", audio: Any, sampling_rate: int | None) -> EncoderInputs:
        """Turn an audio encoder prompt (``{"audio": ..., "sampling_rate": ...}``: a file
        path, a file's bytes, or samples with their rate) into this model's encoder inputs
        (``features`` set), through the model's own audio processing; ``ValueError``
        names what is wrong. Audio models override this; the default says the model
        takes no audio."""
        raise ValueError(f"{cls.__name__} takes no audio encoder prompt")

    @classmethod
    def max_encoder_len(cls, config: "PretrainedConfig") -> int:
        """Most encoder positions (``EncoderInputs.num_positions``) a request may have."""
        return int(config.max_position_embeddings)

    @classmethod
    def max_decoder_len(cls, config: "PretrainedConfig") -> int:
        return int(config.max_position_embeddings)

    @classmethod
    def vocab_size(cls, config: "PretrainedConfig") -> int:
        return int(config.vocab_size)

    @classmethod
    def get_default_decoder_prompt(cls, config: "PretrainedConfig") -> list[int]:
        """Decoder prompt for requests that give none: ``<DEC><BOS>``."""
        start = cls.decoder_start_token_id(config)
        bos = config.bos_token_id
        return [start] if bos is None else [start, bos]

    @classmethod
    def non_text_token_ids(cls, config: "PretrainedConfig", generation_config) -> Collection[int]:
        """Tokens an output's ``text`` leaves out (they stay in its ``token_ids``), as the
        model's HF tokenizer decodes by default (Whisper: timestamps). None by default."""
        return ()

    @classmethod
    def default_decoder_prompt(cls, config: "PretrainedConfig", generation_config) -> tuple[list[int], "PromptSlot | None"]:
        """The decoder prompt of a request that gives none, and optionally a prompt slot
        the model fills in the request's first step (Whisper: the detected language).
        ``generation_config`` is the checkpoint's transformers ``GenerationConfig`` (or
        None). The default: :meth:`get_default_decoder_prompt`, no slot."""
        return cls.get_default_decoder_prompt(config), None

    @classmethod
    def process_decoder_prompt(cls, config: "PretrainedConfig", token_ids: list[int]) -> list[int]:
        """Prepend ``<DEC>`` unless the given decoder prompt starts with it."""
        start = cls.decoder_start_token_id(config)
        if token_ids and token_ids[0] == start:
            return list(token_ids)
        return [start, *token_ids]

    @classmethod
    def decoder_start_token_id(cls, config: "PretrainedConfig") -> int:
        start = getattr(config, "decoder_start_token_id", None)
        if start is None:
            raise ValueError(f"{cls.__name__}: config has no decoder_start_token_id")
        return int(start)
