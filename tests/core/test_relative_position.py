"""T5's relative position buckets and the bias read from them, against transformers'
own ``T5Attention`` (the checkpoints' definition)."""

from __future__ import annotations

import pytest
import torch

from tandem.core.relative_position import RelativePositionBias, relative_position_bucket


@pytest.mark.parametrize("bidirectional", [True, False])
@pytest.mark.parametrize("num_buckets,max_distance", [(32, 128), (8, 20), (16, 24), (6, 7)])
def test_buckets_equal_transformers(bidirectional, num_buckets, max_distance):
    from transformers.models.t5.modeling_t5 import T5Attention

    rel = torch.arange(-600, 601)[None, :] - torch.arange(0, 3)[:, None]
    want = T5Attention._relative_position_bucket(rel, bidirectional, num_buckets, max_distance)
    got = relative_position_bucket(rel, bidirectional, num_buckets, max_distance)
    assert torch.equal(got, want)
    assert int(got.min()) == 0 and int(got.max()) == num_buckets - 1  # every bucket range reached


def test_bias_equals_transformers_compute_bias_for_a_chunk_after_cached_tokens():
    from transformers import T5Config
    from transformers.models.t5.modeling_t5 import T5Attention

    config = T5Config(d_model=16, d_kv=4, num_heads=4, relative_attention_num_buckets=8,
                      relative_attention_max_distance=20, is_decoder=True)
    attn = T5Attention(config, has_relative_attention_bias=True)
    torch.nn.init.normal_(attn.relative_attention_bias.weight)
    want = attn.compute_bias(5, 30, past_seen_tokens=25)[0]  # [H, 5, 30]: queries at 25..29
    pb = RelativePositionBias(attn.relative_attention_bias.weight.detach(), 8, 20, bidirectional=False)
    got = pb.bias(torch.arange(25, 30), torch.arange(30))
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    # Batched: one query per row ([D, 1] and [D, L]) gives [D, H, 1, L].
    batched = pb.bias(torch.tensor([[27], [29]]), torch.arange(30).expand(2, 30))
    assert torch.equal(batched[:, :, 0], torch.stack([want[:, 2], want[:, 4]]))


def test_memo_computes_once_per_key():
    pb = RelativePositionBias(torch.zeros(8, 2), 8, 20, bidirectional=True)
    calls = []
    first = pb.memo(("encoder", 0), lambda: calls.append(1) or torch.ones(1))
    again = pb.memo(("encoder", 0), lambda: calls.append(1) or torch.zeros(1))
    assert again is first and calls == [1]
