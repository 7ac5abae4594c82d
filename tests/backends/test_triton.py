"""The triton backend's own paths (kernels interpreted on CPU; compiled on a GPU
under ``-m gpu``): split-K decode, the query tiling, its capability rules, the
relative position bias (T5) through each path, and BART end to end against
torch_sdpa."""

from __future__ import annotations

import pytest
import torch

from layouts import BIAS_MAX_DISTANCE, bucket_of, check_backend, random_layout, step_inputs
from tandem import LLM, SamplingParams
from tandem.core.attention import AttentionType, KVCacheSpec
from tandem.core.relative_position import RelativePositionBias
from tandem.plugins import default_backend_registry
from tandem.registry import BackendUnavailableError

pytest.importorskip("triton")
from tandem.backends.triton import TritonBackend  # noqa: E402
from tandem.backends.triton import backend as triton_backend  # noqa: E402

CPU = torch.device("cpu")
ALL_KINDS = frozenset(AttentionType)
needs_interpreter = pytest.mark.skipif(
    torch.cuda.is_available() or not triton_backend._interpreting(),
    reason="runs the kernels in Triton's interpreter (CPU, TRITON_INTERPRET=1)",
)


def _built(monkeypatch) -> list:
    built = []
    real = triton_backend.TritonMetadataBuilder.build
    monkeypatch.setattr(triton_backend.TritonMetadataBuilder, "build",
                        lambda self, i: built.append(real(self, i)) or built[-1])
    return built


@needs_interpreter
@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_split_k_decode_matches_float64(seed, block_size, monkeypatch):
    # Caches of up to ~40 tokens split every 8 keys: up to 5 programs per
    # sequence and KV head, merged by log-sum-exp; some splits of the shorter
    # sequences are empty.
    monkeypatch.setattr(triton_backend.TritonMetadataBuilder, "split_kv_tokens", 8)
    built = _built(monkeypatch)
    check_backend(TritonBackend, seed, block_size, num_kv_heads=2, mix="decodes")
    md = built[0]
    assert md.decode_only and max(md.self_splits, md.cross_splits) > 1


@needs_interpreter
@pytest.mark.parametrize("seed", range(2))
def test_split_k_decode_with_relative_bias_matches_float64(seed, monkeypatch):
    # Each split adds the bias of its own keys; the merge by log-sum-exp must
    # then equal one softmax over all of them.
    monkeypatch.setattr(triton_backend.TritonMetadataBuilder, "split_kv_tokens", 8)
    built = _built(monkeypatch)
    check_backend(TritonBackend, seed, 4, num_kv_heads=2, mix="decodes", bias=True)
    assert built[0].decode_only and built[0].self_splits > 1


@needs_interpreter
@pytest.mark.parametrize("arch", [80, 90])
def test_relative_bias_under_each_targets_wide_tiles(arch, monkeypatch):
    # 64-row bfloat16 tiles (prefill, chunks, encoder): rows past a sequence's end
    # must neither read the bias out of range nor disturb the rows that exist.
    from tandem.backends.triton import configs

    monkeypatch.setattr(triton_backend, "INTERPRETER_ARCH", arch)
    monkeypatch.setattr(configs, "WIDE_TILE_MIN_ROWS", 1)
    check_backend(TritonBackend, 3, 4, num_kv_heads=2, head_size=64, mix="mixed", dtype=torch.bfloat16, bias=True)


