"""Linear-layer kernels (packed oneDNN, int8 dynamic) against a float64 reference,
and their selection. (dtype="auto" is tests/core/test_dtype.py's.)"""

import math

import pytest
import torch
import torch.nn.functional as F

from tandem import LLM, SamplingParams
from tandem.core.config import EngineConfig
from tandem.core.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from tandem.core.layers.linear_kernels import (
    DENSE_MAX_WEIGHTS,
    DenseKernel,
    Int8DynamicKernel,
    PackedCPUKernel,
    fused_epilogues,
    packed_beats_dense,
    packed_gemm_unsupported,
)
from tandem.core.layers.kernel_setup import prepare_linear_kernels

CPU = torch.device("cpu")
needs_packed = pytest.mark.skipif(bool(packed_gemm_unsupported(CPU, torch.float32)),
                                  reason="no oneDNN packed GEMM in this build")


def _layer(cls, n_in, n_out, seed):
    g = torch.Generator().manual_seed(seed)
    layer = cls(n_in, n_out)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(n_out, n_in, generator=g) / math.sqrt(n_in))
        layer.bias.copy_(torch.randn(n_out, generator=g))
    return layer, g


def _reference(layer_weight, bias, x, activation):
    y = F.linear(x.double(), layer_weight.double(), bias.double())
    return {None: y, "gelu": F.gelu(y), "relu": F.relu(y)}[activation]


@needs_packed
@pytest.mark.parametrize("activation", [None, "gelu", "relu"])
@pytest.mark.parametrize("shape", [(1, 96), (7, 96), (3, 5, 96), (130, 96)])
def test_packed_kernel_matches_float64(activation, shape):
    layer, g = _layer(ColumnParallelLinear, 96, 160, seed=len(shape) + shape[0])
    w, b = layer.weight.clone(), layer.bias.clone()
    x = torch.randn(*shape, generator=g)
    layer.set_kernel(PackedCPUKernel(layer.weight, batch_hint=16))
    assert layer.weight.numel() == 0  # the dense copy is released
    y = layer(x, activation=activation)
    ref = _reference(w, b, x, activation)
    assert y.shape == (*shape[:-1], 160) and y.dtype == torch.float32
    # float32 dot products of length 96 with O(1) terms: error ~ sqrt(96) * 2^-24 * |terms| ~ 1e-6;
    # 1e-5 relative (norm-wise) leaves room for any blocking order.
    assert ((y.double() - ref).norm() / ref.norm()).item() < 1e-5


def _kernel(name, layer):
    if name == "packed":
        return PackedCPUKernel(layer.weight, batch_hint=16)
    if name == "int8":
        return Int8DynamicKernel(layer.weight, layer.bias)
    return DenseKernel()


@pytest.mark.parametrize("kernel", ["dense", "packed", "int8"])
@pytest.mark.parametrize("layout", ["contiguous", "strided"])
def test_row_parallel_residual_equals_adding_it_after(kernel, layout):
    """``layer(x, residual=r)`` (oneDNN's binary post-op for a packed kernel and a dense
    residual; an in-place add after the GEMM otherwise) is bit-equal to ``r + layer(x)``
    in float32, and a float64 reference confirms the residual is there at all."""
    if kernel == "packed" and packed_gemm_unsupported(CPU, torch.float32):
        pytest.skip("no oneDNN packed GEMM in this build")
    layer, g = _layer(RowParallelLinear, 96, 64, seed=21)
    w, b = layer.weight.clone(), layer.bias.clone()
    layer.set_kernel(_kernel(kernel, layer))
    x = torch.randn(37, 96, generator=g)
    r = torch.randn(37, 64, generator=g) * 3
    if layout == "strided":  # a residual oneDNN cannot take: the fallback add
        r = torch.randn(64, 37, generator=g).T * 3
    expected = r + layer(x)
    y = layer(x, residual=r)
    assert torch.equal(y, expected)
    ref = _reference(w, b, x, None) + r.double()
    bound = 0.05 if kernel == "int8" else 1e-5  # the int8 quantization error (see below), or float32 rounding
    assert ((y.double() - ref).norm() / (ref - r.double()).norm()).item() < bound
    assert torch.equal(r, r.clone())  # the residual itself is left alone
    if kernel != "int8":
        assert not torch.equal(layer(x, residual=r), layer(x))


