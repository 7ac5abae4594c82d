// tandem's CPU paged decode attention: single-token queries attend over keys and
// values read in place from the paged cache [2, num_blocks, block_size, H_kv, D]
// through each sequence's block table; nothing is gathered into a padded batch.
//
// One task per (sequence, KV head): the query heads sharing that KV head (GQA)
// take scores for every key in one pass over the keys, a softmax in float32,
// then one pass over the values. Storage may be float32, float16 or bfloat16;
// all arithmetic is float32. Tasks are spread over torch's intra-op threads.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

template <typename T>
inline float dot(const float* __restrict q, const T* __restrict k, int64_t d) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < d; ++i) s += q[i] * static_cast<float>(k[i]);
  return s;
}

template <typename T>
inline void axpy(float a, const T* __restrict v, float* __restrict acc, int64_t d) {
#pragma omp simd
  for (int64_t i = 0; i < d; ++i) acc[i] += a * static_cast<float>(v[i]);
}

template <typename T>
void decode(const at::Tensor& query, const at::Tensor& kv_cache, at::Tensor& out,
            const at::Tensor& q_rows, const at::Tensor& seqs, const at::Tensor& kv_lens,
            const at::Tensor& block_tables, double scale) {
  const int64_t batch = q_rows.size(0);
  const int64_t num_heads = query.size(1);
  const int64_t head_size = query.size(2);
  const int64_t block_size = kv_cache.size(2);
  const int64_t num_kv_heads = kv_cache.size(3);
  const int64_t group = num_heads / num_kv_heads;

  const T* q_ptr = query.data_ptr<T>();
  const T* k_ptr = kv_cache.data_ptr<T>();
  const T* v_ptr = k_ptr + kv_cache.stride(0);
  T* o_ptr = out.data_ptr<T>();
  const int64_t q_st = query.stride(0), q_sh = query.stride(1);
  const int64_t o_st = out.stride(0), o_sh = out.stride(1);
  const int64_t c_sb = kv_cache.stride(1), c_ss = kv_cache.stride(2), c_sh = kv_cache.stride(3);
  const int64_t* rows = q_rows.data_ptr<int64_t>();
  const int64_t* seq_of = seqs.data_ptr<int64_t>();
  const int64_t* lens = kv_lens.data_ptr<int64_t>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t tab_st = block_tables.stride(0);
  const float fscale = static_cast<float>(scale);

  at::parallel_for(0, batch * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * head_size), acc(group * head_size), scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / num_kv_heads, kvh = task % num_kv_heads;
      const int64_t seq = seq_of[b], row = rows[b], len = lens[seq];
      const int64_t* table = tables + seq * tab_st;
      for (int64_t g = 0; g < group; ++g) {
        const T* qh = q_ptr + row * q_st + (kvh * group + g) * q_sh;
        for (int64_t i = 0; i < head_size; ++i) qf[g * head_size + i] = static_cast<float>(qh[i]) * fscale;
      }
      scores.resize(group * std::max<int64_t>(len, 1));
      // Scores, one pass over the keys.
      for (int64_t n0 = 0, blk = 0; n0 < len; n0 += block_size, ++blk) {
        const T* kb = k_ptr + table[blk] * c_sb + kvh * c_sh;
        const int64_t m = std::min(block_size, len - n0);
        for (int64_t j = 0; j < m; ++j)
          for (int64_t g = 0; g < group; ++g)
            scores[g * len + n0 + j] = dot(&qf[g * head_size], kb + j * c_ss, head_size);
      }
      // Softmax per query head.
      std::vector<float> inv(group);
      for (int64_t g = 0; g < group; ++g) {
        float* s = scores.data() + g * len;
        float mx = -std::numeric_limits<float>::infinity();
        for (int64_t n = 0; n < len; ++n) mx = std::max(mx, s[n]);
        float sum = 0.f;
        for (int64_t n = 0; n < len; ++n) {
          s[n] = std::exp(s[n] - mx);
          sum += s[n];
        }
        inv[g] = sum > 0.f ? 1.f / sum : 0.f;
      }
      // Weighted values, one pass.
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t n0 = 0, blk = 0; n0 < len; n0 += block_size, ++blk) {
        const T* vb = v_ptr + table[blk] * c_sb + kvh * c_sh;
        const int64_t m = std::min(block_size, len - n0);
        for (int64_t j = 0; j < m; ++j)
          for (int64_t g = 0; g < group; ++g)
            axpy(scores[g * len + n0 + j], vb + j * c_ss, &acc[g * head_size], head_size);
      }
      for (int64_t g = 0; g < group; ++g) {
        T* oh = o_ptr + row * o_st + (kvh * group + g) * o_sh;
        for (int64_t i = 0; i < head_size; ++i) oh[i] = static_cast<T>(acc[g * head_size + i] * inv[g]);
      }
    }
  });
}

void paged_decode_attention(const at::Tensor& query, const at::Tensor& kv_cache, at::Tensor& out,
                            const at::Tensor& q_rows, const at::Tensor& seqs, const at::Tensor& kv_lens,
                            const at::Tensor& block_tables, double scale) {
  TORCH_CHECK(query.device().is_cpu() && kv_cache.device().is_cpu() && out.device().is_cpu(),
              "paged_decode_attention: tensors must be on cpu");
  TORCH_CHECK(query.dim() == 3 && out.dim() == 3, "paged_decode_attention: query and out must be [T, H, D]");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2,
              "paged_decode_attention: kv_cache must be [2, num_blocks, block_size, H_kv, D], got ",
              kv_cache.sizes());
  TORCH_CHECK(query.scalar_type() == kv_cache.scalar_type() && out.scalar_type() == query.scalar_type(),
              "paged_decode_attention: query ", query.scalar_type(), ", kv_cache ", kv_cache.scalar_type(),
              " and out ", out.scalar_type(), " must share one dtype");
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
  switch (query.scalar_type()) {
    case at::kFloat: decode<float>(query, kv_cache, out, q_rows, seqs, kv_lens, block_tables, scale); break;
    case at::kBFloat16: decode<c10::BFloat16>(query, kv_cache, out, q_rows, seqs, kv_lens, block_tables, scale); break;
    case at::kHalf: decode<c10::Half>(query, kv_cache, out, q_rows, seqs, kv_lens, block_tables, scale); break;
    default: TORCH_CHECK(false, "paged_decode_attention: dtype ", query.scalar_type(), " is not float32, float16 or bfloat16");
  }
}

}  // namespace

TORCH_LIBRARY(tandem_cpu, m) {
  m.def("paged_decode_attention(Tensor query, Tensor kv_cache, Tensor(a!) out, Tensor q_rows, Tensor seqs, "
        "Tensor kv_lens, Tensor block_tables, float scale) -> ()");
}

TORCH_LIBRARY_IMPL(tandem_cpu, CPU, m) { m.impl("paged_decode_attention", &paged_decode_attention); }
