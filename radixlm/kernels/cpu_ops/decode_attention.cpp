// Decode attention over the paged KV pool (see fused_ops.py): one query token per request
// against its keys where they lie in the pool, without gathering them.

#include "common.h"
#include "kernels.h"

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

namespace {

using radixlm_vec::dot;
using radixlm_vec::kLanes;
using radixlm_vec::load;
using radixlm_vec::load_vec;
using radixlm_vec::sum_lanes;
using radixlm_vec::Vec;

// Attention work below this many multiply-adds runs on the calling thread (waking the others
// costs more).
constexpr int64_t kParallelWork = 1 << 18;

// p[0, n) <- exp(p[0, n) - max p); returns their sum (softmax without the division).
inline float exp_shifted(float* p, int64_t n) {
  Vec top_vec(-std::numeric_limits<float>::infinity());
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) top_vec = at::vec::maximum(top_vec, Vec::loadu(p + j));
  float top = at::vec::vec_reduce_all<float>(
      [](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, top_vec);
  for (; j < n; ++j) top = std::max(top, p[j]);
  Vec total_vec(0.f);
  j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    const Vec e = (Vec::loadu(p + j) - Vec(top)).exp();
    e.store(p + j);
    total_vec = total_vec + e;
  }
  float total = sum_lanes(total_vec);
  for (; j < n; ++j) {
    p[j] = std::exp(p[j] - top);
    total += p[j];
  }
  return total;
}

// out[0, n) = scale * sum_j w[j] * row_j[0, n) over j < len, row_j = base + slots[j] * stride:
// a few vectors of out at a time, their sums held in registers over all the rows.
template <typename T>
void weighted_rows(const float* w, const T* base, const int64_t* slots, int64_t len,
                   int64_t stride, float scale, T* out, int64_t n) {
  int64_t i = 0;
  for (; i + 4 * kLanes <= n; i += 4 * kLanes) {
    Vec a0(0.f), a1(0.f), a2(0.f), a3(0.f);
    for (int64_t j = 0; j < len; ++j) {
      const T* row = base + slots[j] * stride + i;
      const Vec weight(w[j]);
      a0 = at::vec::fmadd(weight, load_vec(row), a0);
      a1 = at::vec::fmadd(weight, load_vec(row + kLanes), a1);
      a2 = at::vec::fmadd(weight, load_vec(row + 2 * kLanes), a2);
      a3 = at::vec::fmadd(weight, load_vec(row + 3 * kLanes), a3);
    }
    float sums[4 * kLanes];
    (a0 * Vec(scale)).store(sums);
    (a1 * Vec(scale)).store(sums + kLanes);
    (a2 * Vec(scale)).store(sums + 2 * kLanes);
    (a3 * Vec(scale)).store(sums + 3 * kLanes);
    for (int64_t l = 0; l < 4 * kLanes; ++l) out[i + l] = static_cast<T>(sums[l]);
  }
  for (; i < n; ++i) {
    float a = 0.f;
    for (int64_t j = 0; j < len; ++j) a += w[j] * load(base + slots[j] * stride, i);
    out[i] = static_cast<T>(a * scale);
  }
}

// p[0, n) <- cap * tanh(p[0, n) / cap): a logit softcap (Gemma 2) on scaled scores.
inline void soft_cap(float* p, int64_t n, float cap) {
  const Vec cap_vec(cap), inverse(1.f / cap);
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    ((Vec::loadu(p + j) * inverse).tanh() * cap_vec).store(p + j);
  }
  for (; j < n; ++j) p[j] = cap * std::tanh(p[j] / cap);
}

struct DecodeShape {
  int64_t batch, heads, kv_heads, group, dim, v_dim, width, pool;
  int64_t k_slot_stride, k_head_stride, v_slot_stride, v_head_stride;
};

// Keys are scored kLanes at a time where the build has SIMD registers: the lanes of kLanes
// accumulators summed at once (sum_each: one vector of sums) in place of kLanes horizontal
// sums. Simd is one register of kLanes float32 lanes as the intrinsics take it (ATen's Vec
// converts to and from it): arrays of these stay in registers where arrays of Vec are kept
// on the stack.
#if defined(CPU_CAPABILITY_AVX512)
#define RADIXLM_KEYS_AT_ONCE 1
using Simd = __m512;