@pytest.mark.parametrize("num_buckets,max_distance", [(32, 128), (16, BIAS_MAX_DISTANCE), (8, 20)])
@pytest.mark.parametrize("bidirectional", [True, False])
def test_relative_bias_column_holds_the_bucket_of_its_distance(num_buckets, max_distance, bidirectional):
    """Every relative position from -2 * max_distance to 2 * max_distance (each bucket
    boundary, the log-spaced ones included, and the clipped range past max_distance):
    the kernels' column for it is the table row of T5's bucket, written here one scalar at
    a time from the definition (the log in float32), and causal keys after the query read
    bucket 0."""
    heads = 3
    table = torch.randn(num_buckets, heads, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    pb = RelativePositionBias(table, num_buckets, max_distance, bidirectional)
    longest = 2 * max_distance + 1
    got = triton_backend.relative_bias(pb, longest, CPU).double() / triton_backend._LOG2E  # [H, 2 * longest - 1]
    assert got.shape == (heads, 2 * longest - 1) and got.dtype == torch.float64
    for r in range(-(longest - 1), longest):
        b = bucket_of(r, bidirectional, num_buckets, max_distance)
        # stored in float32, then times log2 e in float32: two roundings, < 2 * 2^-24 relative
        torch.testing.assert_close(got[:, longest - 1 + r], table[b], rtol=2e-7, atol=0)
    assert triton_backend.relative_bias(pb, longest, CPU) is triton_backend.relative_bias(pb, longest, CPU)


@needs_interpreter
def test_mixed_batches_take_the_varlen_kernel_and_decode_batches_the_decode_kernel(monkeypatch):
    built = _built(monkeypatch)
    check_backend(TritonBackend, 0, 4, num_kv_heads=2, mix="mixed")
    check_backend(TritonBackend, 0, 4, num_kv_heads=2, mix="decodes")
    assert not built[0].decode_only and built[2].decode_only  # [1], [3]: each later, encoder-free step


@needs_interpreter
@pytest.mark.parametrize("arch", [80, 90])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.slow
def test_each_targets_launch_configurations_compute_the_same(arch, dtype, monkeypatch):
    # The tiles each target launches on a GPU (64-row 16-bit tiles for every varlen
    # step here, 8-warp float32 tiles for 256-wide heads), run interpreted against
    # float64: a tile or mask bug that only a wide configuration has shows here.
    from tandem.backends.triton import configs

    monkeypatch.setattr(triton_backend, "INTERPRETER_ARCH", arch)
    monkeypatch.setattr(configs, "WIDE_TILE_MIN_ROWS", 1)
    launched = []
    real = configs.varlen
    monkeypatch.setattr(configs, "varlen", lambda *a, **k: launched.append(real(*a, **k)) or launched[-1])
    check_backend(TritonBackend, 1, 4, num_kv_heads=2, mix="mixed", dtype=dtype)
    check_backend(TritonBackend, 2, 16, num_kv_heads=1, head_size=256, mix="mixed", dtype=dtype)
    rows = {c.block_m for c in launched}
    assert rows == ({16} if dtype == torch.float32 else {64})
    if dtype == torch.float32:
        assert {c.num_warps for c in launched} == {4, 8}


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("rows", [16, 64])
def test_query_tiles_cover_every_row_once(seed, rows):
    import random

    seqs, _ = random_layout(random.Random(seed), 4)
    inputs = step_inputs(seqs, 4)
    builder = triton_backend.TritonMetadataBuilder(4, CPU, KVCacheSpec(1, 2, 8))
    md = builder.build(inputs)
    covered = []
    tile_seq, tile_row = md.tiles(False, rows)
    for s, r in zip(tile_seq.tolist(), tile_row.tolist()):
        start = int(md.query_start_loc[s])
        covered += [start + j for j in range(r, min(r + rows, inputs.query_lens[s]))]
    assert sorted(covered) == list(range(sum(inputs.query_lens)))
    enc = []
    tile_seq, tile_row = md.tiles(True, rows)
    for s, r in zip(tile_seq.tolist(), tile_row.tolist()):
        enc += [int(md.encoder_start_loc[s]) + j for j in range(r, min(r + rows, inputs.encoder_seq_lens[s]))]
    assert sorted(enc) == list(range(sum(inputs.encoder_seq_lens)))
    assert md.tiles(False, rows)[0] is md.tiles(False, rows)[0]  # built once per step


def test_cpu_without_the_interpreter_is_refused_with_the_reason(monkeypatch):
    monkeypatch.setattr(triton_backend, "_interpreting", lambda: False)
    reasons = TritonBackend.unsupported_reasons(CPU, torch.float32, 64, ALL_KINDS, 16, torch.float32)
    assert len(reasons) == 1 and "device cpu" in reasons[0] and "TRITON_INTERPRET=1" in reasons[0]
    with pytest.raises(BackendUnavailableError, match=r"attention_backend='triton' cannot serve.*device cpu"):
        default_backend_registry().select("triton", device=CPU, dtype=torch.float32, head_size=64,
                                          attn_types=ALL_KINDS, block_size=16)


def test_each_bad_value_is_named(monkeypatch):
    monkeypatch.setattr(triton_backend.importlib.util, "find_spec", lambda name: None)
    reasons = TritonBackend.unsupported_reasons(torch.device("mps"), torch.float64, 512, ALL_KINDS, 0, torch.float16)
    text = " | ".join(reasons)
    for needle in ("triton package is not installed", "'mps'", "torch.float64", "KV-cache dtype torch.float16",
                   "head size 512", "block_size 0"):
        assert needle in text
    assert len(reasons) == 6


def test_serves_kv_compress_by_declaration():
    # The default run's check (the engine run against cpu_paged is slow): the registry
    # asks for this feature when kv_compress is on.
    from tandem.core.kv_compress_config import FEATURE

    assert FEATURE in TritonBackend.capabilities.attn_features
    assert default_backend_registry().load("triton").feature_reasons(frozenset({FEATURE})) == []


def test_never_chosen_automatically_on_cpu():
    selection = default_backend_registry().select(None, device=CPU, dtype=torch.float32, head_size=8,
                                                  attn_types=ALL_KINDS, block_size=16)
    assert selection.backend.name in ("cpu_paged", "torch_sdpa")  # cpu_paged where its C++ op builds
    assert "triton: chosen only when asked for by name on cpu/float32" in selection.reason
    assert TritonBackend.auto_priority(torch.device("cuda"), torch.float16) == TritonBackend.priority


def _generate(model, backend, device="cpu", dtype="float32"):
    prompts = [{"prompt_token_ids": [0, *range(5, 5 + n), 2]} for n in (1, 9, 23, 40)]
    params = SamplingParams(temperature=0.0, max_tokens=8, min_tokens=8)
    llm = LLM(model=str(model), attention_backend=backend, device=device, dtype=dtype, block_size=4)
    assert llm.engine.attn_backend.name == backend
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@needs_interpreter
@pytest.mark.slow
def test_bart_through_triton_equals_torch_sdpa(bart_dir):
    assert _generate(bart_dir, "triton") == _generate(bart_dir, "torch_sdpa")


def _compressed_run(backend, monkeypatch, kv_compress):
    """Greedy tokens, per-token logprobs and the positions each request's (layer, KV head)
    kept, of three 20-40-token inputs to the demo BART (block size 4)."""
    import json
    from pathlib import Path

    import tandem
    from tandem.core.worker.cross_compress import CrossKVCompressor

    demo = Path(tandem.__file__).parent / "demo_model"
    sentences = [s["input"] for s in json.loads((demo / "demo_sentences.json").read_text())]
    prompts = [" ".join(sentences[(i + j) % len(sentences)] for j in range(3 + i)) for i in range(3)]
    kept = {}
    real = CrossKVCompressor.kept_positions

    def spy(self, repack, device):
        chosen = kept[repack.request_id] = real(self, repack, device)
        return chosen

    with monkeypatch.context() as m:  # undone after the run: the next run wraps the real method, not this spy
        m.setattr(CrossKVCompressor, "kept_positions", spy)
        llm = LLM(model=str(demo), attention_backend=backend, dtype="float32", device="cpu", block_size=4,
                  num_kv_blocks=200, swap_space=0.01, kv_compress=kv_compress)
        assert llm.llm_engine.attn_backend.name == backend
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, logprobs=0), use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in outs]
    logprobs = [[lp[t] for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] for o in outs]
    return tokens, logprobs, [kept[o.request_id].tolist() for o in outs] if kept else None


