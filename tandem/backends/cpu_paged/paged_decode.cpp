// tandem's CPU paged decode attention: single-token queries attend over keys and
// values read in place from the paged cache [2, num_blocks, block_size, H_kv, D]
// through each sequence's block table; nothing is gathered into a padded batch.
//
// One task per sequence (or per sequence and run of KV heads when the batch is
// small). Rows that read the same K/V (a request's beams or n > 1 samples over its
// one cross table) may be passed as a group (kv_groups: offsets into the rows): one
// task then serves all of them, a multi-query attention that reads each key and
// value once for the group instead of once per row; each row's arithmetic is the
// same as alone, so its result is bit for bit the ungrouped one. Storage may be
// float32, float16 or bfloat16; all arithmetic is float32. Tasks are spread over
// torch's intra-op threads.
//
// A task, where the head size is a whole number of vectors (kLanes floats: 16 on
// AVX-512, 8 on AVX2) and the storage has a vector load here (the vector path):
//   - each key's slot offset, once (the same for K and V);
//   - scores: keys kLanes at a time, each query vector of the task in turn (the run's
//     slots, all heads, come from memory once), one vector of partial sums a key,
//     reduced kLanes keys at a time by a transposing tree. A sequence's last, partial
//     run of every query vector is queued together (40 keys x 4 heads: 10 trees, not
//     12; tiny heads' short sequences are mostly such tails);
//   - the softmax in vectors over score rows padded to whole vectors with -inf;
//   - values: the query vectors in tiles whose accumulators stay in registers over
//     all the keys (one fused multiply-add a key and vector of the head), heads wider
//     than the registers allow in column slices.
// Every query vector's score of a key, its softmax and its weighted sum over the keys
// (in key order) depend only on its own data, never on which vectors share its run,
// queue, tile or task: groups, GQA splits and thread counts change no bit. Other head
// sizes and storage take scalar loops over the keys for the scores and values.

// An optional additive bias (T5's relative position bias) depends only on the
// distance from the query (the sequence's last position) to each key, so one
// float32 row [H, W] serves every sequence: the bias of a query at position
// W - 1 over keys 0..W-1. A sequence of length L adds its right-aligned tail,
// row[h, W - L + n] for key n; no bias, no extra pass.
//
// The cache may also be fp8 (float8 e4m3fn or e5m2, kv_cache_dtype="fp8") under a
// float32/float16/bfloat16 query: where the vector passes serve, 8 or 16 bytes at a time
// become float32 through float16's conversion (F16C; a table gather on AVX2 without it),
// in the score pass and the value pass alike; elsewhere each byte through a 256-entry
// table. The per-tensor scales are folded in where they cost
// nothing: k_scale into the query's softmax scale (q . (s k) = (s q) . k), v_scale
// into the softmax's 1 / sum. With scales 1.0 every other path is bit for bit as
// before.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

// Every fp8 byte's float32 value (the format's NaN bytes are never written: writes saturate).
template <typename F>
struct Fp8Table {
  alignas(64) float v[256];
  Fp8Table() {
    for (int i = 0; i < 256; ++i) v[i] = static_cast<float>(F(static_cast<uint8_t>(i), F::from_bits()));
  }
};
const Fp8Table<c10::Float8_e4m3fn> kE4M3;
const Fp8Table<c10::Float8_e5m2> kE5M2;

template <typename T>
inline float to_float(T x) { return static_cast<float>(x); }
inline float to_float(c10::Float8_e4m3fn x) { return kE4M3.v[x.x]; }
inline float to_float(c10::Float8_e5m2 x) { return kE5M2.v[x.x]; }

template <typename T>
inline float dot(const float* __restrict q, const T* __restrict k, int64_t d) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < d; ++i) s += q[i] * to_float(k[i]);
  return s;
}

template <typename T>
inline void axpy(float a, const T* __restrict v, float* __restrict acc, int64_t d) {
#pragma omp simd
  for (int64_t i = 0; i < d; ++i) acc[i] += a * to_float(v[i]);
}

