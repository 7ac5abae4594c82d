"""The alignment heads' cross-attention, recomputed after a window is decoded.

Word timestamps need the cross-attention probabilities of a few heads
(``generation_config.alignment_heads``). The paged decode path never forms
them (its kernels return only the attention output), so instead of a backend
capability the finished window is run once more, densely, in plain torch on
the model's own layers: the encoder over the window's input, then the
decoder over the prompt and the generated tokens, up to the last layer that
holds an alignment head. The hot decode path is untouched, and every backend
gets the feature. Its cost is about one encoder pass per window (the cross
K/V in the paged cache is in each backend's own layout, and is freed or kept
at the encoder cache's will, so it is not read back).
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


def alignment_attention(model, inputs: torch.Tensor, token_ids: list[int], heads: list[tuple[int, int]],
                        first_row: int) -> torch.Tensor:
    """Cross-attention probabilities ``[len(heads), len(token_ids) - first_row, 1500]``
    (float32) of the given ``(layer, head)`` pairs, in their order, for the decoder
    queries at ``token_ids[first_row:]``, the decoder reading ``token_ids`` causally."""
    decoder = model.model.decoder
    last = max(layer for layer, _ in heads)
    held, total = decoder.layers[0].encoder_attn.attn.num_heads, model.config.decoder_attention_heads
    if held != total:  # a tensor-parallel shard: the pairs name heads of the whole model
        raise ValueError(f"word_timestamps=True: this model holds {held} of the {total} decoder heads (tensor "
                         "parallel); word timestamps need all of them on one process, not built yet")
    with torch.inference_mode():
        enc = encode(model.model.encoder, inputs.to(decoder.layer_norm.weight.device))
        ids = torch.tensor(token_ids, dtype=torch.long, device=enc.device)
        h = decoder.embed_tokens(ids) + decoder.embed_positions(torch.arange(len(token_ids), device=enc.device))
        found: dict[tuple[int, int], torch.Tensor] = {}
        for i, layer in enumerate(decoder.layers[: last + 1]):
            h = h + _self_attention(layer.self_attn, layer.self_attn_layer_norm(h), causal=True)
            cross = layer.encoder_attn
            n, size = cross.attn.num_heads, cross.attn.head_size
            q = cross.q_proj(layer.encoder_attn_layer_norm(h)).view(-1, n, size).transpose(0, 1)
            k, v = (t.view(-1, n, size).transpose(0, 1)
                    for t in cross.kv_proj(enc).split(cross.kv_proj.output_partition_sizes, dim=-1))
            probs = torch.softmax((q @ k.transpose(1, 2)) * size**-0.5, dim=-1)  # [n, T, 1500]
            for li, hi in heads:
                if li == i:
                    found[(li, hi)] = probs[hi, first_row:].float()
            if i == last:
                break
            h = h + cross.out_proj((probs @ v).transpose(0, 1).reshape(-1, n * size))
            h = h + layer.ffn(layer.final_layer_norm(h))
        return torch.stack([found[(li, hi)] for li, hi in heads])