@needs_interpreter
@pytest.mark.slow  # three engines, one of them interpreted: 20-40 s on a loaded 2-core machine
def test_kv_compress_through_triton_equals_cpu_paged(monkeypatch):
    # The compressed cross table is an ordinary table of K slots with cross length K:
    # the Triton kernels (split-K decode too: 8 keys a split) must read it as cpu_paged's
    # C++ op does, and the observation reads the same default layout, so both keep the
    # same positions and decode the same tokens.
    monkeypatch.setattr(triton_backend.TritonMetadataBuilder, "split_kv_tokens", 8)
    # triton declares one count per request (not cross_kv_compress_per_head): compare with
    # cpu_paged in that layout.
    from dataclasses import replace

    from tandem.backends.cpu_paged.backend import CPUPagedBackend
    from tandem.core.kv_compress_config import PER_HEAD_FEATURE

    assert PER_HEAD_FEATURE not in TritonBackend.capabilities.attn_features
    caps = CPUPagedBackend.capabilities
    monkeypatch.setattr(CPUPagedBackend, "capabilities",
                        replace(caps, attn_features=caps.attn_features - {PER_HEAD_FEATURE}))
    # Window 1: half of each request's (layer, head)s keep their most attended positions,
    # half evenly spaced ones.
    compress = {"keep_fraction": 0.3, "window": 1, "min_keep": 1}
    want_tokens, want_lp, want_kept = _compressed_run("cpu_paged", monkeypatch, compress)
    tokens, logprobs, kept = _compressed_run("triton", monkeypatch, compress)
    assert kept == want_kept and len(kept) == 3
    assert tokens == want_tokens
    # Both compute in float32, summing in different orders: a few ulps (~1e-7 relative)
    # per attention output, through 2 + 2 layers to logits of magnitude ~10 gives ~1e-5
    # at most in a logprob (1e-6 seen); 1e-4 is still far below any greedy token's margin here.
    for got, want in zip(logprobs, want_lp):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    # Not vacuous: compression changed what the model decodes.
    assert _compressed_run("cpu_paged", monkeypatch, None)[0] != want_tokens


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("mix", ["mixed", "decodes"])
@pytest.mark.parametrize("heads", [(4, 8), (2, 64), (1, 128)])
@pytest.mark.parametrize("seed", range(2))
def test_cuda_kernels_match_float64(dtype, block_size, mix, heads, seed, monkeypatch):
    if mix == "decodes" and seed:
        monkeypatch.setattr(triton_backend.TritonMetadataBuilder, "split_kv_tokens", 8)
    check_backend(TritonBackend, seed, block_size, heads[0], heads[1], mix, device="cuda", dtype=dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_bart_through_triton_equals_torch_sdpa(bart_dir):
    assert _generate(bart_dir, "triton", "cuda") == _generate(bart_dir, "torch_sdpa", "cuda")