// The sums of 16 vectors of 16 lanes, sum(v[j]) in lane j: a tree of 45 shuffles and adds.
inline Simd sum_each(const Simd* v) {
  __m512 halves[8], quarters[4], pairs[2];
  for (int i = 0; i < 8; ++i) {  // 256-bit halves of v[2i] (low) and v[2i + 1] (high)
    halves[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                              _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
  }
  for (int i = 0; i < 4; ++i) {  // 128-bit quarters of v[4i .. 4i + 3]
    quarters[i] = _mm512_add_ps(_mm512_shuffle_f32x4(halves[2 * i], halves[2 * i + 1], 0x88),
                                _mm512_shuffle_f32x4(halves[2 * i], halves[2 * i + 1], 0xDD));
  }
  for (int i = 0; i < 2; ++i) {  // quarter k: pairs of v[k], v[k + 4] (v[k + 8], v[k + 12])
    pairs[i] = _mm512_add_ps(_mm512_shuffle_ps(quarters[2 * i], quarters[2 * i + 1], 0x44),
                             _mm512_shuffle_ps(quarters[2 * i], quarters[2 * i + 1], 0xEE));
  }
  // lane 4k + m: the sum of v[4m + k]; the permutation puts it in lane 4m + k.
  const __m512 sums = _mm512_add_ps(_mm512_shuffle_ps(pairs[0], pairs[1], 0x88),
                                    _mm512_shuffle_ps(pairs[0], pairs[1], 0xDD));
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, sums);
}
#elif defined(CPU_CAPABILITY_AVX2)
#define RADIXLM_KEYS_AT_ONCE 1
using Simd = __m256;

// The sums of 8 vectors of 8 lanes, sum(v[j]) in lane j: two rounds of pairwise adds within
// 128-bit halves, then the halves' sums.
inline Simd sum_each(const Simd* v) {
  const __m256 pairs[4] = {_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]),
                           _mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7])};
  const __m256 low = _mm256_hadd_ps(pairs[0], pairs[1]);   // halves of v[0..3]'s sums
  const __m256 high = _mm256_hadd_ps(pairs[2], pairs[3]);  // halves of v[4..7]'s sums
  return _mm256_add_ps(_mm256_permute2f128_ps(low, high, 0x20),
                       _mm256_permute2f128_ps(low, high, 0x31));
}
#endif

#ifdef RADIXLM_KEYS_AT_ONCE
// scores[j] = q . key_j for kLanes keys (q float32 of dim, a multiple of kLanes), their
// sums taken together at the end (sum_each). AVX-512, 16 keys at a time; AVX2, 8 at a time,
// with the value rows read once for a group's queries 32 values at a time
// (weighted_rows_of_group). Both faster than a key at a time (benchmarks/RESULTS.md).
template <typename T>
inline void score_keys(const float* q, const T* const* keys, int64_t dim, float* scores) {
  Simd acc[kLanes];
  for (int t = 0; t < kLanes; ++t) acc[t] = Vec(0.f);
  for (int64_t i = 0; i < dim; i += kLanes) {
    const Vec qv = Vec::loadu(q + i);
    for (int t = 0; t < kLanes; ++t) {
      acc[t] = at::vec::fmadd(load_vec(keys[t] + i), qv, Vec(acc[t]));
    }
  }
  Vec(sum_each(acc)).store(scores);
}
#endif

#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
#define RADIXLM_BF16_DECODE_SCORES 1
// scores[j] = scale * q . key_j for 16 bfloat16 keys and a bfloat16 q of dim (a multiple of
// 32), on dot-product instructions (vdpbf16ps: each lane sums a pair of products, exact, in
// float32): half the instructions of widening the keys to float32, and no widening; the
// scale multiplies the sums (rather than q first). With the value rows read once for a
// group's queries (weighted_rows_of_group): faster from the pool and in cache (2-core Zen 4;
// benchmarks/RESULTS.md).
inline void score_16_keys_bf16(const c10::BFloat16* q, const c10::BFloat16* const* keys,
                               int64_t dim, float scale, float* scores) {
  __m512 acc[16];
  for (int t = 0; t < 16; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t i = 0; i < dim; i += 32) {
    const __m512bh qv = (__m512bh)_mm512_loadu_si512(q + i);
    for (int t = 0; t < 16; ++t) {
      acc[t] = _mm512_dpbf16_ps(acc[t], qv, (__m512bh)_mm512_loadu_si512(keys[t] + i));
    }
  }
  _mm512_storeu_ps(scores, _mm512_mul_ps(sum_each(acc), _mm512_set1_ps(scale)));
}
#endif

