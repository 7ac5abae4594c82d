"""T5 (v1.0), T5 v1.1 / Flan-T5, mT5 and UL2: ``T5ForConditionalGeneration``.

Where T5 differs from BART: RMS layer norm (no mean, no bias) before each sublayer and
after each stack; no position embeddings but a learned bucketed relative position
bias, held by the first layer's self-attention of each stack and shared by all its
layers (bidirectional in the encoder, causal in decoder self-attention, none in cross
attention), which reaches the backend as the ``"relative_position_bias"`` feature
(:mod:`tandem.core.relative_position`); no ``1/sqrt(d)`` score scaling; no biases in
any projection; a ReLU FFN (``feed_forward_proj="relu"``, v1.0) or a gated one
(``"gated-gelu"``: v1.1, Flan, mT5; ``"gated-silu"``: UL2; any ``[gated-]<activation>``
that transformers' ``ACT2FN`` names, as ``T5Config`` accepts); decoding starts from the pad token.

The head: v1.0 ties it to the embeddings and scales the decoder output by
``d_model**-0.5`` first; v1.1 / Flan / mT5 / UL2 save ``tie_word_embeddings: false`` and a
head of their own, unscaled. transformers 5 keeps that flag as ``scale_decoder_outputs``
and always reports ``tie_word_embeddings=True`` (``MT5Config`` keeps neither: mT5 is
unscaled always); :func:`_scaled_head` reads them.

Module names follow HF's (``encoder.block.{i}.layer.{j}``) so the weight mapping is a
few renames; q/k/v (cross: k/v) and the gated FFN's ``wi_0``/``wi_1`` are fused.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

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
    get_tp_group,
)
from tandem.core.model import EncoderDecoderModel, KVCacheSpec, ModelContext
from tandem.core.relative_position import FEATURE as RELATIVE_POSITION_BIAS
from tandem.core.relative_position import RelativePositionBias
from tandem.core.weight_loading import load_checkpoint

# HF renames ours -> theirs differ only in these module names.
_HF_MODULES = {"q": "q_proj", "k": "k_proj", "v": "v_proj"}
FUSABLE_ACTIVATIONS = ("relu", "gelu")  # those a linear layer's kernel fuses ("gelu": erf GELU)
DEFAULT_MAX_LEN = 512  # T5's positions are relative: no table bounds them; 512 is what it was trained on


def _scaled_head(config) -> bool:
    """Whether the head is v1.0's (tied, decoder output scaled by ``d_model**-0.5``).
    mT5 never is: every mT5 checkpoint has a head of its own, and transformers 5's
    ``MT5Config`` forgets the flag (it reports ``tie_word_embeddings=True`` and has no
    ``scale_decoder_outputs``) while its model never scales."""
    if getattr(config, "model_type", None) == "mt5":
        return False
    scaled = getattr(config, "scale_decoder_outputs", None)
    if scaled is not None:
        return bool(scaled)
    return bool(getattr(config, "tie_word_embeddings", True))


def _activation(config) -> tuple[str, bool]:
    """(HF activation name, gated) from ``feed_forward_proj``, as T5Config derives them."""
    proj = getattr(config, "feed_forward_proj", "relu")
    parts = proj.split("-") if isinstance(proj, str) else []
    if not parts or len(parts) > 2 or (len(parts) == 2 and parts[0] != "gated"):
        raise ValueError(
            f"config.json: feed_forward_proj={proj!r} is not an activation name or 'gated-<activation>' "
            "(e.g. 'relu', 'gated-gelu')"
        )
    act = "gelu_new" if proj == "gated-gelu" else parts[-1]  # HF's historical alias: tanh GELU
    if act not in ACT2FN:
        raise ValueError(f"config.json: feed_forward_proj={proj!r}: activation {act!r} is not one of "
                         f"{', '.join(sorted(ACT2FN))}")
    return act, len(parts) == 2


class T5LayerNorm(nn.Module):
    """RMS norm: ``weight * h / sqrt(mean(h^2) + eps)``, the mean of squares in float32."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        variance = h.to(torch.float32).pow(2).mean(-1, keepdim=True)
        return self.weight * (h * torch.rsqrt(variance + self.eps)).to(self.weight.dtype)


