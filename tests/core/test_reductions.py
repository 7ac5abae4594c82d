"""argmax_rows against torch.argmax: the same index in every case, ties and NaN included,
by both of its paths: torch's ops over chunks, and the C++ op a CPU worker loads
(``tandem/backends/cpu_sampling``; skipped where it cannot be built)."""

import pytest
import torch

from tandem.core.worker import reductions
from tandem.core.worker.reductions import ARGMAX_CHUNK, argmax_rows


@pytest.fixture(autouse=True, params=["chunks", "cpp"])
def path(request, monkeypatch):
    """Every test runs on each path; ``reductions._cpu_op`` is what ``install_cpu_op`` sets."""
    if request.param == "cpp":
        from tandem.backends.cpu_sampling import ops

        try:
            monkeypatch.setattr(reductions, "_cpu_op", ops.load())
        except ops.CPUOpUnavailable as e:
            pytest.skip(f"the C++ argmax cannot be built here: {e}")
    else:
        monkeypatch.setattr(reductions, "_cpu_op", None)
    return request.param


@pytest.mark.parametrize("vocab", [50265, 4 * ARGMAX_CHUNK, 4 * ARGMAX_CHUNK + 1, 10 * ARGMAX_CHUNK - 1, 97])
@pytest.mark.parametrize("rows", [1, 3, 256])
def test_equals_torch_argmax_on_random_rows(vocab, rows):
    g = torch.Generator().manual_seed(vocab + rows)
    x = torch.randn(rows, vocab, generator=g)
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))


def test_ties_nan_and_extremes_resolve_as_torch_does():
    vocab = 50265
    x = torch.randn(12, vocab, generator=torch.Generator().manual_seed(0))
    last_full = (vocab // ARGMAX_CHUNK) * ARGMAX_CHUNK
    x[0, [7, 9000, 40000]] = 50.0  # tie across chunks: the first index wins
    x[1, [600, 601]] = 50.0  # tie inside one chunk
    x[2, vocab - 1] = 50.0  # maximum at the very last column (the tail chunk)
    x[3, last_full] = 50.0  # first column of the tail chunk
    x[4, [last_full - 1, vocab - 1]] = 50.0  # tie between the last full chunk and the tail
    x[5, 12345] = float("nan")  # NaN counts as the maximum
    x[6, [30000, 20000]] = float("nan")  # first NaN wins
    x[6, 5] = float("inf")
    x[7, 0] = float("inf")
    x[8] = -float("inf")  # every column equal: index 0
    x[9] = 0.0
    x[10, vocab - 1] = float("nan")
    x[11, [ARGMAX_CHUNK - 1, ARGMAX_CHUNK]] = 50.0  # tie across a chunk boundary
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))
    assert argmax_rows(x)[:5].tolist() == [7, 600, vocab - 1, last_full, last_full - 1]


def test_strided_rows_and_other_dtypes():
    x = torch.randn(64, 2 * 50265, generator=torch.Generator().manual_seed(1))
    view = x[:, ::2]  # column stride 2: not chunkable, falls back
    assert torch.equal(argmax_rows(view), view.argmax(dim=-1))
    rows = x[:, :50265]  # row stride larger than the row: chunked
    assert torch.equal(argmax_rows(rows), rows.argmax(dim=-1))
    for dtype in (torch.bfloat16, torch.float16, torch.float64):
        y = rows.to(dtype)
        assert torch.equal(argmax_rows(y), y.argmax(dim=-1))
    empty = torch.empty(0, 50265)
    assert argmax_rows(empty).shape == (0,)


def test_rejects_a_tensor_that_is_not_2d():
    with pytest.raises(ValueError, match=r"2-D .*\(4,\)"):
        argmax_rows(torch.zeros(4))


@pytest.mark.parametrize("vocab", [1000, 2000, 2001, 4095])
def test_small_vocabularies_take_small_chunks_with_ties_and_nan(vocab):
    """Below 16 chunks of 512 the chunk shrinks (to >= 64 columns): ties across the small
    chunks' boundaries, NaN and the tail still resolve as torch's argmax does."""
    from tandem.core.worker.reductions import MIN_CHUNKS

    chunk = max(64, vocab // MIN_CHUNKS)
    x = torch.randn(6, vocab, generator=torch.Generator().manual_seed(vocab))
    x[0, [chunk - 1, chunk]] = 9.0  # across the first boundary
    x[1, [3 * chunk, vocab - 1]] = 9.0
    x[2, vocab - 1] = 9.0  # the tail
    x[3, [5, 2 * chunk + 1]] = float("nan")
    x[4] = 1.0
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))
    assert argmax_rows(x)[:3].tolist() == [chunk - 1, 3 * chunk, vocab - 1]


@pytest.mark.parametrize("vocab", [1, 2, 15, 16, 17, 31, 63, 64, 65, 127, 128, 129, 2000])
def test_short_rows_every_vector_tail(vocab, path):
    """Lengths around the vector widths (8 and 16 lanes, 4 accumulators): ties, NaN,
    +-inf and all -inf rows at each boundary, against torch's argmax."""
    g = torch.Generator().manual_seed(vocab)
    x = torch.randint(-3, 3, (40, vocab), generator=g).float()  # many ties
    if vocab > 1:
        x[0, vocab // 2] = float("nan")
        x[1, vocab - 1] = float("nan")
        x[2, 0] = float("inf")
        x[3, vocab - 1] = float("inf")
        x[4] = -float("inf")
        x[5, [vocab - 1, 0]] = float("nan")
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))


def test_the_op_is_built_for_the_capability_torch_reports(path):
    """Its library is named (and flagged) for torch's capability, so an AVX-512 build is
    never handed to an AVX2 CPU through a shared cache."""
    from tandem.backends import cpp_build
    from tandem.backends.cpu_sampling import ops

    assert ops.library_name("AVX512") == "tandem_cpu_sampling_avx512"
    assert ops.library_name("AVX2") == "tandem_cpu_sampling_avx2"
    assert ops.library_name("DEFAULT") == "tandem_cpu_sampling_generic"
    assert cpp_build.ISA_FLAGS["AVX2"] == ["-mavx2", "-mfma"]


def test_the_cpu_paged_backend_installs_the_op(path, monkeypatch):
    """An attention layer on cpu_paged installs the C++ argmax for the sampler."""
    from tandem.backends.cpu_paged import ops as paged_ops
    from tandem.backends.cpu_paged.backend import CPUPagedImpl

    if path != "cpp":
        pytest.skip("the C++ path's wiring")
    try:
        paged_ops.load()
    except paged_ops.CPUOpUnavailable as e:
        pytest.skip(f"cpu_paged's op cannot be built here: {e}")
    monkeypatch.setattr(reductions, "_cpu_op", None)
    CPUPagedImpl(num_heads=2, head_size=16, scale=0.25, num_kv_heads=2)
    assert reductions._cpu_op is torch.ops.tandem_cpu_sampling.argmax_rows