// out_g[0, n) = scales[g] * sum_j w_g[j] * row_j[0, n) for n = 4 vectors (64 values on
// AVX-512) and the G queries g of a group (w_g = w + g * w_stride, out_g = out + g *
// out_stride), each value row read once for all of them: the sums of each query as
// weighted_rows's, in the same order.
template <int G, typename T>
inline void weighted_rows_of_group(const float* w, int64_t w_stride, const T* base,
                             const int64_t* slots, int64_t len, int64_t stride,
                             const float* scales, T* out, int64_t out_stride) {
  Vec acc[G][4];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < 4; ++c) acc[g][c] = Vec(0.f);
  for (int64_t j = 0; j < len; ++j) {
    const T* row = base + slots[j] * stride;
    const Vec v[4] = {load_vec(row), load_vec(row + kLanes), load_vec(row + 2 * kLanes),
                      load_vec(row + 3 * kLanes)};
    for (int g = 0; g < G; ++g) {
      const Vec weight(w[g * w_stride + j]);
      for (int c = 0; c < 4; ++c) acc[g][c] = at::vec::fmadd(weight, v[c], acc[g][c]);
    }
  }
  for (int g = 0; g < G; ++g) {
    float sums[4 * kLanes];
    for (int c = 0; c < 4; ++c) (acc[g][c] * Vec(scales[g])).store(sums + c * kLanes);
    for (int64_t l = 0; l < 4 * kLanes; ++l) out[g * out_stride + l] = static_cast<T>(sums[l]);
  }
}

// Tasks [begin, end) of (request, KV head): the group's queries over the request's keys.
template <typename T>
void decode_tasks(const T* q, const T* k, const T* v, const int64_t* slots, const int64_t* lens,
                  T* out, const DecodeShape& s, float scale, float softcap, int64_t begin,
                  int64_t end) {
  std::vector<float> qf(s.group * s.dim), scores(s.group * s.width), inverse_totals(s.group);
  for (int64_t task = begin; task < end; ++task) {
    const int64_t b = task / s.kv_heads, hk = task % s.kv_heads, len = lens[b];
    const int64_t* row_slots = slots + b * s.width;
    const int64_t first_head = b * s.heads + hk * s.group;
    for (int64_t j = 0; j < len; ++j) {
      TORCH_CHECK(row_slots[j] >= 0 && row_slots[j] < s.pool, "slot out of the pool");
    }
    for (int64_t g = 0; g < s.group; ++g) {
      const T* qh = q + (first_head + g) * s.dim;
      for (int64_t i = 0; i < s.dim; ++i) qf[g * s.dim + i] = load(qh, i) * scale;
    }
    int64_t j = 0;
#ifdef RADIXLM_KEYS_AT_ONCE
    if (s.dim % kLanes == 0) {  // kLanes keys at a time, for each query of the group
      const T* keys[kLanes];
      for (; j + kLanes <= len; j += kLanes) {
        for (int t = 0; t < kLanes; ++t) {
          keys[t] = k + row_slots[j + t] * s.k_slot_stride + hk * s.k_head_stride;
        }
        for (int64_t g = 0; g < s.group; ++g) {
          float* block_scores = scores.data() + g * s.width + j;
#ifdef RADIXLM_BF16_DECODE_SCORES
          if constexpr (std::is_same_v<T, c10::BFloat16>) {
            if (s.dim % 32 == 0) {
              score_16_keys_bf16(q + (first_head + g) * s.dim, keys, s.dim, scale,
                                 block_scores);
              continue;
            }
          }
#endif
          score_keys(qf.data() + g * s.dim, keys, s.dim, block_scores);
        }
      }
    }
#endif
    for (; j < len; ++j) {  // each key row is read once for the whole group
      const T* key = k + row_slots[j] * s.k_slot_stride + hk * s.k_head_stride;
      for (int64_t g = 0; g < s.group; ++g) {
        scores[g * s.width + j] = dot(qf.data() + g * s.dim, key, s.dim);
      }
    }
    for (int64_t g = 0; g < s.group; ++g) {
      if (softcap > 0.f) soft_cap(scores.data() + g * s.width, len, softcap);
      inverse_totals[g] = 1.f / exp_shifted(scores.data() + g * s.width, len);
    }
    const T* values = v + hk * s.v_head_stride;
    T* group_out = out + first_head * s.v_dim;
    int64_t g = 0;
    if (s.v_dim % (4 * kLanes) == 0) {  // up to four queries a pass over the value rows
      // (4 vectors of each row a pass: 64 values on AVX-512, 32 on AVX2)
      for (int64_t c = 0; c < s.v_dim; c += 4 * kLanes) {
        for (g = 0; g + 4 <= s.group; g += 4) {
          weighted_rows_of_group<4>(scores.data() + g * s.width, s.width, values + c,
                                    row_slots, len, s.v_slot_stride,
                                    inverse_totals.data() + g, group_out + g * s.v_dim + c,
                                    s.v_dim);
        }
        const auto rest = [&](auto count) {
          weighted_rows_of_group<decltype(count)::value>(
              scores.data() + g * s.width, s.width, values + c, row_slots, len,
              s.v_slot_stride, inverse_totals.data() + g, group_out + g * s.v_dim + c,
              s.v_dim);
        };
        switch (s.group - g) {
          case 3: rest(std::integral_constant<int, 3>()); break;
          case 2: rest(std::integral_constant<int, 2>()); break;
          case 1: rest(std::integral_constant<int, 1>()); break;
          default: break;
        }
      }
      g = s.group;
    }
    for (; g < s.group; ++g) {  // the group's value rows stay in cache
      weighted_rows(scores.data() + g * s.width, values, row_slots, len, s.v_slot_stride,
                    inverse_totals[g], group_out + g * s.v_dim, s.v_dim);
    }
  }
}

}  // namespace

