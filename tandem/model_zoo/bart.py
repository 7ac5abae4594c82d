"""BART and the models that share its shape (``BartVariant`` flags: mBART, M2M100 / NLLB and
Pegasus in ``bart_family.py``, Marian in the ``tandem-marian`` example plugin).

Class structure: ``BartForConditionalGeneration`` (weights, logits) ->
``BartModel`` (shared embeddings, encoder, decoder) -> ``BartEncoder`` /
``BartDecoder`` -> layers -> ``BartEncoderAttention``,
``BartDecoderSelfAttention``, ``BartCrossAttention``. Self-attention projects
Q/K/V with one fused GEMM; cross-attention projects Q from the decoder and
K/V (one fused GEMM) from the encoder output only, on the step the encoder
runs. Afterwards the decoder reads cross K/V from the paged cache.

Projections and embeddings are tensor-parallel layers (``tandem.core.layers``):
attention heads and FFN columns split across ranks, outputs summed after
``out_proj`` / ``fc2``. Their parameters load themselves; this file only says how
HF names map (``packed_modules_mapping``, :meth:`hf_to_tandem_name`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn
from transformers.activations import ACT2FN

from tandem.core.attention import AttentionMetadata, AttentionType
from tandem.core.layers import (
    Attention,
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from tandem.core.model import EncoderDecoderModel, KVCacheSpec, ModelContext
from tandem.core.weight_loading import load_checkpoint
from tandem.model_zoo.positions import (  # noqa: F401  (sinusoidal_table: re-exported for plugins)
    BartLearnedPositionalEmbedding,
    BartSinusoidalPositionalEmbedding,
    make_position_embedding,
    sinusoidal_table,
)


@dataclass(frozen=True)
class BartVariant:
    """Where the BART family members differ."""

    normalize_before: bool = False  # pre-LN layers (mBART, Pegasus)
    layernorm_embedding: bool = True  # LN after embeddings (BART, mBART)
    final_layer_norm: bool = False  # LN after the last encoder/decoder layer (mBART, Pegasus)
    position_offset: int = 2  # learned positions are stored shifted by 2 in BART
    sinusoidal_positions: bool = False  # fixed sin/cos table instead of learned positions (Marian, Pegasus)
    fairseq_positions: bool = False  # M2M100's sin/cos table, from pad_token_id + 1 (position_offset unused)

    def __post_init__(self) -> None:
        if self.sinusoidal_positions and self.fairseq_positions:
            raise ValueError("BartVariant: sinusoidal_positions and fairseq_positions exclude each other")


class _SelfAttention(nn.Module):
    attn_type: AttentionType

    def __init__(self, dim: int, num_heads: int, ctx: ModelContext) -> None:
        super().__init__()
        head_size = dim // num_heads
        self.qkv_proj = QKVParallelLinear(dim, head_size, num_heads)
        self.out_proj = RowParallelLinear(dim, dim)
        num_heads = self.qkv_proj.num_heads  # this rank's
        self.split = [self.qkv_proj.q_size, self.qkv_proj.kv_size, self.qkv_proj.kv_size]
        self.attn = Attention(num_heads, head_size, head_size**-0.5, ctx.attn_backend, self.attn_type)

    def forward(self, hidden: torch.Tensor, kv_cache, attn_metadata: AttentionMetadata,
                residual: torch.Tensor | None = None) -> torch.Tensor:
        """``residual``: added to the output (in ``out_proj``'s GEMM where its kernel can)."""
        q, k, v = self.qkv_proj(hidden).split(self.split, dim=-1)
        return self.out_proj(self.attn(q, k, v, kv_cache, attn_metadata), residual=residual)


class BartEncoderAttention(_SelfAttention):
    attn_type = AttentionType.ENCODER


class BartDecoderSelfAttention(_SelfAttention):
    attn_type = AttentionType.DECODER


class BartCrossAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int, ctx: ModelContext) -> None:
        super().__init__()
        head_size = dim // num_heads
        self.q_proj = ColumnParallelLinear(dim, dim)
        self.kv_proj = MergedColumnParallelLinear(dim, [dim, dim])
        self.out_proj = RowParallelLinear(dim, dim)
        num_heads = self.q_proj.output_size // head_size  # this rank's
        self.attn = Attention(
            num_heads, head_size, head_size**-0.5, ctx.attn_backend, AttentionType.ENCODER_DECODER
        )

    def forward(
        self,
        hidden: torch.Tensor,
        encoder_hidden: torch.Tensor | None,
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        q = self.q_proj(hidden)
        k = v = None
        if encoder_hidden is not None:
            k, v = self.kv_proj(encoder_hidden).split(self.kv_proj.output_partition_sizes, dim=-1)
        return self.out_proj(self.attn(q, k, v, kv_cache, attn_metadata))


def _ffn(dim: int, ffn_dim: int) -> tuple[ColumnParallelLinear, RowParallelLinear]:
    return ColumnParallelLinear(dim, ffn_dim), RowParallelLinear(ffn_dim, dim)


# HF activation names whose function a linear layer can fuse into its GEMM ("gelu" is HF's exact erf GELU).
FUSABLE_ACTIVATIONS = ("gelu", "relu")


class _FFNMixin:
    """``fc2(act(fc1(h)))`` with the activation fused into fc1 where its kernel can."""

    def _set_activation(self, name: str) -> None:
        self.act = ACT2FN[name]
        self.act_name = name if name in FUSABLE_ACTIVATIONS else None

    def ffn(self, h: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        if self.act_name is not None:
            return self.fc2(self.fc1(h, activation=self.act_name), residual=residual)
        return self.fc2(self.act(self.fc1(h)), residual=residual)


class BartEncoderLayer(_FFNMixin, nn.Module):
    def __init__(self, config, variant: BartVariant, ctx: ModelContext) -> None:
        super().__init__()
        dim = config.d_model
        self.pre_ln = variant.normalize_before
        self.self_attn = BartEncoderAttention(dim, config.encoder_attention_heads, ctx)
        self.self_attn_layer_norm = nn.LayerNorm(dim)
        self.fc1, self.fc2 = _ffn(dim, config.encoder_ffn_dim)
        self._set_activation(config.activation_function)
        self.final_layer_norm = nn.LayerNorm(dim)

    def forward(self, h: torch.Tensor, attn_metadata: AttentionMetadata) -> torch.Tensor:
        # The residual adds happen in out_proj's and fc2's GEMM epilogues (one pass fewer
        # over [tokens, d] each; equal to h + ...: see RowParallelLinear.forward).
        if self.pre_ln:
            h = self.self_attn(self.self_attn_layer_norm(h), None, attn_metadata, residual=h)
            return self.ffn(self.final_layer_norm(h), residual=h)
        h = self.self_attn_layer_norm(self.self_attn(h, None, attn_metadata, residual=h))
        return self.final_layer_norm(self.ffn(h, residual=h))


class BartDecoderLayer(_FFNMixin, nn.Module):
    def __init__(self, config, variant: BartVariant, ctx: ModelContext) -> None:
        super().__init__()
        dim = config.d_model
        self.pre_ln = variant.normalize_before
        self.self_attn = BartDecoderSelfAttention(dim, config.decoder_attention_heads, ctx)
        self.self_attn_layer_norm = nn.LayerNorm(dim)
        self.encoder_attn = BartCrossAttention(dim, config.decoder_attention_heads, ctx)
        self.encoder_attn_layer_norm = nn.LayerNorm(dim)
        self.fc1, self.fc2 = _ffn(dim, config.decoder_ffn_dim)
        self._set_activation(config.activation_function)
        self.final_layer_norm = nn.LayerNorm(dim)

    def forward(self, h, encoder_hidden, kv_cache, attn_metadata) -> torch.Tensor:
        if self.pre_ln:
            h = h + self.self_attn(self.self_attn_layer_norm(h), kv_cache, attn_metadata)
            h = h + self.encoder_attn(
                self.encoder_attn_layer_norm(h), encoder_hidden, kv_cache, attn_metadata
            )
            return h + self.ffn(self.final_layer_norm(h))
        h = self.self_attn_layer_norm(h + self.self_attn(h, kv_cache, attn_metadata))
        h = self.encoder_attn_layer_norm(h + self.encoder_attn(h, encoder_hidden, kv_cache, attn_metadata))
        return self.final_layer_norm(h + self.ffn(h))


class _Stack(nn.Module):
    """Embedding front-end shared by the encoder and the decoder."""

    def __init__(self, config, variant: BartVariant, embed_tokens: VocabParallelEmbedding) -> None:
        super().__init__()
        dim = config.d_model
        self.embed_scale = math.sqrt(dim) if config.scale_embedding else 1.0
        self.embed_tokens = embed_tokens
        self.embed_positions = make_position_embedding(config, variant)
        self.layernorm_embedding = nn.LayerNorm(dim) if variant.layernorm_embedding else None
        self.layer_norm = nn.LayerNorm(dim) if variant.final_layer_norm else None

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(input_ids) * self.embed_scale + self.embed_positions(positions, input_ids)
        return self.layernorm_embedding(h) if self.layernorm_embedding is not None else h

    def finish(self, h: torch.Tensor) -> torch.Tensor:
        return self.layer_norm(h) if self.layer_norm is not None else h


class BartEncoder(_Stack):
    def __init__(self, config, variant, embed_tokens, ctx: ModelContext) -> None:
        super().__init__(config, variant, embed_tokens)
        self.layers = nn.ModuleList(BartEncoderLayer(config, variant, ctx) for _ in range(config.encoder_layers))

    def forward(self, input_ids, positions, attn_metadata) -> torch.Tensor:
        h = self.embed(input_ids, positions)
        for layer in self.layers:
            h = layer(h, attn_metadata)
        return self.finish(h)


class BartDecoder(_Stack):
    def __init__(self, config, variant, embed_tokens, ctx: ModelContext) -> None:
        super().__init__(config, variant, embed_tokens)
        self.layers = nn.ModuleList(BartDecoderLayer(config, variant, ctx) for _ in range(config.decoder_layers))

    def forward(self, input_ids, positions, encoder_hidden, kv_caches, attn_metadata) -> torch.Tensor:
        h = self.embed(input_ids, positions)
        for layer, kv_cache in zip(self.layers, kv_caches):
            h = layer(h, encoder_hidden, kv_cache, attn_metadata)
        return self.finish(h)


class BartModel(nn.Module):
    def __init__(self, config, variant: BartVariant, ctx: ModelContext) -> None:
        super().__init__()
        self.shared = VocabParallelEmbedding(config.vocab_size, config.d_model)
        self.encoder = BartEncoder(config, variant, self.shared, ctx)
        self.decoder = BartDecoder(config, variant, self.shared, ctx)


class BartForConditionalGeneration(EncoderDecoderModel):
    variant = BartVariant()
    logits_bias_nonzero = True  # load_weights finds out; until then the bias is added
    # HF checkpoints keep q/k/v (and cross-attention k/v) apart; we fuse them.
    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "kv_proj": ["k_proj", "v_proj"]}

    def __init__(self, config, ctx: ModelContext) -> None:
        super().__init__(config, ctx)
        self.model = BartModel(config, self.variant, ctx)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", True))
        if not self.tie_word_embeddings:
            self.lm_head = ParallelLMHead(config.vocab_size, config.d_model)
        self.register_buffer("final_logits_bias", torch.zeros(1, config.vocab_size))

    @classmethod
    def kv_cache_spec(cls, config) -> KVCacheSpec:
        heads = config.decoder_attention_heads
        return KVCacheSpec(config.decoder_layers, heads, config.d_model // heads)

    tensor_parallel_fields = ("encoder_attention_heads", "decoder_attention_heads", "encoder_ffn_dim", "decoder_ffn_dim")
    config_size_fields = (
        "d_model",
        "encoder_layers",
        "decoder_layers",
        "encoder_attention_heads",
        "decoder_attention_heads",
        "encoder_ffn_dim",
        "decoder_ffn_dim",
        "vocab_size",
        "max_position_embeddings",
    )

    @classmethod
    def check_config(cls, config) -> None:
        cls.check_size_fields(config)
        for field in ("encoder_attention_heads", "decoder_attention_heads"):
            heads = getattr(config, field)
            if config.d_model % heads:
                raise ValueError(f"config.json: d_model={config.d_model} is not divisible by {field}={heads}")
        act = getattr(config, "activation_function", None)
        if not isinstance(act, str) or act not in ACT2FN:
            known = ", ".join(sorted(ACT2FN))
            raise ValueError(f"config.json: activation_function={act!r} is not one of {known}")

    @classmethod
    def num_parameters(cls, config) -> int:
        """Exactly the parameters ``__init__`` creates, which ``load_weights`` requires."""
        d, v = config.d_model, config.vocab_size

        def linear(n_in: int, n_out: int) -> int:
            return n_in * n_out + n_out

        def ffn(ffn_dim: int) -> int:
            return linear(d, ffn_dim) + linear(ffn_dim, d)

        var = cls.variant
        norm, attn = 2 * d, 4 * linear(d, d)  # self-attention: q, k, v, out; cross: q, kv (2), out
        computed = var.sinusoidal_positions or var.fairseq_positions
        stack = 0 if computed else (config.max_position_embeddings + var.position_offset) * d
        stack += norm * (var.layernorm_embedding + var.final_layer_norm)
        encoder_layer = attn + ffn(config.encoder_ffn_dim) + 2 * norm
        decoder_layer = 2 * attn + ffn(config.decoder_ffn_dim) + 3 * norm
        total = v * d + 2 * stack
        total += config.encoder_layers * encoder_layer + config.decoder_layers * decoder_layer
        tied = bool(getattr(config, "tie_word_embeddings", True))  # as __init__ decides
        return total if tied else total + v * d

    def forward(self, input_ids, positions, encoder_input_ids, encoder_positions, kv_caches, attn_metadata):
        encoder_hidden = None
        if encoder_input_ids.numel():
            encoder_hidden = self.model.encoder(encoder_input_ids, encoder_positions, attn_metadata)
        return self.model.decoder(input_ids, positions, encoder_hidden, kv_caches, attn_metadata)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        head = self.model.shared if self.tie_word_embeddings else self.lm_head
        return head.logits(hidden_states, bias=self.final_logits_bias if self.logits_bias_nonzero else None)

    def hf_to_tandem_name(self, name: str) -> str | None:
        """Map a HF name onto ours (before packing q/k/v)."""
        if name.startswith(("encoder.", "decoder.", "shared.")):
            name = "model." + name  # saved from BartModel rather than ...ForConditionalGeneration
        if name == "lm_head.weight" and self.tie_word_embeddings:
            return "model.shared.weight"
        if name in ("model.encoder.embed_tokens.weight", "model.decoder.embed_tokens.weight"):
            return "model.shared.weight"
        return name

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        # Buffers a checkpoint may omit; one that has them overwrites these.
        self.final_logits_bias.zero_()
        for module in self.modules():
            if isinstance(module, BartSinusoidalPositionalEmbedding):
                module.reset_table()
        loaded = load_checkpoint(self, weights)
        # BART checkpoints (bart-base, bart-large-cnn, ...) ship an all-zero
        # final_logits_bias: adding it is a no-op over [seqs, vocab] every step.
        self.logits_bias_nonzero = bool(self.final_logits_bias.any())
        return loaded
