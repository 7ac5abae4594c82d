// tandem's CPU flash attention for bfloat16 encoder runs on avx512_bf16 CPUs:
// softmax(Q K^T * scale) V over each run's own positions, no mask, no bias
// (Whisper's encoder: 1,500 positions, head size 64).
//
// PyTorch's CPU flash kernel gains nothing from bfloat16 without AMX (it runs a
// bf16 GEMM per block with K = 64 and converts the block's probabilities, at its
// float32 rate). Here both products run on the bf16 dot-product instruction
// (vdpbf16ps: 32 bf16 products summed pairwise into 16 float32 lanes):
//
// - K and V are repacked once per (run, head) into the pair-interleaved layouts
//   the instruction reads: K as 16-key groups whose lanes are keys and whose
//   pairs run over the head dimension; V as key pairs whose lanes are dimensions.
// - A task is one (run, head, block of kQ query rows). Over key blocks of kK keys:
//   S = Q K^T in float32 (8 rows x 32 keys a micro-kernel), an online softmax in
//   float32 (exp2 of scale * log2 e * (s - row max), one fma and a degree-5
//   polynomial; the max taken as the scores are stored), P rounded to bf16 (as flash
//   kernels on GPUs do), O += P V in float32 (8 rows x 32 dims a micro-kernel),
//   O rescaled when a row's max grows. O / l is stored as bf16.
//
// Numerics: bf16 inputs, float32 products and sums; each probability's rounding to
// bf16 is a relative error of at most 2^-8 (bf16's unit roundoff) in its weight,
// and the output's rounding another 2^-8; l sums the float32 probabilities. A task's arithmetic depends only on its run, head and rows, so
// the output is bit for bit the same whatever the thread count.
//
// Built only with -mavx512bf16 (ops.py) and called only where the CPU has it.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

// Block sizes: [2, 8, 1500, 64] on one Zen 4 core ran 155 GFLOP/s at 64 x 128,
// 161-164 at 32-64 x 256-512 (fewer per-block reductions and rescales); 32 rows
// give a 1,500-position run 47 tasks per head to spread over the threads.
constexpr int64_t kQ = 32;   // query rows of a task
constexpr int64_t kK = 256;  // keys of a block (a multiple of 32)
constexpr int64_t kRows = 8; // query rows of a micro-kernel

using u16 = uint16_t;

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// 2^x for x <= 0 in float32: x = n + f, |f| <= 1/2, 2^f by its degree-5 Taylor
// polynomial (coefficients ln2^k / k!; relative error < 3e-6, a thousandth of the
// bf16 rounding each probability then takes), scaled by 2^n with vscalefps, which
// gives 0 for n below float32's range. Finite x only: the caller masks the lanes
// past a run's last key.
inline __m512 exp2_nonpositive(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(1.3333558146428443e-3f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618129107628477e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550410866482158e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.2402265069591007f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.6931471805599453f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// K of one (run, head), n keys, as 16-key groups: element (key, d) at
// (key / 16) * 16 D + (d / 2) * 32 + (key % 16) * 2 + d % 2. Keys past n are 0.
void pack_k(const u16* k, int64_t k_st, int64_t n, int64_t d, u16* out) {
  const int64_t np = round_up(std::max<int64_t>(n, 1), kK);
  std::memset(out, 0, np * d * sizeof(u16));
  for (int64_t j = 0; j < n; ++j) {
    const uint32_t* src = reinterpret_cast<const uint32_t*>(k + j * k_st);
    uint32_t* dst = reinterpret_cast<uint32_t*>(out + (j / 16) * 16 * d) + (j % 16);
    for (int64_t p = 0; p < d / 2; ++p) dst[p * 16] = src[p];
  }
}

// V of one (run, head) as key pairs: element (key, d) at (key / 2) * 2 D + d * 2 + key % 2.
void pack_v(const u16* v, int64_t v_st, int64_t n, int64_t d, u16* out) {
  const int64_t np = round_up(std::max<int64_t>(n, 1), kK);
  std::memset(out, 0, np * d * sizeof(u16));
  for (int64_t j = 0; j < n; ++j) {
    const u16* src = v + j * v_st;
    u16* dst = out + (j / 2) * 2 * d + (j % 2);
    for (int64_t c = 0; c < d; ++c) dst[c * 2] = src[c];
  }
}

// s[r][0..31] = q_r . k for 8 rows (q: 8 rows of d bf16, stride d) and the 32 keys
// of two packed 16-key groups starting at kp.
// Each row's lane-wise running max over the chunk's first `live` keys goes into
// vmax[r] (the keys past a run's end score 0 and must not raise it).
inline void scores_8x32(const u16* q, const u16* kp, int64_t d, int64_t live, float* s, int64_t s_st,
                        __m512* vmax) {
  __m512 acc[kRows][2];
  for (int r = 0; r < kRows; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  const u16* kp1 = kp + 16 * d;
  for (int64_t p = 0; p < d / 2; ++p) {
    const __m512bh k0 = (__m512bh)_mm512_loadu_si512(kp + p * 32);
    const __m512bh k1 = (__m512bh)_mm512_loadu_si512(kp1 + p * 32);
    for (int r = 0; r < kRows; ++r) {
      int32_t pair;
      std::memcpy(&pair, q + r * d + 2 * p, sizeof(pair));
      const __m512bh qb = (__m512bh)_mm512_set1_epi32(pair);
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], qb, k0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], qb, k1);
    }
  }
  for (int r = 0; r < kRows; ++r) {
    _mm512_storeu_ps(s + r * s_st, acc[r][0]);
    _mm512_storeu_ps(s + r * s_st + 16, acc[r][1]);
  }
  if (live >= 32) {
    for (int r = 0; r < kRows; ++r) vmax[r] = _mm512_max_ps(vmax[r], _mm512_max_ps(acc[r][0], acc[r][1]));
  } else {
    const __mmask16 k0 = live >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << live) - 1);
    const __mmask16 k1 = live >= 32 ? 0xFFFF : static_cast<__mmask16>((1u << std::max<int64_t>(live - 16, 0)) - 1);
    for (int r = 0; r < kRows; ++r)
      vmax[r] = _mm512_mask_max_ps(_mm512_mask_max_ps(vmax[r], k0, vmax[r], acc[r][0]), k1, vmax[r], acc[r][1]);
  }
}

