// tandem's CPU sampling ops. ban_repeated_ngrams(_rows) (below): no_repeat_ngram_size's bans;
// ban_tokens: token bans shared by every row.
// argmax_rows, the row argmax for the sampler's greedy rows: out[r] = argmax(x[r, :]) for a
// float32 [rows, vocab] tensor whose rows are contiguous, with torch.argmax's answer bit
// for bit: the first index of the row's maximum, or the first NaN's where the row has one
// (torch counts NaN as the maximum).
//
// Why not torch.argmax: on CPU its reduction carries an (index, value) pair per lane and
// runs several times slower than a plain max over the same data. Here each row takes two
// passes in vectors (AVX-512 or AVX2, by the build's ISA; scalar otherwise): the maximum,
// with a NaN check on the side, then the first position holding it, which stops at the
// answer and reads the row from cache. (GCC does not vectorize an "omp simd" float max
// reduction without -ffast-math, so the passes are written with intrinsics.) Rows are
// spread over torch's intra-op threads; a row's answer does not depend on which thread
// runs it.

#include <ATen/Parallel.h>
#include <ATen/Functions.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <limits>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

#if defined(__AVX512F__)
constexpr int64_t kLanes = 16;
using vec = __m512;
inline vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline vec vset1(float a) { return _mm512_set1_ps(a); }
inline vec vmax(vec a, vec b) { return _mm512_max_ps(a, b); }
inline float hmax(vec a) { return _mm512_reduce_max_ps(a); }
inline uint32_t unordered(vec a) { return _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q); }  // lanes holding NaN
inline uint32_t equal(vec a, vec b) { return _mm512_cmp_ps_mask(a, b, _CMP_EQ_OQ); }
#define TANDEM_SIMD 1
#elif defined(__AVX2__)
constexpr int64_t kLanes = 8;
using vec = __m256;
inline vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline vec vset1(float a) { return _mm256_set1_ps(a); }
inline vec vmax(vec a, vec b) { return _mm256_max_ps(a, b); }
inline float hmax(vec a) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
  return _mm_cvtss_f32(m);
}
inline uint32_t unordered(vec a) { return static_cast<uint32_t>(_mm256_movemask_ps(_mm256_cmp_ps(a, a, _CMP_UNORD_Q))); }
inline uint32_t equal(vec a, vec b) { return static_cast<uint32_t>(_mm256_movemask_ps(_mm256_cmp_ps(a, b, _CMP_EQ_OQ))); }
#define TANDEM_SIMD 1
#endif

// The row's maximum ignoring NaN, and whether it holds a NaN. (A vector max returns its
// second operand where either is NaN: the NaN lanes are counted apart, so the maximum of
// a row with NaN is never used.)
inline float row_max(const float* x, int64_t n, bool& nan) {
  float m = -std::numeric_limits<float>::infinity();
  int64_t i = 0;
  uint32_t bad = 0;
#ifdef TANDEM_SIMD
  if (n >= 4 * kLanes) {
    // Four accumulators: the max's latency is not a chain through every vector.
    vec a0 = vset1(m), a1 = a0, a2 = a0, a3 = a0;
    for (; i + 4 * kLanes <= n; i += 4 * kLanes) {
      const vec v0 = vload(x + i), v1 = vload(x + i + kLanes), v2 = vload(x + i + 2 * kLanes),
                v3 = vload(x + i + 3 * kLanes);
      bad |= unordered(v0) | unordered(v1) | unordered(v2) | unordered(v3);
      a0 = vmax(v0, a0);
      a1 = vmax(v1, a1);
      a2 = vmax(v2, a2);
      a3 = vmax(v3, a3);
    }
    m = hmax(vmax(vmax(a0, a1), vmax(a2, a3)));
  }
#endif
  for (; i < n; ++i) {
    if (x[i] != x[i]) bad = 1;
    else if (x[i] > m) m = x[i];
  }
  nan = bad != 0;
  return m;
}

inline int64_t first_nan(const float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    if (x[i] != x[i]) return i;
  return 0;  // not reached: the caller saw a NaN
}

inline int64_t first_equal(const float* x, int64_t n, float m) {
  int64_t i = 0;
#ifdef TANDEM_SIMD
  const vec vm = vset1(m);
  for (; i + kLanes <= n; i += kLanes) {
    const uint32_t hit = equal(vload(x + i), vm);
    if (hit) return i + __builtin_ctz(hit);
  }
#endif
  for (; i < n; ++i)
    if (x[i] == m) return i;
  return 0;  // not reached: m is an element of the row
}