// The score pass in vectors (float32 arithmetic whatever the storage): the scores
// of a run of keys are their dot products with one query vector. Each key's
// products are accumulated lane-wise (one vector of partial sums per key), and the
// partial sums of kLanes keys are then reduced together by a transposing tree
// (about 3 vector ops a dot, where a horizontal sum per dot takes ~8 and a
// dependent chain). Each key's sum depends only on its own partial vector (the tree
// adds lane l to lane l + kLanes/2, then halves again, and never mixes two keys),
// so a key's score is the same whichever run it sits in: a group's rows get bit for
// bit what they get alone. Used where the head size is a multiple of kLanes and
// the storage type has a vector load here; other cases take the scalar loop.
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#define TANDEM_SIMD 1
#if defined(__AVX512F__)
constexpr int64_t kLanes = 16;
using vec = __m512;
inline vec vzero() { return _mm512_setzero_ps(); }
inline vec vset1(float a) { return _mm512_set1_ps(a); }
inline vec vmul(vec a, vec b) { return _mm512_mul_ps(a, b); }
inline vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
inline vec vloadf(const float* p) { return _mm512_loadu_ps(p); }
inline void vstoref(float* p, vec x) { _mm512_storeu_ps(p, x); }
inline vec vadd(vec a, vec b) { return _mm512_add_ps(a, b); }
inline vec vsub(vec a, vec b) { return _mm512_sub_ps(a, b); }
inline vec vmax(vec a, vec b) { return _mm512_max_ps(a, b); }
inline vec vfms(vec a, vec b, vec c) { return _mm512_fmsub_ps(a, b, c); }
inline vec vfloor(vec a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC); }
// 2^n for integral n in float32's normal range, built in the exponent bits.
inline vec vexp2i(vec n) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(127)), 23));
}
// y where x >= lo (or x is NaN), else 0.
inline vec vzero_below(vec x, float lo, vec y) { return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, vset1(lo), _CMP_NLT_UQ), y); }
inline float hsum(vec a) { return _mm512_reduce_add_ps(a); }
inline float hmax(vec a) { return _mm512_reduce_max_ps(a); }
// Accumulators the value pass keeps in registers (of 32).
constexpr int kAccRegs = 16;
inline vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline vec vload(const c10::BFloat16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline vec vload(const c10::Half* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
// fp8 through float16's conversion: an e5m2 byte is the top byte of the float16 of the
// same value; an e4m3 byte's exponent and mantissa, shifted into a float16, are its value
// times 2^-8 (subnormals included), so one multiply by 256 restores it.
inline vec vload(const c10::Float8_e5m2* p) {
  const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm512_cvtph_ps(_mm256_slli_epi16(b, 8));
}
inline vec vload(const c10::Float8_e4m3fn* p) {
  const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8),
                                    _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x7F)), 7));
  return _mm512_mul_ps(_mm512_cvtph_ps(h), _mm512_set1_ps(256.f));
}
template <typename T> constexpr bool kVectorLoads = true;
// p[0..15]: one partial-sum vector per key -> lane i holds the sum of p[i].
inline vec reduce_keys(vec* p) {
  vec t[8], u[4];
  for (int i = 0; i < 8; ++i)
    t[i] = _mm512_add_ps(_mm512_shuffle_f32x4(p[i], p[i + 8], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_f32x4(p[i], p[i + 8], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int i = 0; i < 4; ++i)  // quarters: key i, key i + 8, key i + 4, key i + 12
    u[i] = _mm512_add_ps(_mm512_shuffle_f32x4(t[i], t[i + 4], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(t[i], t[i + 4], _MM_SHUFFLE(3, 1, 3, 1)));
  const vec v0 = _mm512_add_ps(_mm512_unpacklo_ps(u[0], u[1]), _mm512_unpackhi_ps(u[0], u[1]));
  const vec v1 = _mm512_add_ps(_mm512_unpacklo_ps(u[2], u[3]), _mm512_unpackhi_ps(u[2], u[3]));
  const vec w = _mm512_add_ps(_mm512_shuffle_ps(v0, v1, _MM_SHUFFLE(1, 0, 1, 0)),
                              _mm512_shuffle_ps(v0, v1, _MM_SHUFFLE(3, 2, 3, 2)));
  return _mm512_shuffle_f32x4(w, w, _MM_SHUFFLE(3, 1, 2, 0));  // keys 0-3, 8-11, 4-7, 12-15 -> in order
}
#else
constexpr int64_t kLanes = 8;
using vec = __m256;
inline vec vzero() { return _mm256_setzero_ps(); }
inline vec vset1(float a) { return _mm256_set1_ps(a); }
inline vec vmul(vec a, vec b) { return _mm256_mul_ps(a, b); }
inline vec vfma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
inline vec vloadf(const float* p) { return _mm256_loadu_ps(p); }
inline void vstoref(float* p, vec x) { _mm256_storeu_ps(p, x); }
inline vec vadd(vec a, vec b) { return _mm256_add_ps(a, b); }
inline vec vsub(vec a, vec b) { return _mm256_sub_ps(a, b); }
inline vec vmax(vec a, vec b) { return _mm256_max_ps(a, b); }
inline vec vfms(vec a, vec b, vec c) { return _mm256_fmsub_ps(a, b, c); }
inline vec vfloor(vec a) { return _mm256_floor_ps(a); }
inline vec vexp2i(vec n) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23));
}
inline vec vzero_below(vec x, float lo, vec y) { return _mm256_and_ps(_mm256_cmp_ps(x, vset1(lo), _CMP_NLT_UQ), y); }
inline float hsum(vec a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
inline float hmax(vec a) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}
// Accumulators the value pass keeps in registers (of 16).
constexpr int kAccRegs = 8;
inline vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline vec vload(const c10::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
#if defined(__F16C__)
// fp8 through float16's conversion (as in the AVX-512 build).
inline vec vload(const c10::Float8_e5m2* p) {
  const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  return _mm256_cvtph_ps(_mm_slli_epi16(b, 8));
}
inline vec vload(const c10::Float8_e4m3fn* p) {
  const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m128i h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x80)), 8),
                                 _mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x7F)), 7));
  return _mm256_mul_ps(_mm256_cvtph_ps(h), _mm256_set1_ps(256.f));
}
#else
// Without F16C: a gather of the bytes' table entries.
inline vec vload_fp8(const void* p, const float* table) {
  return _mm256_i32gather_ps(table, _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))), 4);
}
inline vec vload(const c10::Float8_e4m3fn* p) { return vload_fp8(p, kE4M3.v); }
inline vec vload(const c10::Float8_e5m2* p) { return vload_fp8(p, kE5M2.v); }
#endif
#if defined(__F16C__)
inline vec vload(const c10::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
template <typename T> constexpr bool kVectorLoads = true;
#else
inline vec vload(const c10::Half*) { return vzero(); }  // never called: kVectorLoads<Half> is false
template <typename T> constexpr bool kVectorLoads = !std::is_same<T, c10::Half>::value;  // float16 without F16C
#endif
// p[0..7]: one partial-sum vector per key -> lane i holds the sum of p[i].
inline vec reduce_keys(vec* p) {
  vec t[4];
  for (int i = 0; i < 4; ++i)  // halves: key i, key i + 4
    t[i] = _mm256_add_ps(_mm256_permute2f128_ps(p[i], p[i + 4], 0x20), _mm256_permute2f128_ps(p[i], p[i + 4], 0x31));
  const vec v0 = _mm256_add_ps(_mm256_unpacklo_ps(t[0], t[1]), _mm256_unpackhi_ps(t[0], t[1]));
  const vec v1 = _mm256_add_ps(_mm256_unpacklo_ps(t[2], t[3]), _mm256_unpackhi_ps(t[2], t[3]));
  return _mm256_add_ps(_mm256_shuffle_ps(v0, v1, _MM_SHUFFLE(1, 0, 1, 0)), _mm256_shuffle_ps(v0, v1, _MM_SHUFFLE(3, 2, 3, 2)));
}
#endif

// Whether the vector passes serve this storage type and head size.
template <typename T>
inline bool vector_path(int64_t head_size) {
  return kVectorLoads<T> && head_size % kLanes == 0;
}

// The partial-sum vector of q . k over a head of CH vectors (CH = 0: `chunks`, known
// at run time): the products of the first vector, then one fused multiply-add per
// further vector, in order.
template <int CH, typename C>
inline vec partial_dot(const float* __restrict q, const C* __restrict k, int64_t chunks) {
  const int64_t nc = CH > 0 ? CH : chunks;
  vec acc = vmul(vloadf(q), vload(k));
  for (int64_t c = 1; c < nc; ++c) acc = vfma(vloadf(q + c * kLanes), vload(k + c * kLanes), acc);
  return acc;
}

// The score pass: scores[v * lenp + n] = q_v . k_n for the task's nv query vectors
// (q_v at qf + v * head_size, its K head at offset voff[v] from each key slot) and keys
// n < len (slot n at k_base + slots[n]). Keys go kLanes at a time, every query vector
// of the run in turn (the run's slots, all heads, are read from memory once); a full
// run of one vector is one transposing reduce and one store. The runs shorter than
// kLanes (a sequence's last keys) of all vectors are queued together and reduced
// kLanes dots at a time (40 keys x 4 heads: 10 reduces, not 12), each lane stored to
// its own place. A dot's value depends only on its own partial sums, never on the
// dots it is reduced with.
template <int CH, typename C>
void score_pass(const float* __restrict qf, int64_t head_size, int64_t nv, const int64_t* __restrict voff,
                const C* __restrict k_base, const int64_t* __restrict slots, int64_t len, int64_t lenp,
                float* __restrict scores) {
  const int64_t chunks = head_size / kLanes;
  vec p[kLanes];
  float* dst[kLanes];
  int64_t queued = 0;
  auto flush = [&]() {
#pragma GCC unroll 16
    for (int j = 0; j < kLanes; ++j)  // (unrolled: as a loop from `queued` it becomes a slow rep stos)
      if (j >= queued) p[j] = vzero();
    alignas(64) float tmp[kLanes];
    vstoref(tmp, reduce_keys(p));
    for (int64_t j = 0; j < queued; ++j) *dst[j] = tmp[j];
    queued = 0;
  };
  for (int64_t n0 = 0; n0 < len; n0 += kLanes) {
    const int64_t m = std::min(kLanes, len - n0);
    const int64_t* sl = slots + n0;
    for (int64_t v = 0; v < nv; ++v) {
      const float* q = qf + v * head_size;
      const C* k = k_base + voff[v];
      float* out = scores + v * lenp + n0;
      if (m == kLanes) {
        vec full[kLanes];
        for (int64_t j = 0; j < kLanes; ++j) full[j] = partial_dot<CH>(q, k + sl[j], chunks);
        vstoref(out, reduce_keys(full));
        continue;
      }
      for (int64_t j = 0; j < m; ++j) {
        p[queued] = partial_dot<CH>(q, k + sl[j], chunks);
        dst[queued] = out + j;
        if (++queued == kLanes) flush();
      }
    }
  }
  if (queued > 0) flush();
}

// The value pass for a tile of T query vectors and CS vectors of their heads (from
// column `col`): acc_t = sum over keys n, in order, of p_t[n] * v_n, one fused
// multiply-add per key into accumulators held in registers for the whole sequence
// (vector t's V head at offset off[t] from each slot, its weights at s[t]).
template <int CS, int T, typename C>
void value_tile(const C* __restrict v_base, const int64_t* __restrict slots, int64_t len, const int64_t* off,
                const float* const* s, float* const* acc, int64_t col) {
  vec a[T][CS];
  int64_t o[T];
  const float* w[T];
#pragma GCC unroll 8
  for (int t = 0; t < T; ++t) {
    o[t] = off[t] + col;
    w[t] = s[t];
#pragma GCC unroll 8
    for (int c = 0; c < CS; ++c) a[t][c] = vzero();
  }
  for (int64_t n = 0; n < len; ++n) {
    const C* base = v_base + slots[n];
#pragma GCC unroll 8
    for (int t = 0; t < T; ++t) {
      const vec p = vset1(w[t][n]);
#pragma GCC unroll 8
      for (int c = 0; c < CS; ++c) a[t][c] = vfma(p, vload(base + o[t] + c * kLanes), a[t][c]);
    }
  }
#pragma GCC unroll 8
  for (int t = 0; t < T; ++t)
#pragma GCC unroll 8
    for (int c = 0; c < CS; ++c) vstoref(acc[t] + col + c * kLanes, a[t][c]);
}

// The value pass of a task: its query vectors in tiles (in the order `vord`, which puts
// the vectors that read one KV head next to each other), each tile as many vectors as
// leave its accumulators in registers (kAccRegs), heads wider than that in column
// slices. Every vector's sum runs over the keys in order whatever its tile or slice.
template <typename C>
void value_pass(const C* __restrict v_base, const int64_t* __restrict slots, int64_t len, int64_t head_size,
                int64_t nv, const int64_t* vord, const int64_t* voff, const float* scores, int64_t lenp,
                float* acc) {
  const int64_t chunks = head_size / kLanes;
  for (int64_t c0 = 0; c0 < chunks;) {
    const int64_t left = chunks - c0;
    const int cs = left >= 8 && kAccRegs >= 8 ? 8 : left >= 4 ? 4 : left >= 2 ? 2 : 1;
    const int tmax = std::min<int>(8, kAccRegs / cs);
    for (int64_t i = 0; i < nv;) {
      int t = tmax;
      while (t > nv - i) t /= 2;
      int64_t off[8];
      const float* s[8];
      float* a[8];
      for (int u = 0; u < t; ++u) {
        const int64_t v = vord[i + u];
        off[u] = voff[v];
        s[u] = scores + v * lenp;
        a[u] = acc + v * head_size;
      }
      const int64_t col = c0 * kLanes;
#define TANDEM_TILE(CS_, T_)                                                 \
  if (cs == CS_ && t == T_) {                                                \
    if constexpr (CS_ * T_ <= kAccRegs) value_tile<CS_, T_>(v_base, slots, len, off, s, a, col); \
  } else
#define TANDEM_TILES(CS_) TANDEM_TILE(CS_, 1) TANDEM_TILE(CS_, 2) TANDEM_TILE(CS_, 4) TANDEM_TILE(CS_, 8)
      TANDEM_TILES(1) TANDEM_TILES(2) TANDEM_TILES(4) TANDEM_TILES(8) {}
#undef TANDEM_TILES
#undef TANDEM_TILE
      i += t;
    }
    c0 += cs;
  }
}

// exp(x) for x <= 0 in vectors, the scalar exp_nonpositive's method (below): x = n ln2 + r,
// e^r by its degree-7 Taylor polynomial, times 2^n built in the exponent bits; 0 below -87.
inline vec vexp_nonpositive(vec x) {
  const vec xc = vmax(x, vset1(-87.0f));
  const vec n = vfloor(vfma(xc, vset1(1.44269504088896341f), vset1(0.5f)));
  const vec r = vmul(vfms(xc, vset1(1.44269504088896341f), n), vset1(0.693147180559945309f));
  vec p = vset1(1.f / 5040.f);
  p = vfma(p, r, vset1(1.f / 720.f));
  p = vfma(p, r, vset1(1.f / 120.f));
  p = vfma(p, r, vset1(1.f / 24.f));
  p = vfma(p, r, vset1(1.f / 6.f));
  p = vfma(p, r, vset1(0.5f));
  p = vfma(p, r, vset1(1.f));
  p = vfma(p, r, vset1(1.f));
  return vzero_below(x, -87.0f, vmul(p, vexp2i(n)));
}

// The softmax of a task's nv = nr * nq score rows in place (row v at scores + v * lenp,
// keys [0, len), then the pad to lenp, whole vectors: -inf, the caller's, so that it adds
// e^-inf = 0), and inv[v] = vscale / the row's sum of exponentials (0 for no keys). The
// bias row of query head h, if any, at bias0 + h * bias_sh, is added first. Each row's
// maximum and sum: lane-wise over its vectors, then one horizontal reduction. The rows'
// maxima are found first, then their exponentials: a short row is mostly a chain of
// dependent steps, and the rows' chains overlap where each pass's loop body is short.
inline void softmax_rows(float* __restrict scores, int64_t nr, int64_t nq, int64_t len, int64_t lenp,
                         const float* bias0, int64_t bias_sh, float vscale, float* __restrict mx,
                         float* __restrict inv) {
  const int64_t nv = nr * nq;
  if (bias0 != nullptr)
    for (int64_t r = 0; r < nr; ++r)
      for (int64_t h = 0; h < nq; ++h) {
        float* s = scores + (r * nq + h) * lenp;
        const float* bh = bias0 + h * bias_sh;
        int64_t n = 0;
        for (; n + kLanes <= len; n += kLanes) vstoref(s + n, vadd(vloadf(s + n), vloadf(bh + n)));
        for (; n < len; ++n) s[n] += bh[n];
      }
  for (int64_t v = 0; v < nv; ++v) {
    const float* s = scores + v * lenp;
    vec m = vloadf(s);
    for (int64_t n = kLanes; n < lenp; n += kLanes) m = vmax(m, vloadf(s + n));
    mx[v] = hmax(m);
  }
  for (int64_t v = 0; v < nv; ++v) {
    float* s = scores + v * lenp;
    const vec m = vset1(mx[v]);
    vec sum = vzero();
    for (int64_t n = 0; n < lenp; n += kLanes) {
      const vec e = vexp_nonpositive(vsub(vloadf(s + n), m));
      vstoref(s + n, e);
      sum = vadd(sum, e);
    }
    const float total = hsum(sum);
    inv[v] = (total > 0.f ? 1.f / total : 0.f) * vscale;
  }
}

#endif

// exp(x) for x <= 0 (scores minus their max), in a form the compiler vectorizes:
// x = n ln2 + r with |r| <= ln2 / 2, e^r by its degree-7 Taylor polynomial
// (truncation < 5e-9 relative, below float32's 6e-8 unit roundoff), times 2^n
// built in the exponent bits. Below -87 the result is 0 as in float32's expf.
// (The builds without vectors; vexp_nonpositive above is the same in vectors.)
inline float exp_nonpositive(float x) {
  const float t = std::max(x, -87.0f) * 1.44269504088896341f;
  const float n = std::floor(t + 0.5f);
  const float r = (t - n) * 0.693147180559945309f;
  float p = 1.f / 5040.f;
  p = p * r + 1.f / 720.f;
  p = p * r + 1.f / 120.f;
  p = p * r + 1.f / 24.f;
  p = p * r + 1.f / 6.f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return x < -87.0f ? 0.f : p * scale;
}

// T: the query's and output's type; C: the cache's (T, or an fp8 type).
template <typename T, typename C>
void decode(const at::Tensor& query, const at::Tensor& kv_cache, at::Tensor& out,
            const at::Tensor& q_rows, const at::Tensor& seqs, const at::Tensor& kv_lens,
            const at::Tensor& block_tables, double scale, const float* bias, int64_t bias_sh, int64_t bias_w,
            const int64_t* groups, int64_t num_groups, double k_scale, double v_scale) {
  const int64_t num_heads = query.size(1);
  const int64_t head_size = query.size(2);
  const int64_t block_size = kv_cache.size(2);
  const int64_t num_kv_heads = kv_cache.size(3);
  const int64_t group = num_heads / num_kv_heads;

  const T* q_ptr = query.data_ptr<T>();
  const C* k_ptr = kv_cache.data_ptr<C>();
  const C* v_ptr = k_ptr + kv_cache.stride(0);
  T* o_ptr = out.data_ptr<T>();
  const int64_t q_st = query.stride(0), q_sh = query.stride(1);
  const int64_t o_st = out.stride(0), o_sh = out.stride(1);
  const int64_t c_sb = kv_cache.stride(1), c_ss = kv_cache.stride(2), c_sh = kv_cache.stride(3);
  const int64_t* rows = q_rows.data_ptr<int64_t>();
  const int64_t* seq_of = seqs.data_ptr<int64_t>();
  const int64_t* lens = kv_lens.data_ptr<int64_t>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t tab_st = block_tables.stride(0);
  const float fscale = static_cast<float>(scale * k_scale);
  const float fvscale = static_cast<float>(v_scale);
#ifdef TANDEM_SIMD
  const bool vectors = vector_path<C>(head_size);
  constexpr int64_t kPad = kLanes;  // score rows are padded to whole vectors
#else
  const bool vectors = false;
  constexpr int64_t kPad = 1;
#endif
  // Rows [first(g), first(g + 1)) share the K/V of sequence seq_of[first(g)] (the beams
  // or n > 1 samples of one request over its one cross table): each key slot is read
  // once for all of them. Without groups every row is its own group.
  auto first = [&](int64_t g) { return groups == nullptr ? g : groups[g]; };
  int64_t max_rows = 1;
  for (int64_t g = 0; groups != nullptr && g < num_groups; ++g) max_rows = std::max(max_rows, groups[g + 1] - groups[g]);

  // A task is one group and a run of its KV heads: all heads while the groups
  // alone give every thread several tasks (each key slot's heads then stream
  // as one contiguous read), fewer when they do not (a small batch of long
  // sequences still spreads over the threads).
  const int64_t want_tasks = 4 * static_cast<int64_t>(at::get_num_threads());
  const int64_t want_chunks =
      std::min<int64_t>(num_kv_heads, std::max<int64_t>(1, (want_tasks + num_groups - 1) / std::max<int64_t>(num_groups, 1)));
  const int64_t heads_per_task = (num_kv_heads + want_chunks - 1) / want_chunks;
  // Recounted from the rounded-up run length, so no chunk starts past the last head
  // (12 heads in 8 wanted chunks: runs of 2, 6 chunks).
  const int64_t chunks = (num_kv_heads + heads_per_task - 1) / heads_per_task;

  // Tasks differ in cost (a 512-key cross table against a 64-key one, groups of 4 rows
  // against 1). Where none is large (each at most an eighth of a thread's share: a
  // batch of many short sequences), each thread takes a contiguous run of tasks of
  // about equal cost (off by at most one task). Elsewhere contiguous runs could leave
  // one thread with twice another's work, and each thread gets a list instead: tasks
  // by cost, largest first, each to the thread with the least so far. Which thread
  // runs a task does not change its result.
  const int64_t num_tasks = num_groups * chunks;
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), num_tasks));
  std::vector<int64_t> cost(num_tasks), assigned(num_tasks), starts(threads + 1, 0);
  int64_t total = 0, largest = 0;
  for (int64_t g = 0, task = 0; g < num_groups; ++g)
    for (int64_t c = 0; c < chunks; ++c, ++task) {
      const int64_t nh = std::min(heads_per_task, num_kv_heads - c * heads_per_task);
      // Per query vector: its keys plus a fixed share for the task's setup and softmax.
      cost[task] = (first(g + 1) - first(g)) * nh * (lens[seq_of[first(g)]] + 16);
      total += cost[task];
      largest = std::max(largest, cost[task]);
    }
  if (largest * threads * 8 <= total || threads == 1) {
    for (int64_t task = 0; task < num_tasks; ++task) assigned[task] = task;
    starts[threads] = num_tasks;
    // starts[t]: the first task whose preceding tasks cost at least t / threads of the total.
    int64_t t = 1, before = 0;
    for (int64_t task = 0; task < num_tasks && t < threads; before += cost[task++])
      while (t < threads && before * threads >= t * total) starts[t++] = task;
    for (; t < threads; ++t) starts[t] = num_tasks;
  } else {
    std::vector<int64_t> order(num_tasks), load(threads, 0), thread_of(num_tasks);
    for (int64_t task = 0; task < num_tasks; ++task) order[task] = task;
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return cost[a] > cost[b]; });
    for (int64_t task : order) {
      const int64_t t = std::min_element(load.begin(), load.end()) - load.begin();
      thread_of[task] = t;
      load[t] += cost[task];
      ++starts[t + 1];
    }
    for (int64_t t = 0; t < threads; ++t) starts[t + 1] += starts[t];
    std::vector<int64_t> fill(starts.begin(), starts.end() - 1);
    for (int64_t task = 0; task < num_tasks; ++task) assigned[fill[thread_of[task]]++] = task;
  }

  at::parallel_for(0, threads, 1, [&](int64_t t_begin, int64_t t_end) {
    const int64_t width = max_rows * heads_per_task * group;  // query vectors of a task at most
    std::vector<float> qf(width * head_size), acc(width * head_size), scores;
    std::vector<float> inv(width), row_max(width);
    std::vector<int64_t> slots, voff(width), vord(width);
    for (int64_t i = starts[t_begin]; i < starts[t_end]; ++i) {
      const int64_t task = assigned[i];
      const int64_t g = chunks == 1 ? task : task / chunks;
      const int64_t b0 = first(g), nr = first(g + 1) - b0;
      const int64_t h0 = chunks == 1 ? 0 : (task % chunks) * heads_per_task;
      const int64_t nh = std::min(heads_per_task, num_kv_heads - h0);
      const int64_t nq = nh * group;  // query heads of this task, [h0 * group, h0 * group + nq)
      const int64_t nv = nr * nq;     // query vectors: row r's head h is r * nq + h
      const int64_t seq = seq_of[b0], len = lens[seq];
      const int64_t lenp = (len + kPad - 1) / kPad * kPad;
      const int64_t* table = tables + seq * tab_st;
      for (int64_t r = 0; r < nr; ++r)
        for (int64_t h = 0; h < nq; ++h) {
          const T* qh = q_ptr + rows[b0 + r] * q_st + (h0 * group + h) * q_sh;
          float* qv = &qf[(r * nq + h) * head_size];
          for (int64_t i = 0; i < head_size; ++i) qv[i] = static_cast<float>(qh[i]) * fscale;
        }
      if (scores.size() < static_cast<size_t>(nv * lenp)) scores.resize(nv * lenp);
#ifdef TANDEM_SIMD
      // The rows' pads (keys len..lenp) are -inf, stored first as whole vectors (the score
      // pass then fills the keys below len): scalar stores just before the softmax's
      // vector loads would stall them.
      if (len < lenp)
        for (int64_t v = 0; v < nv; ++v)
          vstoref(&scores[v * lenp + lenp - kLanes], vset1(-std::numeric_limits<float>::infinity()));
      if (vectors) {
        // Key n's slot (its first head of the task's run) from the cache's start, the same
        // for K and V; each query vector's KV head from there.
        if (slots.size() < static_cast<size_t>(len)) slots.resize(len);
        for (int64_t n0 = 0, blk = 0; n0 < len; n0 += block_size, ++blk) {
          const int64_t base = table[blk] * c_sb + h0 * c_sh, m = std::min(block_size, len - n0);
          for (int64_t j = 0; j < m; ++j) slots[n0 + j] = base + j * c_ss;
        }
        // Tiles of the value pass: the vectors of one KV head (every row, every query head
        // of its GQA group) next to each other.
        for (int64_t kh = 0, i = 0; kh < nh; ++kh)
          for (int64_t r = 0; r < nr; ++r)
            for (int64_t q = 0; q < group; ++q) {
              vord[i++] = r * nq + kh * group + q;
              voff[r * nq + kh * group + q] = kh * c_sh;
            }
        switch (head_size / kLanes) {
          case 1: score_pass<1>(qf.data(), head_size, nv, voff.data(), k_ptr, slots.data(), len, lenp, scores.data()); break;
          case 2: score_pass<2>(qf.data(), head_size, nv, voff.data(), k_ptr, slots.data(), len, lenp, scores.data()); break;
          case 4: score_pass<4>(qf.data(), head_size, nv, voff.data(), k_ptr, slots.data(), len, lenp, scores.data()); break;
          case 8: score_pass<8>(qf.data(), head_size, nv, voff.data(), k_ptr, slots.data(), len, lenp, scores.data()); break;
          default: score_pass<0>(qf.data(), head_size, nv, voff.data(), k_ptr, slots.data(), len, lenp, scores.data());
        }
      }
#endif
      // Scores: one pass over the keys, slot by slot, each slot's heads for every row.
      for (int64_t n0 = 0, blk = 0; !vectors && n0 < len; n0 += block_size, ++blk) {
        const C* kb = k_ptr + table[blk] * c_sb + h0 * c_sh;
        const int64_t m = std::min(block_size, len - n0);
        for (int64_t j = 0; j < m; ++j)
          for (int64_t h = 0; h < nq; ++h) {
            const C* kh = kb + j * c_ss + (h / group) * c_sh;
            for (int64_t r = 0; r < nr; ++r) {
              const int64_t v = r * nq + h;
              scores[v * lenp + n0 + j] = dot(&qf[v * head_size], kh, head_size);
            }
          }
      }
      // Softmax per query vector (the bias, if any, added before the max is found).
      const float* bias0 = bias == nullptr ? nullptr : bias + h0 * group * bias_sh + (bias_w - len);
#ifdef TANDEM_SIMD
      if (len > 0) softmax_rows(scores.data(), nr, nq, len, lenp, bias0, bias_sh, fvscale, row_max.data(), inv.data());
      else std::fill(inv.begin(), inv.begin() + nv, 0.f);
#else
      for (int64_t v = 0; v < nv; ++v) {
        float* s = scores.data() + v * lenp;
        const float* bh = bias0 == nullptr ? nullptr : bias0 + (v % nq) * bias_sh;
        float mx = -std::numeric_limits<float>::infinity();
        for (int64_t n = 0; n < len; ++n) {
          if (bh != nullptr) s[n] += bh[n];
          mx = std::max(mx, s[n]);
        }
        float sum = 0.f;
        for (int64_t n = 0; n < len; ++n) {
          s[n] = exp_nonpositive(s[n] - mx);
          sum += s[n];
        }
        inv[v] = (sum > 0.f ? 1.f / sum : 0.f) * fvscale;
      }
#endif
#ifdef TANDEM_SIMD
      if (vectors)
        value_pass(v_ptr, slots.data(), len, head_size, nv, vord.data(), voff.data(), scores.data(), lenp, acc.data());
#endif
      // Weighted values: one pass, slot by slot, each slot's heads for every row.
      if (!vectors) std::fill(acc.begin(), acc.begin() + nv * head_size, 0.f);
      for (int64_t n0 = 0, blk = 0; !vectors && n0 < len; n0 += block_size, ++blk) {
        const C* vb = v_ptr + table[blk] * c_sb + h0 * c_sh;
        const int64_t m = std::min(block_size, len - n0);
        for (int64_t j = 0; j < m; ++j)
          for (int64_t h = 0; h < nq; ++h) {
            const C* vh = vb + j * c_ss + (h / group) * c_sh;
            for (int64_t r = 0; r < nr; ++r) {
              const int64_t v = r * nq + h;
              axpy(scores[v * lenp + n0 + j], vh, &acc[v * head_size], head_size);
            }
          }
      }
      for (int64_t r = 0; r < nr; ++r)
        for (int64_t h = 0; h < nq; ++h) {
          const int64_t v = r * nq + h;
          T* oh = o_ptr + rows[b0 + r] * o_st + (h0 * group + h) * o_sh;
          for (int64_t i = 0; i < head_size; ++i) oh[i] = static_cast<T>(acc[v * head_size + i] * inv[v]);
        }
    }
  });
}