# bart-base's layers: fused QKV, attention out, FFN in and out, the LM head ([out, in] as in_features, out_features).
BART_BASE_SHAPES = [(768, 2304), (768, 768), (768, 3072), (3072, 768), (768, 50265)]
# The tiny BART of benchmarks/host_overhead.py (d_model 64, FFN 256): QKV, attention out,
# cross K/V, FFN in and out; and the test suite's (d_model 32, FFN 64, vocab 96).
TINY_SHAPES = [(64, 192), (64, 64), (64, 128), (64, 256), (256, 64), (32, 96), (32, 64), (64, 32)]


def test_auto_packs_bart_base_layers_and_leaves_tiny_ones_dense():
    """The rule (linear_kernels.packed_beats_dense, docs/performance.md "Small layers stay
    dense"): float32 layers of at most DENSE_MAX_WEIGHTS weights run F.linear, bart-base's all
    pack; bfloat16 packs whatever the size (its F.linear is a oneDNN matmul too)."""
    for k, n in TINY_SHAPES:
        assert not packed_beats_dense(k, n, torch.float32), (k, n)
        assert packed_beats_dense(k, n, torch.bfloat16), (k, n)
    for k, n in BART_BASE_SHAPES:
        assert packed_beats_dense(k, n, torch.float32), (k, n)
    # The tiny model's LM head (64 x 2000 vocab) is past the bar: oneDNN wins at decode batches.
    assert packed_beats_dense(64, 2000, torch.float32)
    assert not packed_beats_dense(256, 256, torch.float32)  # the bar itself: 256 x 256 = DENSE_MAX_WEIGHTS
    assert packed_beats_dense(1, DENSE_MAX_WEIGHTS + 1, torch.float32)


class _Mixed(torch.nn.Module):
    """A tiny layer, a bart-base-sized one, and a small-vocabulary LM head."""

    def __init__(self):
        super().__init__()
        self.tiny = ColumnParallelLinear(64, 64)
        self.big = RowParallelLinear(768, 768)
        self.head = VocabParallelEmbedding(96, 32)


@needs_packed
def test_prepare_chooses_by_shape_under_auto_and_packs_everything_when_asked():
    model = _Mixed()
    said = prepare_linear_kernels(model, device=CPU, dtype=torch.float32)
    assert isinstance(model.tiny.kernel, DenseKernel) and model.tiny.weight.shape == (64, 64)
    assert isinstance(model.big.kernel, PackedCPUKernel) and model.big.weight.numel() == 0
    assert model.head.logits_kernel is None  # the head runs F.linear on the table
    assert said.startswith("linear layers: 2 x dense, 1 x packed (dense: float32 layers of at most")
    model = _Mixed()
    said = prepare_linear_kernels(model, device=CPU, dtype=torch.float32, gemm="packed")
    assert isinstance(model.tiny.kernel, PackedCPUKernel) and isinstance(model.head.logits_kernel, PackedCPUKernel)
    assert said.startswith("linear layers: 3 x packed")
    said = prepare_linear_kernels(_Mixed(), device=CPU, dtype=torch.float32, gemm="dense")
    assert said.startswith("linear layers: dense F.linear (cpu_gemm='dense')")


@needs_packed
@pytest.mark.parametrize("activation", [None, "relu", "gelu"])
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("shape", [(64, 64), (64, 256), (768, 768), (3072, 768)], ids=str)
def test_dense_and_packed_kernels_agree_within_float32_accumulation(shape, activation, residual):
    """The kernel the rule picks changes no result beyond float32 rounding. Each output is a
    dot product of length K = in_features plus the bias; summed in any order (oneDNN and
    MKL block K differently, with or without FMA), its error is at most
    gamma_{K+1} * sum_i |x_i w_i| + |b|, gamma_n = n u / (1 - n u), u = 2^-24 (Higham,
    Accuracy and Stability, 3.1), so two kernels differ by at most twice that. The
    activation is 1.13-Lipschitz at worst (GELU; ReLU 1) and rounds once more, the residual
    add once more: 4 u (|y| + |r|) covers both roundings. The bound is elementwise and
    worst-case (no flake); a dropped bias, residual or activation is off by O(1)."""
    n_in, n_out = shape
    layer, g = _layer(ColumnParallelLinear, n_in, n_out, seed=n_in + n_out)
    w, b = layer.weight.clone(), layer.bias.clone()
    x = torch.randn(37, n_in, generator=g)
    r = torch.randn(37, n_out, generator=g) if residual else None
    # The kernels themselves, as a layer calls them (activation and residual in one call).
    dense = DenseKernel()(layer, x, layer.bias, activation, residual=r)
    packed = PackedCPUKernel(layer.weight, batch_hint=16)(layer, x, layer.bias, activation, residual=r)
    u = 2.0 ** -24
    gamma = (n_in + 1) * u / (1 - (n_in + 1) * u)
    terms = x.double().abs() @ w.double().abs().T + b.double().abs()
    bound = 2 * 1.13 * gamma * terms + 4 * u * (dense.double().abs() + (0 if r is None else r.double().abs()))
    diff = (dense.double() - packed.double()).abs()
    assert (diff <= bound).all(), (diff / bound).max().item()
    ref = _reference(w, b, x, activation) + (0 if r is None else r.double())
    assert ((dense.double() - ref).abs() <= bound).all()  # and both are that close to float64