inline int64_t row_argmax(const float* x, int64_t n) {
  bool nan = false;
  const float m = row_max(x, n, nan);
  return nan ? first_nan(x, n) : first_equal(x, n, m);
}

at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2,
              "argmax_rows: x must be a float32 [rows, vocab] cpu tensor, got ", x.scalar_type(), " ", x.sizes(),
              " on ", x.device());
  TORCH_CHECK(x.size(1) > 0, "argmax_rows: the rows are empty (vocab 0)");
  TORCH_CHECK(x.stride(1) == 1, "argmax_rows: each row must be contiguous, got strides ", x.strides());
  const int64_t rows = x.size(0), n = x.size(1), stride = x.stride(0);
  at::Tensor out = at::empty({rows}, x.options().dtype(at::kLong));
  const float* base = x.data_ptr<float>();
  int64_t* o = out.data_ptr<int64_t>();
  // At least ~32K elements a task: below that a thread's start costs more than the rows.
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 15) / n);
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) o[r] = row_argmax(base + r * stride, n);
  });
  return out;
}

// no_repeat_ngram_size = n: for row i (its first lengths[i] tokens), every n-gram of it whose
// first n - 1 tokens equal the row's last n - 1 tokens bans its last token in scores' row
// rows[i] (set to -inf): HF's NoRepeatNGramLogitsProcessor, and exactly what the processors'
// tensor path bans (tandem/core/worker/logits_processors.py). Row i's tokens are row i of
// history (ban_repeated_ngrams), or row table_rows[i] of a table read in place
// (ban_repeated_ngrams_rows: the worker's token histories, no gather a step). A row is one
// pass over its tokens, comparing n - 1 ids a window; rows go to torch's intra-op threads
// (each writes its own scores row).
void ban_ngrams(at::Tensor& scores, const at::Tensor& rows, const at::Tensor& table, const at::Tensor* table_rows,
                const at::Tensor& lengths, int64_t n, const char* name) {
  TORCH_CHECK(scores.device().is_cpu() && scores.scalar_type() == at::kFloat && scores.dim() == 2 &&
                  scores.stride(1) == 1,
              name, ": scores must be a float32 [rows, vocab] cpu tensor with contiguous rows");
  TORCH_CHECK(rows.scalar_type() == at::kLong && table.scalar_type() == at::kLong &&
                  lengths.scalar_type() == at::kLong && rows.dim() == 1 && table.dim() == 2 && lengths.dim() == 1,
              name, ": rows [R], history [*, W] and lengths [R] must be int64");
  TORCH_CHECK(table.device().is_cpu() && rows.device().is_cpu() && lengths.device().is_cpu(),
              name, ": rows, history and lengths must be cpu tensors");
  TORCH_CHECK(rows.size(0) == lengths.size(0), name, ": rows and lengths disagree on the number of rows");
  TORCH_CHECK(table_rows != nullptr || rows.size(0) == table.size(0), name,
              ": rows and history disagree on the number of rows");
  TORCH_CHECK(table_rows == nullptr || (table_rows->scalar_type() == at::kLong && table_rows->dim() == 1 &&
                                        table_rows->size(0) == rows.size(0) && table_rows->device().is_cpu()),
              name, ": table_rows must be an int64 cpu tensor [R]");
  TORCH_CHECK(n >= 1, name, ": n must be >= 1, got ", n);
  // The table's rows must be contiguous; its row stride may exceed the width (a table read
  // in place is a column slice of the worker's).
  const at::Tensor h = table.stride(1) == 1 ? table : table.contiguous();
  const at::Tensor r = rows.contiguous(), len = lengths.contiguous();
  const at::Tensor tr = table_rows != nullptr ? table_rows->contiguous() : at::Tensor();
  const int64_t count = r.size(0), width = h.size(1), h_stride = h.stride(0), table_size = h.size(0);
  const int64_t vocab = scores.size(1), stride = scores.stride(0), num_rows = scores.size(0);
  const int64_t* hp = h.data_ptr<int64_t>();
  const int64_t* rp = r.data_ptr<int64_t>();
  const int64_t* lp = len.data_ptr<int64_t>();
  const int64_t* trp = table_rows != nullptr ? tr.data_ptr<int64_t>() : nullptr;
  float* sp = scores.data_ptr<float>();
  for (int64_t i = 0; i < count; ++i) {
    TORCH_CHECK(rp[i] >= 0 && rp[i] < num_rows, name, ": row ", rp[i], " out of range");
    TORCH_CHECK(lp[i] >= 0 && lp[i] <= width, name, ": length ", lp[i], " out of [0, ", width, "]");
    TORCH_CHECK(trp == nullptr || (trp[i] >= 0 && trp[i] < table_size), name, ": table row ",
                trp == nullptr ? 0 : trp[i], " out of range");
  }
  const float ban = -std::numeric_limits<float>::infinity();
  at::parallel_for(0, count, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t L = lp[i];
      if (L < n) continue;
      const int64_t* tok = hp + (trp != nullptr ? trp[i] : i) * h_stride;
      const int64_t* tail = tok + L - (n - 1);
      float* row = sp + rp[i] * stride;
      for (int64_t w = 0; w + n <= L; ++w) {
        int64_t k = 0;
        while (k < n - 1 && tok[w + k] == tail[k]) ++k;
        if (k == n - 1) {
          const int64_t t = tok[w + n - 1];
          TORCH_CHECK(t >= 0 && t < vocab, name, ": token ", t, " out of the vocabulary [0, ", vocab, ")");
          row[t] = ban;
        }
      }
    }
  });
}