// The cache's type: the query's, or fp8.
template <typename T>
void decode_as(const at::Tensor& query, const at::Tensor& kv_cache, at::Tensor& out, const at::Tensor& q_rows,
               const at::Tensor& seqs, const at::Tensor& kv_lens, const at::Tensor& block_tables, double scale,
               const float* bias, int64_t bias_sh, int64_t bias_w, const int64_t* groups, int64_t num_groups,
               double k_scale, double v_scale) {
  switch (kv_cache.scalar_type()) {
    case at::kFloat8_e4m3fn:
      return decode<T, c10::Float8_e4m3fn>(query, kv_cache, out, q_rows, seqs, kv_lens, block_tables, scale, bias,
                                           bias_sh, bias_w, groups, num_groups, k_scale, v_scale);
    case at::kFloat8_e5m2:
      return decode<T, c10::Float8_e5m2>(query, kv_cache, out, q_rows, seqs, kv_lens, block_tables, scale, bias,
                                         bias_sh, bias_w, groups, num_groups, k_scale, v_scale);
    default:
      return decode<T, T>(query, kv_cache, out, q_rows, seqs, kv_lens, block_tables, scale, bias, bias_sh, bias_w,
                          groups, num_groups, k_scale, v_scale);
  }
}

void paged_decode_attention(const at::Tensor& query, const at::Tensor& kv_cache, at::Tensor& out,
                            const at::Tensor& q_rows, const at::Tensor& seqs, const at::Tensor& kv_lens,
                            const at::Tensor& block_tables, double scale,
                            const c10::optional<at::Tensor>& position_bias,
                            const c10::optional<at::Tensor>& kv_groups, double k_scale, double v_scale) {
  TORCH_CHECK(query.device().is_cpu() && kv_cache.device().is_cpu() && out.device().is_cpu(),
              "paged_decode_attention: tensors must be on cpu");
  TORCH_CHECK(query.dim() == 3 && out.dim() == 3, "paged_decode_attention: query and out must be [T, H, D]");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2,
              "paged_decode_attention: kv_cache must be [2, num_blocks, block_size, H_kv, D], got ",
              kv_cache.sizes());
  const bool fp8 = kv_cache.scalar_type() == at::kFloat8_e4m3fn || kv_cache.scalar_type() == at::kFloat8_e5m2;
  TORCH_CHECK((query.scalar_type() == kv_cache.scalar_type() || fp8) && out.scalar_type() == query.scalar_type(),
              "paged_decode_attention: query ", query.scalar_type(), ", kv_cache ", kv_cache.scalar_type(),
              " and out ", out.scalar_type(), " must share one dtype (or kv_cache be float8_e4m3fn / float8_e5m2)");
  TORCH_CHECK(fp8 || (k_scale == 1.0 && v_scale == 1.0),
              "paged_decode_attention: k_scale and v_scale apply to an fp8 cache only");
  TORCH_CHECK(query.stride(2) == 1 && out.stride(2) == 1 && kv_cache.stride(4) == 1,
              "paged_decode_attention: the head dimension must be contiguous");
  TORCH_CHECK(query.size(2) == kv_cache.size(4) && out.sizes() == query.sizes(),
              "paged_decode_attention: head sizes differ: query ", query.sizes(), ", kv_cache ",
              kv_cache.sizes(), ", out ", out.sizes());
  TORCH_CHECK(query.size(1) % kv_cache.size(3) == 0, "paged_decode_attention: ", query.size(1),
              " query heads are not a multiple of ", kv_cache.size(3), " KV heads");
  for (const at::Tensor* t : {&q_rows, &seqs, &kv_lens, &block_tables}) {
    TORCH_CHECK(t->scalar_type() == at::kLong && t->device().is_cpu(),
                "paged_decode_attention: index tensors must be int64 on cpu");
    TORCH_CHECK(t->dim() == 1 ? t->is_contiguous() : t->stride(1) == 1,
                "paged_decode_attention: index tensors must be contiguous along their last dimension");
  }
  TORCH_CHECK(q_rows.size(0) == seqs.size(0), "paged_decode_attention: q_rows and seqs differ in length");
  const float* bias = nullptr;
  int64_t bias_sh = 0, bias_w = 0;
  if (position_bias.has_value()) {
    const at::Tensor& pb = *position_bias;
    TORCH_CHECK(pb.device().is_cpu() && pb.scalar_type() == at::kFloat && pb.dim() == 2 && (pb.size(1) == 1 || pb.stride(1) == 1),
                "paged_decode_attention: position_bias must be a float32 [H, W] cpu tensor, contiguous along W; got ",
                pb.scalar_type(), " ", pb.sizes());
    TORCH_CHECK(pb.size(0) == query.size(1), "paged_decode_attention: position_bias has ", pb.size(0),
                " heads, the query ", query.size(1));
    bias = pb.data_ptr<float>();
    bias_sh = pb.stride(0);
    bias_w = pb.size(1);
    // Every decoding sequence must fit the row (checked here: nothing may throw in the threads).
    const int64_t* seq_of = seqs.data_ptr<int64_t>();
    const int64_t* lens = kv_lens.data_ptr<int64_t>();
    for (int64_t b = 0; b < seqs.size(0); ++b)
      TORCH_CHECK(lens[seq_of[b]] <= bias_w, "paged_decode_attention: sequence ", seq_of[b], " has ",
                  lens[seq_of[b]], " keys, more than position_bias's width ", bias_w);
  }
  const int64_t* groups = nullptr;
  int64_t num_groups = q_rows.size(0);
  if (kv_groups.has_value()) {
    const at::Tensor& kg = *kv_groups;
    TORCH_CHECK(kg.device().is_cpu() && kg.scalar_type() == at::kLong && kg.dim() == 1 && kg.is_contiguous() &&
                    kg.size(0) >= 1,
                "paged_decode_attention: kv_groups must be a contiguous 1-D int64 cpu tensor of group offsets; got ",
                kg.scalar_type(), " ", kg.sizes());
    groups = kg.data_ptr<int64_t>();
    num_groups = kg.size(0) - 1;
    TORCH_CHECK(groups[0] == 0 && groups[num_groups] == q_rows.size(0),
                "paged_decode_attention: kv_groups must run from 0 to the ", q_rows.size(0), " rows, got ",
                groups[0], " to ", groups[num_groups]);
    for (int64_t g = 0; g < num_groups; ++g)
      TORCH_CHECK(groups[g] < groups[g + 1], "paged_decode_attention: kv_groups must increase strictly, got ",
                  groups[g], " then ", groups[g + 1]);
  }
  switch (query.scalar_type()) {
    case at::kFloat: return decode_as<float>(query, kv_cache, out, q_rows, seqs, kv_lens, block_tables, scale, bias, bias_sh, bias_w, groups, num_groups, k_scale, v_scale);
    case at::kBFloat16: return decode_as<c10::BFloat16>(query, kv_cache, out, q_rows, seqs, kv_lens, block_tables, scale, bias, bias_sh, bias_w, groups, num_groups, k_scale, v_scale);
    case at::kHalf: return decode_as<c10::Half>(query, kv_cache, out, q_rows, seqs, kv_lens, block_tables, scale, bias, bias_sh, bias_w, groups, num_groups, k_scale, v_scale);
    default: TORCH_CHECK(false, "paged_decode_attention: dtype ", query.scalar_type(), " is not float32, float16 or bfloat16");
  }
}