def test_row_parallel_residual_under_tensor_parallelism_needs_reduced_results():
    layer = RowParallelLinear(8, 4, reduce_results=False, tp_size=2, tp_rank=0)
    with pytest.raises(ValueError, match="a residual needs reduce_results=True when tp_size > 1"):
        layer(torch.zeros(3, 4), residual=torch.zeros(3, 4))


def test_gelu_is_fused_into_the_gemm_only_on_avx512():
    """The erf-GELU epilogue lost to a separate GELU on an AVX2 EPYC and won on an AVX-512
    one (docs/performance.md); ReLU is fused everywhere."""
    assert "gelu" not in fused_epilogues("AVX2") and "relu" in fused_epilogues("AVX2")
    assert "gelu" in fused_epilogues("AVX512") and "relu" in fused_epilogues("AVX512")
    assert "gelu" not in fused_epilogues("DEFAULT")


@needs_packed
def test_packed_lm_head_keeps_the_table_for_lookups():
    emb = VocabParallelEmbedding(300, 64)
    with torch.no_grad():
        emb.weight.copy_(torch.randn(300, 64))
    table = emb.weight.clone()
    ids = torch.tensor([0, 5, 299])
    h = torch.randn(4, 64)
    emb.logits_kernel = PackedCPUKernel(emb.weight, 8)
    assert torch.equal(emb(ids), table[ids])
    ref = h.double() @ table.double().T
    assert ((emb.logits(h).double() - ref).norm() / ref.norm()).item() < 1e-5


def test_int8_kernel_error_within_the_quantization_bound():
    layer, g = _layer(RowParallelLinear, 256, 128, seed=3)
    w, b = layer.weight.clone(), layer.bias.clone()
    layer.set_kernel(Int8DynamicKernel(layer.weight, layer.bias))
    x = torch.randn(64, 256, generator=g)
    ref = _reference(w, b, x, None)
    y = layer(x)
    # Weights: symmetric int8 per output row, step max|w_row| / 127 (~3.2 sigma / 127 for
    # Gaussian rows), relative RMS error ~ 0.025 / sqrt(12) = 0.7%. Activations: one
    # 7-bit (reduce_range) asymmetric scale for the whole tensor, step ~8.6 sigma / 127,
    # relative RMS error ~ 0.068 / sqrt(12) = 2.0%. Together ~2.1%; the bias (exact) only
    # lowers it. Bar: 5%. A kernel that ignored the scales would be off by orders of magnitude.
    rel = ((y.double() - ref).norm() / ref.norm()).item()
    assert rel < 0.05
    assert rel > 1e-4  # it really is quantized (not a float path in disguise)


def test_int8_lm_head_adds_the_call_time_bias_and_keeps_the_table():
    # BART's final_logits_bias reaches the LM head at call time, not inside the packed weight.
    emb = VocabParallelEmbedding(300, 64)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        emb.weight.copy_(torch.randn(300, 64, generator=g) / 8)
    table = emb.weight.clone()
    prepare_linear_kernels(emb, device=CPU, dtype=torch.float32, quantization="int8")
    assert isinstance(emb.logits_kernel, Int8DynamicKernel)
    ids = torch.tensor([0, 7, 299])
    assert torch.equal(emb(ids), table[ids])  # lookups still read the float32 table
    h, bias = torch.randn(9, 64, generator=g), torch.randn(300, generator=g)
    ref = h.double() @ table.double().T + bias.double()
    # The logits' own error is the kernel test's ~2% of |h @ table^T|; the bias is added exactly,
    # so a dropped bias (relative size ~1 here) would be far past the 5% bar.
    rel = ((emb.logits(h, bias=bias).double() - ref).norm() / (ref - bias.double()).norm()).item()
    assert 1e-4 < rel < 0.05