// o[r][0..31] += p_r . V[:, c0..c0+31] for 8 rows of bf16 probabilities (m keys,
// m even, stride p_st) and packed key pairs vp (2 D a pair), dims c0..c0+31.
inline void pv_8x32(const u16* p, int64_t p_st, const u16* vp, int64_t d, int64_t m, int64_t c0, float* o,
                    int64_t o_st) {
  __m512 acc[kRows][2];
  for (int r = 0; r < kRows; ++r) {
    acc[r][0] = _mm512_loadu_ps(o + r * o_st + c0);
    acc[r][1] = _mm512_loadu_ps(o + r * o_st + c0 + 16);
  }
  for (int64_t j = 0; j < m / 2; ++j) {
    const u16* vj = vp + j * 2 * d + c0 * 2;
    const __m512bh v0 = (__m512bh)_mm512_loadu_si512(vj);
    const __m512bh v1 = (__m512bh)_mm512_loadu_si512(vj + 32);
    for (int r = 0; r < kRows; ++r) {
      int32_t pair;
      std::memcpy(&pair, p + r * p_st + 2 * j, sizeof(pair));
      const __m512bh pb = (__m512bh)_mm512_set1_epi32(pair);
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], pb, v0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], pb, v1);
    }
  }
  for (int r = 0; r < kRows; ++r) {
    _mm512_storeu_ps(o + r * o_st + c0, acc[r][0]);
    _mm512_storeu_ps(o + r * o_st + c0 + 16, acc[r][1]);
  }
}