class T5SelfAttention(nn.Module):
    def __init__(self, config, attn_type: AttentionType, ctx: ModelContext) -> None:
        super().__init__()
        d, heads, d_kv = config.d_model, config.num_heads, config.d_kv
        self.qkv_proj = QKVParallelLinear(d, d_kv, heads, bias=False)
        self.o = RowParallelLinear(heads * d_kv, d, bias=False)
        self.split = [self.qkv_proj.q_size, self.qkv_proj.kv_size, self.qkv_proj.kv_size]
        self.attn = Attention(self.qkv_proj.num_heads, d_kv, 1.0, ctx.attn_backend, attn_type)

    def forward(self, h, kv_cache, attn_metadata, position_bias: RelativePositionBias) -> torch.Tensor:
        q, k, v = self.qkv_proj(h).split(self.split, dim=-1)
        return self.o(self.attn(q, k, v, kv_cache, attn_metadata, position_bias=position_bias))


class T5CrossAttention(nn.Module):
    def __init__(self, config, ctx: ModelContext) -> None:
        super().__init__()
        d, heads, d_kv = config.d_model, config.num_heads, config.d_kv
        inner = heads * d_kv
        self.q = ColumnParallelLinear(d, inner, bias=False)
        self.kv_proj = MergedColumnParallelLinear(d, [inner, inner], bias=False)
        self.o = RowParallelLinear(inner, d, bias=False)
        self.attn = Attention(self.q.output_size // d_kv, d_kv, 1.0, ctx.attn_backend, AttentionType.ENCODER_DECODER)

    def forward(self, h, encoder_hidden, kv_cache, attn_metadata) -> torch.Tensor:
        k = v = None
        if encoder_hidden is not None:
            k, v = self.kv_proj(encoder_hidden).split(self.kv_proj.output_partition_sizes, dim=-1)
        return self.o(self.attn(self.q(h), k, v, kv_cache, attn_metadata))


class T5FFN(nn.Module):
    """``wo(act(wi(h)))``, or gated ``wo(act(wi_0(h)) * wi_1(h))`` (one GEMM for both)."""

    def __init__(self, config) -> None:
        super().__init__()
        d, ff = config.d_model, config.d_ff
        self.act_name, self.gated = _activation(config)
        self.act = ACT2FN[self.act_name]
        if self.gated:
            self.wi = MergedColumnParallelLinear(d, [ff, ff], bias=False)
        else:
            self.wi = ColumnParallelLinear(d, ff, bias=False)
        self.wo = RowParallelLinear(ff, d, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.gated:
            gate, linear = self.wi(h).split(self.wi.output_partition_sizes, dim=-1)
            return self.wo(self.act(gate) * linear)
        if self.act_name in FUSABLE_ACTIVATIONS:
            return self.wo(self.wi(h, activation=self.act_name))
        return self.wo(self.act(self.wi(h)))


class _Sublayer(nn.Module):
    """One of a block's ``layer.{j}``: pre-norm, the module, residual add."""

    def __init__(self, module: nn.Module, name: str, config) -> None:
        super().__init__()
        setattr(self, name, module)  # HF's name, so checkpoint names map as they are
        self.name = name
        self.layer_norm = T5LayerNorm(config.d_model, config.layer_norm_epsilon)

    @property
    def body(self) -> nn.Module:
        return getattr(self, self.name)


class T5Block(nn.Module):
    def __init__(self, config, is_decoder: bool, ctx: ModelContext) -> None:
        super().__init__()
        kind = AttentionType.DECODER if is_decoder else AttentionType.ENCODER
        parts = [_Sublayer(T5SelfAttention(config, kind, ctx), "SelfAttention", config)]
        if is_decoder:
            parts.append(_Sublayer(T5CrossAttention(config, ctx), "EncDecAttention", config))
        parts.append(_Sublayer(T5FFN(config), "DenseReluDense", config))
        self.layer = nn.ModuleList(parts)
        self.is_decoder = is_decoder

    def forward(self, h, encoder_hidden, kv_cache, attn_metadata, position_bias) -> torch.Tensor:
        attn = self.layer[0]
        h = h + attn.body(attn.layer_norm(h), kv_cache, attn_metadata, position_bias)
        if self.is_decoder:
            cross = self.layer[1]
            h = h + cross.body(cross.layer_norm(h), encoder_hidden, kv_cache, attn_metadata)
        ffn = self.layer[-1]
        return h + ffn.body(ffn.layer_norm(h))


class T5Stack(nn.Module):
    def __init__(self, config, is_decoder: bool, embed_tokens: VocabParallelEmbedding, ctx: ModelContext) -> None:
        super().__init__()
        n = config.num_decoder_layers if is_decoder else config.num_layers
        self.embed_tokens = embed_tokens
        self.block = nn.ModuleList(T5Block(config, is_decoder, ctx) for _ in range(n))
        self.final_layer_norm = T5LayerNorm(config.d_model, config.layer_norm_epsilon)
        # HF keeps it in block 0's self-attention; every block reads it, so it sits here.
        self.relative_attention_bias = nn.Parameter(
            torch.empty(config.relative_attention_num_buckets, config.num_heads), requires_grad=False
        )
        self.num_buckets = config.relative_attention_num_buckets
        self.max_distance = config.relative_attention_max_distance
        self.bidirectional = not is_decoder
        tp = get_tp_group()
        heads = config.num_heads // tp.size
        self.heads = slice(tp.rank * heads, (tp.rank + 1) * heads)  # this rank's columns of the table

    def forward(self, input_ids, encoder_hidden, kv_caches, attn_metadata) -> torch.Tensor:
        bias = RelativePositionBias(
            self.relative_attention_bias[:, self.heads], self.num_buckets, self.max_distance, self.bidirectional
        )
        h = self.embed_tokens(input_ids)
        caches = kv_caches if kv_caches is not None else [None] * len(self.block)
        for block, kv_cache in zip(self.block, caches):
            h = block(h, encoder_hidden, kv_cache, attn_metadata, bias)
        return self.final_layer_norm(h)


class T5ForConditionalGeneration(EncoderDecoderModel):
    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "kv_proj": ["k_proj", "v_proj"]}

    def __init__(self, config, ctx: ModelContext) -> None:
        super().__init__(config, ctx)
        self.shared = VocabParallelEmbedding(config.vocab_size, config.d_model)
        self.encoder = T5Stack(config, False, self.shared, ctx)
        self.decoder = T5Stack(config, True, self.shared, ctx)
        if _activation(config)[1]:  # gated: wi_0 and wi_1 are one GEMM (a ReLU FFN's wi is whole)
            self.packed_modules_mapping = {**self.packed_modules_mapping, "wi": ["wi_0", "wi_1"]}
        self.scale_output = _scaled_head(config)
        self.output_scale = config.d_model**-0.5
        if not self.scale_output:
            self.lm_head = ParallelLMHead(config.vocab_size, config.d_model)

    @classmethod
    def attn_features(cls, config) -> frozenset[str]:
        return frozenset({RELATIVE_POSITION_BIAS})

    @classmethod
    def kv_cache_spec(cls, config) -> KVCacheSpec:
        return KVCacheSpec(config.num_decoder_layers, config.num_heads, config.d_kv)

    tensor_parallel_fields = ("num_heads", "d_ff")
    config_size_fields = (
        "d_model", "d_kv", "d_ff", "num_layers", "num_decoder_layers", "num_heads", "vocab_size",
        "relative_attention_num_buckets", "relative_attention_max_distance",
    )

    @classmethod
    def check_config(cls, config) -> None:
        cls.check_size_fields(config)
        if config.relative_attention_num_buckets < 4:
            raise ValueError(
                f"config.json: relative_attention_num_buckets={config.relative_attention_num_buckets} "
                "must be at least 4 (half exact, half log-spaced, in each direction)"
            )
        exact = config.relative_attention_num_buckets // 2  # the causal stack's exact buckets
        if config.relative_attention_max_distance <= exact:
            raise ValueError(
                f"config.json: relative_attention_max_distance={config.relative_attention_max_distance} must "
                f"exceed relative_attention_num_buckets // 2 = {exact} (the log-spaced buckets span the rest)"
            )
        eps = getattr(config, "layer_norm_epsilon", None)
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0:
            raise ValueError(f"config.json: layer_norm_epsilon={eps!r} must be a positive number")
        _activation(config)

    @classmethod
    def num_parameters(cls, config) -> int:
        """Exactly the parameters ``__init__`` creates (the untied head included)."""
        d, inner, ff, v = config.d_model, config.num_heads * config.d_kv, config.d_ff, config.vocab_size
        ffn = d * ff * (3 if _activation(config)[1] else 2)
        attn = 4 * d * inner
        stack = config.relative_attention_num_buckets * config.num_heads + d  # bias table, final norm
        total = v * d + 2 * stack
        total += config.num_layers * (attn + ffn + 2 * d)
        total += config.num_decoder_layers * (2 * attn + ffn + 3 * d)
        return total if _scaled_head(config) else total + v * d

    @classmethod
    def max_encoder_len(cls, config) -> int:
        return int(getattr(config, "n_positions", None) or DEFAULT_MAX_LEN)

    @classmethod
    def max_decoder_len(cls, config) -> int:
        return cls.max_encoder_len(config)

    @classmethod
    def decoder_start_token_id(cls, config) -> int:
        for field in ("decoder_start_token_id", "pad_token_id"):  # T5 starts from pad (0)
            value = getattr(config, field, None)
            if value is not None:
                return int(value)
        raise ValueError(f"{cls.__name__}: config.json has neither decoder_start_token_id nor pad_token_id")

    @classmethod
    def get_default_decoder_prompt(cls, config) -> list[int]:
        return [cls.decoder_start_token_id(config)]  # no BOS: HF generate starts from the start token alone

    def forward(self, input_ids, positions, encoder_input_ids, encoder_positions, kv_caches, attn_metadata):
        encoder_hidden = None
        if encoder_input_ids.numel():
            encoder_hidden = self.encoder(encoder_input_ids, None, None, attn_metadata)
        return self.decoder(input_ids, encoder_hidden, kv_caches, attn_metadata)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.scale_output:
            return self.shared.logits(hidden_states * self.output_scale)
        return self.lm_head.logits(hidden_states)

    def hf_to_tandem_name(self, name: str) -> str | None:
        parts = name.split(".")
        if name == "lm_head.weight":
            return None if self.scale_output else name
        if name in ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight"):
            return "shared.weight"
        if parts[-2:] == ["relative_attention_bias", "weight"]:
            # block 0's self-attention holds the stack's table; an old save's cross-attention copy is unused
            if parts[-3] == "SelfAttention":
                return f"{parts[0]}.relative_attention_bias"
            return None
        if len(parts) >= 2 and parts[-2] in _HF_MODULES and parts[-3] in ("SelfAttention", "EncDecAttention"):
            parts[-2] = _HF_MODULES[parts[-2]]
            if parts[-3] == "EncDecAttention" and parts[-2] == "q_proj":
                parts[-2] = "q"
        return ".".join(parts)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_checkpoint(self, self._with_head(weights))

    def _with_head(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """An untied model's checkpoint without ``lm_head.weight`` (saved by transformers 5,
        which ties T5's head always) reads the embeddings as its head, as HF does."""
        shared, has_head = None, False
        for name, tensor in weights:
            has_head |= name == "lm_head.weight"
            if name == "shared.weight":
                shared = tensor
            yield name, tensor
        if not self.scale_output and not has_head and shared is not None:
            yield "lm_head.weight", shared