def test_prepare_refuses_what_cannot_run():
    layer, _ = _layer(ColumnParallelLinear, 8, 8, seed=0)
    with pytest.raises(ValueError, match="cpu_gemm='fast'"):
        prepare_linear_kernels(layer, device=CPU, dtype=torch.float32, gemm="fast")
    with pytest.raises(ValueError, match="quantization='int4'"):
        prepare_linear_kernels(layer, device=CPU, dtype=torch.float32, quantization="int4")
    with pytest.raises(ValueError, match="int8 dynamic quantization computes in float32"):
        prepare_linear_kernels(layer, device=CPU, dtype=torch.bfloat16, quantization="int8")
    with pytest.raises(ValueError, match="cpu_gemm='packed' cannot run here: device cuda is not cpu"):
        prepare_linear_kernels(layer, device=torch.device("cuda"), dtype=torch.float32, gemm="packed")
    assert "dense" in prepare_linear_kernels(layer, device=CPU, dtype=torch.float32, gemm="dense")


@pytest.mark.parametrize("native", [False, True], ids=["no-onednn-bf16", "onednn-bf16"])
def test_bfloat16_is_packed_only_where_onednn_runs_it(monkeypatch, native):
    """Both branches on any machine (AVX2 CPUs have no oneDNN bf16 GEMM; AVX-512 ones do)."""
    from tandem.core.layers import linear_kernels

    monkeypatch.setattr(linear_kernels, "onednn_bf16_gemm", lambda: native)
    layer, _ = _layer(ColumnParallelLinear, 8, 8, seed=0)
    layer.to(torch.bfloat16)
    if not native:
        said = prepare_linear_kernels(layer, device=CPU, dtype=torch.bfloat16)
        assert said.startswith("linear layers: dense F.linear (oneDNN has no bfloat16 GEMM on this CPU")
        with pytest.raises(ValueError, match="cpu_gemm='packed' cannot run here: oneDNN has no bfloat16 GEMM"):
            prepare_linear_kernels(layer, device=CPU, dtype=torch.bfloat16, gemm="packed")
    else:
        assert packed_gemm_unsupported(CPU, torch.bfloat16) == packed_gemm_unsupported(CPU, torch.float32)


@pytest.mark.parametrize("gemm", ["dense", "packed"])
def test_bfloat16_kernels_within_bfloat16_rounding(gemm):
    """bf16 weights and inputs on both sides: what differs is float32 accumulation and the
    output's rounding to bf16 (2^-9 relative each element, ~1.1e-3 RMS)."""
    if gemm == "packed" and packed_gemm_unsupported(CPU, torch.bfloat16):
        pytest.skip("no oneDNN bfloat16 GEMM on this CPU: " + "; ".join(packed_gemm_unsupported(CPU, torch.bfloat16)))
    layer, g = _layer(ColumnParallelLinear, 96, 160, seed=11)
    layer.to(torch.bfloat16)
    w, b = layer.weight.clone(), layer.bias.clone()
    x = torch.randn(7, 96, generator=g).to(torch.bfloat16)
    prepare_linear_kernels(layer, device=CPU, dtype=torch.bfloat16, gemm=gemm)
    y = layer(x)
    assert y.dtype == torch.bfloat16
    ref = _reference(w, b, x, None)
    assert ((y.double() - ref).norm() / ref.norm()).item() < 2 ** -8


def test_engine_arguments_are_checked_at_construction(bart_dir):
    with pytest.raises(ValueError, match="quantization='int4'"):
        EngineConfig(model=str(bart_dir), quantization="int4")
    with pytest.raises(ValueError, match="cpu_gemm='turbo'"):
        EngineConfig(model=str(bart_dir), cpu_gemm="turbo")
    with pytest.raises(ValueError, match="dtype='fp8'"):
        EngineConfig(model=str(bart_dir), dtype="fp8")


@pytest.mark.parametrize("gemm", ["dense", "packed"])
def test_bart_greedy_is_the_same_through_every_float_kernel(bart_dir, gemm):
    if gemm == "packed" and packed_gemm_unsupported(CPU, torch.float32):
        pytest.skip("no oneDNN packed GEMM in this build")
    prompts = ["the rain in spain", "old king cole was a merry old soul", "a"]
    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=0)
    ref = LLM(model=str(bart_dir), dtype="float32", device="cpu", cpu_gemm="dense").generate(
        prompts, params, use_tqdm=False)
    out = LLM(model=str(bart_dir), dtype="float32", device="cpu", cpu_gemm=gemm).generate(
        prompts, params, use_tqdm=False)
    for a, b in zip(out, ref):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        # Same arithmetic up to GEMM blocking: float32 logprobs agree far below any token margin.
        assert a.outputs[0].cumulative_logprob == pytest.approx(b.outputs[0].cumulative_logprob, abs=1e-3)