void attend(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, at::Tensor& out,
            const int64_t* runs, int64_t num_runs, double scale) {
  const int64_t heads = query.size(1), d = query.size(2);
  const u16* q_ptr = reinterpret_cast<const u16*>(query.data_ptr<c10::BFloat16>());
  const u16* k_ptr = reinterpret_cast<const u16*>(key.data_ptr<c10::BFloat16>());
  const u16* v_ptr = reinterpret_cast<const u16*>(value.data_ptr<c10::BFloat16>());
  u16* o_ptr = reinterpret_cast<u16*>(out.data_ptr<c10::BFloat16>());
  const int64_t q_st = query.stride(0), q_sh = query.stride(1);
  const int64_t k_st = key.stride(0), k_sh = key.stride(1);
  const int64_t v_st = value.stride(0), v_sh = value.stride(1);
  const int64_t o_st = out.stride(0), o_sh = out.stride(1);

  // Packed K and V of every (run, head), each padded to whole key blocks.
  std::vector<int64_t> packed_at(num_runs + 1, 0), blocks_at(num_runs + 1, 0);
  for (int64_t r = 0; r < num_runs; ++r) {
    const int64_t n = runs[2 * r + 1];
    packed_at[r + 1] = packed_at[r] + heads * round_up(std::max<int64_t>(n, 1), kK) * d;
    blocks_at[r + 1] = blocks_at[r] + heads * ((n + kQ - 1) / kQ);
  }
  std::vector<u16> kpack(packed_at[num_runs]), vpack(packed_at[num_runs]);
  auto packed = [&](int64_t r, int64_t h) {
    return packed_at[r] + h * round_up(std::max<int64_t>(runs[2 * r + 1], 1), kK) * d;
  };
  at::parallel_for(0, num_runs * heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t r = t / heads, h = t % heads, s = runs[2 * r], n = runs[2 * r + 1];
      pack_k(k_ptr + s * k_st + h * k_sh, k_st, n, d, kpack.data() + packed(r, h));
      pack_v(v_ptr + s * v_st + h * v_sh, v_st, n, d, vpack.data() + packed(r, h));
    }
  });

  const float ls = static_cast<float>(scale * 1.44269504088896340736);  // scores to base 2
  at::parallel_for(0, blocks_at[num_runs], 1, [&](int64_t begin, int64_t end) {
    std::vector<u16> qt(kQ * d), pt(kQ * kK);
    std::vector<float> st(kQ * kK), ot(kQ * d), mx(kQ), l(kQ * 16);
    std::vector<__m512> vmax(kQ);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t r = std::upper_bound(blocks_at.begin(), blocks_at.end(), t) - blocks_at.begin() - 1;
      const int64_t s = runs[2 * r], n = runs[2 * r + 1];
      const int64_t per_head = (n + kQ - 1) / kQ;
      const int64_t h = (t - blocks_at[r]) / per_head;
      const int64_t i0 = (t - blocks_at[r]) % per_head * kQ;
      const int64_t nq = std::min(kQ, n - i0), nq8 = round_up(nq, kRows);
      for (int64_t i = 0; i < nq8; ++i) {
        if (i < nq) std::memcpy(&qt[i * d], q_ptr + (s + i0 + i) * q_st + h * q_sh, d * sizeof(u16));
        else std::memset(&qt[i * d], 0, d * sizeof(u16));
      }
      std::fill(ot.begin(), ot.begin() + nq8 * d, 0.f);
      std::fill(mx.begin(), mx.end(), -std::numeric_limits<float>::infinity());
      std::fill(l.begin(), l.end(), 0.f);  // lane-wise partial sums per row, reduced at the end
      const u16* kp = kpack.data() + packed(r, h);
      const u16* vp = vpack.data() + packed(r, h);
      for (int64_t j0 = 0; j0 < n; j0 += kK) {
        const int64_t m = std::min(kK, n - j0), m32 = round_up(m, 32);
        for (int64_t i = 0; i < nq8; ++i) vmax[i] = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
        for (int64_t c = 0; c < m32; c += 32)
          for (int64_t i = 0; i < nq8; i += kRows)
            scores_8x32(&qt[i * d], kp + (j0 + c) * d, d, m - c, &st[i * kK + c], kK, &vmax[i]);
        // Online softmax, base 2: row max, probabilities (bf16), the rescale of O and l.
        for (int64_t i = 0; i < nq8; ++i) {
          float* si = &st[i * kK];
          // Scores stay unscaled; exp2(ls * (s - max)) as one fma (ls > 0 keeps the max).
          const float m_new = std::max(mx[i], _mm512_reduce_max_ps(vmax[i]));
          // The rescale of O and l: none where the max held (most blocks after the first,
          // and a libm exp2 per row and block is ~5% of the arithmetic), 0 on the first block.
          const float alpha = m_new == mx[i] ? 1.f : mx[i] == -std::numeric_limits<float>::infinity()
                                                          ? 0.f : std::exp2(ls * (mx[i] - m_new));
          mx[i] = m_new;
          const __m512 vls = _mm512_set1_ps(ls), vm = _mm512_set1_ps(-ls * m_new);
          __m512 sum = _mm512_setzero_ps();
          u16* pi = &pt[i * kK];
          for (int64_t c = 0; c < m32; c += 32) {
            const __mmask16 live0 = m - c >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << std::max<int64_t>(m - c, 0)) - 1);
            const __mmask16 live1 = m - c >= 32 ? 0xFFFF : static_cast<__mmask16>((1u << std::max<int64_t>(m - c - 16, 0)) - 1);
            const __m512 p0 = _mm512_maskz_mov_ps(live0, exp2_nonpositive(_mm512_fmadd_ps(_mm512_loadu_ps(si + c), vls, vm)));
            const __m512 p1 = _mm512_maskz_mov_ps(live1, exp2_nonpositive(_mm512_fmadd_ps(_mm512_loadu_ps(si + c + 16), vls, vm)));
            sum = _mm512_add_ps(sum, _mm512_add_ps(p0, p1));
            _mm512_storeu_si512(pi + c, (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
          }
          _mm512_storeu_ps(&l[i * 16], _mm512_fmadd_ps(_mm512_loadu_ps(&l[i * 16]), _mm512_set1_ps(alpha), sum));
          if (alpha != 1.f) {
            const __m512 va = _mm512_set1_ps(alpha);
            for (int64_t c = 0; c < d; c += 16) _mm512_storeu_ps(&ot[i * d + c], _mm512_mul_ps(_mm512_loadu_ps(&ot[i * d + c]), va));
          }
        }
        for (int64_t i = 0; i < nq8; i += kRows)
          for (int64_t c = 0; c < d; c += 32) pv_8x32(&pt[i * kK], kK, vp + j0 * d, d, m32, c, &ot[i * d], d);
      }
      for (int64_t i = 0; i < nq; ++i) {
        const float li = _mm512_reduce_add_ps(_mm512_loadu_ps(&l[i * 16]));
        const __m512 inv = _mm512_set1_ps(li > 0.f ? 1.f / li : 0.f);
        u16* oi = o_ptr + (s + i0 + i) * o_st + h * o_sh;
        for (int64_t c = 0; c < d; c += 32) {
          const __m512 a = _mm512_mul_ps(_mm512_loadu_ps(&ot[i * d + c]), inv);
          const __m512 b = _mm512_mul_ps(_mm512_loadu_ps(&ot[i * d + c + 16]), inv);
          _mm512_storeu_si512(oi + c, (__m512i)_mm512_cvtne2ps_pbh(b, a));
        }
      }
    }
  });
}