// paged_decode_attention: one query token per request over its keys in the paged pool.
//   q (B, H, D); k_buffer (N, H_kv, D) and v_buffer (N, H_kv, D_v), any strides with unit
//   stride in the last dim (values may be a view of the keys); slots (B, S) int64, the pool
//   slot of each request's key j (entries at j >= seq_lens[b] are not read); seq_lens (B,)
//   int64 in [1, S]. Query head h reads KV head h / (H / H_kv).
//   Returns (B, H, D_v) in q's dtype: softmax(q . k * scale) . v, float32 inside; with
//   softcap c > 0, softmax(c * tanh(q . k * scale / c)) . v (0: none). A sliding window is
//   the caller's table: slots holding only the window's keys, seq_lens their count.
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_buffer,
                                  const at::Tensor& v_buffer, const at::Tensor& slots,
                                  const at::Tensor& seq_lens, double scale, double softcap) {
  TORCH_CHECK(q.dim() == 3 && k_buffer.dim() == 3 && v_buffer.dim() == 3,
              "q, k_buffer and v_buffer must be 3-D");
  TORCH_CHECK(q.device().is_cpu() && k_buffer.device().is_cpu() && v_buffer.device().is_cpu(),
              "CPU tensors expected");
  TORCH_CHECK(q.scalar_type() == k_buffer.scalar_type() &&
                  q.scalar_type() == v_buffer.scalar_type(), "q, k and v dtypes differ");
  TORCH_CHECK(slots.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong,
              "slots and seq_lens must be int64");
  TORCH_CHECK(softcap >= 0, "softcap must be >= 0 (0: none)");
  TORCH_CHECK(k_buffer.stride(2) == 1 && v_buffer.stride(2) == 1,
              "k_buffer and v_buffer need unit stride in their last dim");
  DecodeShape s{};
  s.batch = q.size(0), s.heads = q.size(1), s.dim = q.size(2);
  s.kv_heads = k_buffer.size(1), s.v_dim = v_buffer.size(2);
  TORCH_CHECK(k_buffer.size(2) == s.dim && v_buffer.size(1) == s.kv_heads && s.kv_heads > 0 &&
                  s.heads % s.kv_heads == 0, "q, k_buffer and v_buffer heads do not match");
  TORCH_CHECK(slots.dim() == 2 && slots.size(0) == s.batch && seq_lens.numel() == s.batch,
              "slots must be (B, S) and seq_lens (B,)");
  s.group = s.heads / s.kv_heads, s.width = slots.size(1);
  s.k_slot_stride = k_buffer.stride(0), s.k_head_stride = k_buffer.stride(1);
  s.v_slot_stride = v_buffer.stride(0), s.v_head_stride = v_buffer.stride(1);
  const at::Tensor query = q.contiguous();
  const at::Tensor table = slots.contiguous();
  const at::Tensor lens = seq_lens.contiguous();
  const int64_t* len_p = lens.data_ptr<int64_t>();
  const int64_t* slot_p = table.data_ptr<int64_t>();
  s.pool = std::min(k_buffer.size(0), v_buffer.size(0));
  for (int64_t b = 0; b < s.batch; ++b) {
    TORCH_CHECK(len_p[b] >= 1 && len_p[b] <= s.width, "seq_lens out of [1, S]");
  }
  at::Tensor out = at::empty({s.batch, s.heads, s.v_dim}, q.options());
  const int64_t tasks = s.batch * s.kv_heads;
  const int64_t work = s.batch * s.heads * s.width * (s.dim + s.v_dim);
  const int64_t grain = work < kParallelWork ? std::max<int64_t>(tasks, 1) : 1;
  DISPATCH_STORAGE_TYPES(q.scalar_type(), "decode", [&] {
    at::parallel_for(0, tasks, grain, [&](int64_t begin, int64_t end) {
      decode_tasks(query.data_ptr<scalar_t>(), k_buffer.data_ptr<scalar_t>(),
                   v_buffer.data_ptr<scalar_t>(), slot_p, len_p, out.data_ptr<scalar_t>(), s,
                   static_cast<float>(scale), static_cast<float>(softcap), begin, end);
    });
  });
  return out;
}