@pytest.fixture(scope="module")
def calm_dir(tmp_path_factory):
    from helpers import TINY_DIMS, make_bart

    # Weights ~ 1/sqrt(d_model): activations and attention logits stay O(1), as in trained
    # models. (The suite's wide-weight checkpoint saturates its softmaxes, so any 1% change
    # flips attention; int8 there says nothing about int8 on a real model.)
    return make_bart(tmp_path_factory.mktemp("calm8") / "ckpt", seed=1, weight_std=TINY_DIMS["d_model"] ** -0.5)


def test_int8_engine_tracks_float32_teacher_forced(calm_dir):
    """int8 scores the float32 model's greedy continuation almost as float32 does."""
    prompts = ["the rain in spain", "old king cole was a merry old soul"]
    fp32 = LLM(model=str(calm_dir), dtype="float32", device="cpu")
    int8 = LLM(model=str(calm_dir), dtype="float32", device="cpu", quantization="int8")
    assert "int8" in int8.llm_engine.worker.linear_kernels
    start = fp32.llm_engine.model_cls.decoder_start_token_id(fp32.llm_engine.hf_config)
    worst, prefix = 0.0, [start]
    for p in prompts:
        for _ in range(6):  # follow float32's greedy path, scoring each step with both engines
            forced = {"encoder_prompt": p, "decoder_prompt": {"prompt_token_ids": prefix}}
            params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=20)
            a = fp32.generate([forced], params, use_tqdm=False)[0].outputs[0]
            b = int8.generate([forced], params, use_tqdm=False)[0].outputs[0]
            tok = a.token_ids[0]
            assert tok in b.logprobs[0], "the float32 token fell out of int8's top 20"
            worst = max(worst, abs(_lp(b.logprobs[0][tok]) - _lp(a.logprobs[0][tok])))
            prefix = prefix + [tok]
        prefix = [start]
    # Each int8 layer perturbs its output by ~1-2% (RMS, see the kernel test); through
    # 2 + 2 layers and the int8 head that moves a logprob by a few hundredths (observed
    # worst over these 12 steps: 0.032 nats with a float32 head, 0.055 with the int8 head).
    # Bar: 0.15, about 3x; a wrong scale or a dropped bias moves logprobs by whole nats.
    assert worst < 0.15, worst


def _lp(x):
    return getattr(x, "logprob", x)


@needs_packed
def test_decoder_is_packed_for_max_num_seqs_and_the_encoder_for_whole_inputs(bart_dir):
    """With max_num_seqs=1 a decode step has one row: the decoder's layers and the LM
    head are packed for 1 row, the encoder's (whole sources) for ENCODER_BATCH_HINT;
    outputs stay those of the dense F.linear path."""
    from tandem.core.layers.kernel_setup import ENCODER_BATCH_HINT

    prompts = ["the rain in spain", "old king cole was a merry old soul"]
    params = SamplingParams(temperature=0.0, max_tokens=12)
    # cpu_gemm="packed": under "auto" the suite's tiny layers would all stay dense.
    llm = LLM(model=str(bart_dir), dtype="float32", device="cpu", max_num_seqs=1, cpu_gemm="packed")
    model = llm.llm_engine.worker.model
    hints = {}
    for name, module in model.named_modules():
        kernel = getattr(module, "kernel", None) or getattr(module, "logits_kernel", None)
        if isinstance(kernel, PackedCPUKernel):
            hints[name] = kernel.batch_hint
    encoder = {n: h for n, h in hints.items() if ".encoder." in f".{n}."}
    decoder = {n: h for n, h in hints.items() if n not in encoder}
    assert encoder and decoder
    assert set(encoder.values()) == {ENCODER_BATCH_HINT}, encoder
    assert set(decoder.values()) == {1}, decoder
    assert any("decoder" in n for n in decoder) and any("fc1" in n for n in decoder)
    ref = LLM(model=str(bart_dir), dtype="float32", device="cpu", cpu_gemm="dense").generate(
        prompts, params, use_tqdm=False)
    out = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in ref]
