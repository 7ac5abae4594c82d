"""torch_sdpa's own paths: cross K/V read through cache views or gathered, each
against float64 on random paged layouts (the shared conformance check)."""

import pytest
import torch

from layouts import check_backend, sdpa_family_backend
from tandem.backends.torch_sdpa import TorchSDPABackend, contiguous_starts


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("cross_path", ["views", "gather"])
def test_cross_attention_through_views_and_gathers_matches_float64(seed, block_size, cross_path, monkeypatch):
    import tandem.backends.torch_sdpa as sdpa

    # Force every contiguous cross table through a cache view, or none.
    monkeypatch.setattr(sdpa, "VIEW_MIN_CROSS_ELEMENTS", 1 if cross_path == "views" else 10**12)
    built = []
    real_build = sdpa.TorchSDPAMetadataBuilder.build
    monkeypatch.setattr(sdpa.TorchSDPAMetadataBuilder, "build",
                        lambda self, i: built.append(real_build(self, i)) or built[-1])
    check_backend(TorchSDPABackend, seed, block_size, num_kv_heads=4 if seed % 2 else 2)
    md = built[0]
    decodes = md.decode_seqs.tolist()
    contiguous_decodes = [i for i, start in enumerate(md.cross_view_start) if start >= 0 and i in decodes]
    assert len(md.decode_cross_views) == (len(contiguous_decodes) if cross_path == "views" else 0)


def test_contiguous_starts():
    tables = torch.tensor([[4, 5, 6], [4, 6, 0], [9, 0, 0], [2, 3, 7]])
    lens = torch.tensor([12, 5, 3, 8])  # block size 4: 3, 2, 1, 2 blocks used
    assert contiguous_starts(tables, lens, 4).tolist() == [16, -1, 36, 8]


@pytest.mark.parametrize("backend", ["torch_sdpa", "cpu_paged"])
def test_encoder_runs_of_one_length_in_one_call_match_float64(backend, monkeypatch):
    """Whisper's case: every encoder run 1500 positions. Runs of one length go
    through one batched SDPA call (its output a view, no per-run copy); the result
    is float64's, and runs of different lengths still take the per-run loop."""
    import tandem.backends.torch_sdpa as sdpa
    from layouts import Seq

    cls = sdpa_family_backend(backend)
    batched = []
    real = sdpa.SDPAImplBase._encoder_batched
    monkeypatch.setattr(sdpa.SDPAImplBase, "_encoder_batched",
                        lambda self, q, k, v, runs, gqa: batched.append(runs) or real(self, q, k, v, runs, gqa))

    def layout(enc_lens, block_size=4):
        seqs, used = [], 0
        for group, n in enumerate(enc_lens):
            cross = list(range(used, used + -(-n // block_size)))
            table = [cross[-1] + 1]  # a 3-token prefill fits one block
            used = table[-1] + 1
            seqs.append(Seq(group, 0, 3, table, n, cross, True))
        return seqs, used + 4

    check_backend(cls, 0, 4, num_kv_heads=2, layout=layout([37, 37, 37]))
    assert batched == [3]
    check_backend(cls, 1, 4, num_kv_heads=4, layout=layout([37, 20, 37]))
    assert batched == [3]  # unequal runs: the loop
