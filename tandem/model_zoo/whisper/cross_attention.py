"""A decoded window recomputed densely: the alignment heads' cross-attention, and
the logits after a prompt.

Word timestamps need the cross-attention probabilities of a few heads
(``generation_config.alignment_heads``). The paged decode path never forms
them (its kernels return only the attention output), so instead of a backend
capability the finished window is run once more, densely, in plain torch on
the model's own layers: the encoder over the window's input, then the
decoder over the prompt and the generated tokens, up to the last layer that
holds an alignment head. The hot decode path is untouched, and every backend
gets the feature. Its cost is about one encoder pass per window (the cross
K/V in the paged cache is in each backend's own layout, and is freed or kept
at the encoder cache's will, so it is not read back). Under tensor parallelism
every rank runs this on its shard (``tandem/core/model_call.py``): the parallel
layers join the halves as in a step, and the alignment heads' probabilities
are gathered from the ranks that hold them. The no-speech
probability of a window whose decoder prompt ends at ``<|startoftranscript|>``
(an English-only checkpoint with timestamps) is read from the same
recomputation run to the logits (:func:`next_token_logits`).
"""

from __future__ import annotations

import torch
from torch import nn


def _self_attention(attn: nn.Module, x: torch.Tensor, causal: bool) -> torch.Tensor:
    """``attn``'s projections around dense scaled-dot-product attention: ``x`` ``[L, d]``."""
    heads, size = attn.attn.num_heads, attn.attn.head_size
    q, k, v = (t.view(-1, heads, size).transpose(0, 1) for t in attn.qkv_proj(x).split(attn.split, dim=-1))
    o = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=size**-0.5)
    return attn.out_proj(o.transpose(0, 1).reshape(x.shape[0], heads * size))


def encode(encoder: nn.Module, inputs: torch.Tensor) -> torch.Tensor:
    """One window's encoder input (a padded waveform or a log-mel window) ->
    ``[1500, d]`` encoder hidden states."""
    features = encoder.features(inputs.unsqueeze(0)).to(encoder.conv1.weight.dtype)
    h = nn.functional.gelu(encoder.conv1(features))
    h = nn.functional.gelu(encoder.conv2(h)).transpose(1, 2)[0]  # [1500, d]
    h = h + encoder.embed_positions.weight[: h.shape[0]]
    for layer in encoder.layers:  # Whisper is pre-LN
        h = h + _self_attention(layer.self_attn, layer.self_attn_layer_norm(h), causal=False)
        h = h + layer.ffn(layer.final_layer_norm(h))
    return encoder.layer_norm(h)


def _decoder(model, enc: torch.Tensor, token_ids: list[int], num_layers: int, on_probs=None) -> torch.Tensor:
    """The first ``num_layers`` decoder layers over ``token_ids`` (causal), reading
    ``enc``: hidden states ``[len(token_ids), d]``. ``on_probs(layer, probs)`` sees each
    layer's cross-attention probabilities ``[heads, len(token_ids), 1500]``."""
    decoder = model.model.decoder
    ids = torch.tensor(token_ids, dtype=torch.long, device=enc.device)
    h = decoder.embed_tokens(ids) + decoder.embed_positions(torch.arange(len(token_ids), device=enc.device))
    for i, layer in enumerate(decoder.layers[:num_layers]):
        h = h + _self_attention(layer.self_attn, layer.self_attn_layer_norm(h), causal=True)
        cross = layer.encoder_attn
        n, size = cross.attn.num_heads, cross.attn.head_size
        q = cross.q_proj(layer.encoder_attn_layer_norm(h)).view(-1, n, size).transpose(0, 1)
        k, v = (t.view(-1, n, size).transpose(0, 1)
                for t in cross.kv_proj(enc).split(cross.kv_proj.output_partition_sizes, dim=-1))
        probs = torch.softmax((q @ k.transpose(1, 2)) * size**-0.5, dim=-1)  # [n, T, 1500]
        if on_probs is not None:
            on_probs(i, probs)
        h = h + cross.out_proj((probs @ v).transpose(0, 1).reshape(-1, n * size))
        h = h + layer.ffn(layer.final_layer_norm(h))
    return h


def alignment_attention(model, inputs: torch.Tensor, token_ids: list[int], heads: list[tuple[int, int]],
                        first_row: int) -> torch.Tensor:
    """Cross-attention probabilities ``[len(heads), len(token_ids) - first_row, 1500]``
    (float32) of the given ``(layer, head)`` pairs, in their order, for the decoder
    queries at ``token_ids[first_row:]``, the decoder reading ``token_ids`` causally."""
    found: dict[tuple[int, int], torch.Tensor] = {}
    wanted = {layer for layer, _ in heads}

    def keep(i: int, probs: torch.Tensor) -> None:
        if i not in wanted:
            return
        # A tensor-parallel rank holds its share of the heads, in rank order: every rank
        # gathers the layer's heads (the same layers on every rank, so the collectives pair).
        probs = model.model.decoder.layers[i].encoder_attn.q_proj.tp.all_gather(probs[:, first_row:], dim=0)
        for li, hi in heads:
            if li == i:
                found[(li, hi)] = probs[hi].float()

    with torch.inference_mode():
        decoder = model.model.decoder
        enc = encode(model.model.encoder, inputs.to(decoder.layer_norm.weight.device))
        _decoder(model, enc, token_ids, max(layer for layer, _ in heads) + 1, keep)
        return torch.stack([found[(li, hi)] for li, hi in heads])


def next_token_logits(model, inputs: torch.Tensor, token_ids: list[int]) -> torch.Tensor:
    """The raw logits ``[vocab]`` (float32) the model gives after ``token_ids`` for one
    window (``inputs``: its encoder input), before any processor: Whisper's no-speech
    probability is read from them where the decode path has no step to read it at."""
    with torch.inference_mode():
        decoder = model.model.decoder
        enc = encode(model.model.encoder, inputs.to(decoder.layer_norm.weight.device))
        h = _decoder(model, enc, token_ids, len(decoder.layers))
        return model.compute_logits(decoder.layer_norm(h[-1:]))[0].float()