// New keys and values into their slots of the paged cache [2, num_blocks, block_size, H, D]
// (flat slot = block * block_size + offset): what core's write_to_paged_cache does with two
// index_copy_ calls, as one memcpy a token and tensor. index_copy_ spends ~20 us a call on
// a decode step's 128 rows before it copies anything. Every slot is checked before any
// byte moves (nothing may throw in the threads); the caller passes keys and values in the
// cache's dtype, each token's [H, D] contiguous.
void write_slots(const at::Tensor& key, const at::Tensor& value, at::Tensor& kv_cache, const at::Tensor& slot_mapping) {
  TORCH_CHECK(key.device().is_cpu() && value.device().is_cpu() && kv_cache.device().is_cpu() &&
                  slot_mapping.device().is_cpu(),
              "write_slots: tensors must be on cpu");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous(),
              "write_slots: kv_cache must be a contiguous [2, num_blocks, block_size, H, D], got ", kv_cache.sizes());
  TORCH_CHECK(key.scalar_type() == kv_cache.scalar_type() && value.scalar_type() == kv_cache.scalar_type(),
              "write_slots: key ", key.scalar_type(), " and value ", value.scalar_type(), " must have kv_cache's dtype ",
              kv_cache.scalar_type());
  const int64_t heads = kv_cache.size(3), dim = kv_cache.size(4);
  for (const at::Tensor* t : {&key, &value})
    TORCH_CHECK(t->dim() == 3 && t->size(1) == heads && t->size(2) == dim && t->stride(2) == 1 &&
                    (heads == 1 || t->stride(1) == dim),
                "write_slots: key and value must be [T, ", heads, ", ", dim, "] with each token's heads contiguous, got ",
                t->sizes(), " strides ", t->strides());
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.dim() == 1 && slot_mapping.is_contiguous() &&
                  slot_mapping.size(0) == key.size(0) && value.size(0) == key.size(0),
              "write_slots: slot_mapping must be a contiguous 1-D int64 tensor of one slot per token");
  const int64_t tokens = key.size(0);
  const int64_t num_slots = kv_cache.size(1) * kv_cache.size(2);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t i = 0; i < tokens; ++i)
    TORCH_CHECK(slots[i] >= 0 && slots[i] < num_slots, "write_slots: slot ", slots[i], " of token ", i,
                " is outside the cache's ", num_slots, " slots");
  const int64_t row = heads * dim * kv_cache.element_size();
  char* k_dst = static_cast<char*>(kv_cache.data_ptr());
  char* v_dst = k_dst + num_slots * row;
  const char* k_src = static_cast<const char*>(key.data_ptr());
  const char* v_src = static_cast<const char*>(value.data_ptr());
  const int64_t k_step = key.stride(0) * key.element_size(), v_step = value.stride(0) * value.element_size();
  at::parallel_for(0, tokens, 512, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      std::memcpy(k_dst + slots[i] * row, k_src + i * k_step, row);
      std::memcpy(v_dst + slots[i] * row, v_src + i * v_step, row);
    }
  });
}

}  // namespace

TORCH_LIBRARY(tandem_cpu, m) {
  m.def("paged_decode_attention(Tensor query, Tensor kv_cache, Tensor(a!) out, Tensor q_rows, Tensor seqs, "
        "Tensor kv_lens, Tensor block_tables, float scale, Tensor? position_bias=None, "
        "Tensor? kv_groups=None, float k_scale=1.0, float v_scale=1.0) -> ()");
  m.def("write_slots(Tensor key, Tensor value, Tensor(a!) kv_cache, Tensor slot_mapping) -> ()");
}

TORCH_LIBRARY_IMPL(tandem_cpu, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
  m.impl("write_slots", &write_slots);
}