void ban_repeated_ngrams(at::Tensor scores, const at::Tensor& rows, const at::Tensor& history,
                         const at::Tensor& lengths, int64_t n) {
  ban_ngrams(scores, rows, history, nullptr, lengths, n, "ban_repeated_ngrams");
}

void ban_repeated_ngrams_rows(at::Tensor scores, const at::Tensor& rows, const at::Tensor& table,
                              const at::Tensor& table_rows, const at::Tensor& lengths, int64_t n) {
  ban_ngrams(scores, rows, table, &table_rows, lengths, n, "ban_repeated_ngrams_rows");
}

// scores[:, tokens] = -inf: the token bans every row of a step shares (suppress_tokens, EOS
// under min_tokens), one pass over the rows (index_fill_ on a row-major [rows, vocab]
// tensor costs several times more for a hundred columns).
void ban_tokens(at::Tensor scores, const at::Tensor& tokens) {
  TORCH_CHECK(scores.device().is_cpu() && scores.scalar_type() == at::kFloat && scores.dim() == 2 &&
                  scores.stride(1) == 1,
              "ban_tokens: scores must be a float32 [rows, vocab] cpu tensor with contiguous rows");
  TORCH_CHECK(tokens.scalar_type() == at::kLong && tokens.dim() == 1 && tokens.device().is_cpu(),
              "ban_tokens: tokens must be an int64 cpu tensor [T]");
  const at::Tensor t = tokens.contiguous();
  const int64_t count = t.size(0), rows = scores.size(0), vocab = scores.size(1), stride = scores.stride(0);
  const int64_t* tp = t.data_ptr<int64_t>();
  for (int64_t j = 0; j < count; ++j)
    TORCH_CHECK(tp[j] >= 0 && tp[j] < vocab, "ban_tokens: token ", tp[j], " out of the vocabulary [0, ", vocab, ")");
  float* sp = scores.data_ptr<float>();
  const float ban = -std::numeric_limits<float>::infinity();
  const int64_t grain = std::max<int64_t>(1, 4096 / std::max<int64_t>(1, count));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* row = sp + r * stride;
      for (int64_t j = 0; j < count; ++j) row[tp[j]] = ban;
    }
  });
}

}  // namespace

TORCH_LIBRARY(tandem_cpu_sampling, m) {
  m.def("argmax_rows(Tensor x) -> Tensor");
  m.def("ban_repeated_ngrams(Tensor(a!) scores, Tensor rows, Tensor history, Tensor lengths, int n) -> ()");
  m.def("ban_repeated_ngrams_rows(Tensor(a!) scores, Tensor rows, Tensor table, Tensor table_rows, Tensor lengths, "
        "int n) -> ()");
  m.def("ban_tokens(Tensor(a!) scores, Tensor tokens) -> ()");
}

TORCH_LIBRARY_IMPL(tandem_cpu_sampling, CPU, m) {
  m.impl("argmax_rows", &argmax_rows);
  m.impl("ban_repeated_ngrams", &ban_repeated_ngrams);
  m.impl("ban_repeated_ngrams_rows", &ban_repeated_ngrams_rows);
  m.impl("ban_tokens", &ban_tokens);
}