void bf16_encoder_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                            at::Tensor& out, const at::Tensor& runs, double scale) {
  TORCH_CHECK(query.device().is_cpu() && key.device().is_cpu() && value.device().is_cpu() && out.device().is_cpu(),
              "bf16_encoder_attention: tensors must be on cpu");
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&query, &key, &value, &out}) {
    TORCH_CHECK(t->scalar_type() == at::kBFloat16, "bf16_encoder_attention: tensors must be bfloat16, got ",
                t->scalar_type());
    TORCH_CHECK(t->dim() == 3 && t->sizes() == query.sizes(),
                "bf16_encoder_attention: query, key, value and out must all be [T, H, D] of one shape, got ",
                t->sizes(), " against the query's ", query.sizes());
    TORCH_CHECK(t->stride(2) == 1, "bf16_encoder_attention: the head dimension must be contiguous");
  }
  TORCH_CHECK(query.size(2) % 32 == 0 && query.size(2) > 0,
              "bf16_encoder_attention: head size ", query.size(2), " is not a multiple of 32");
  TORCH_CHECK(runs.device().is_cpu() && runs.scalar_type() == at::kLong && runs.dim() == 2 && runs.size(1) == 2 &&
                  runs.is_contiguous(),
              "bf16_encoder_attention: runs must be a contiguous int64 [R, 2] cpu tensor of (start, length), got ",
              runs.scalar_type(), " ", runs.sizes());
  const int64_t* r = runs.data_ptr<int64_t>();
  for (int64_t i = 0; i < runs.size(0); ++i)
    TORCH_CHECK(r[2 * i] >= 0 && r[2 * i + 1] >= 0 && r[2 * i] + r[2 * i + 1] <= query.size(0),
                "bf16_encoder_attention: run ", i, " (start ", r[2 * i], ", length ", r[2 * i + 1],
                ") does not lie within the ", query.size(0), " rows");
  attend(query, key, value, out, r, runs.size(0), scale);
}

}  // namespace

TORCH_LIBRARY(tandem_cpu_flash, m) {
  m.def("bf16_encoder_attention(Tensor query, Tensor key, Tensor value, Tensor(a!) out, Tensor runs, "
        "float scale) -> ()");
}

TORCH_LIBRARY_IMPL(tandem_cpu_flash, CPU, m) { m.impl("bf16_encoder_attention", &bf16_encoder_attention); }
