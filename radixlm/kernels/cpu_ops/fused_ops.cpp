// Fused CPU kernels for the small operations of a decode step (see fused_ops.py).
//
// Each replaces a chain of torch operations whose cost on a CPU is their dispatch, not their
// arithmetic. Arithmetic is float32 whatever the storage type (float32, bfloat16, float16),
// in ATen's SIMD vectors (the build defines CPU_CAPABILITY for the building CPU); results and
// intermediates are rounded to the storage type where torch's chains round them, so bfloat16
// outputs equal torch's but where a float32 sum is ordered differently.

#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <tuple>
#include <type_traits>
#include <vector>

// float32, bfloat16 and float16 storage (the serving dtypes).
#define DISPATCH_STORAGE_TYPES(TYPE, NAME, ...)                    \
  AT_DISPATCH_SWITCH(TYPE, NAME,                                   \
                     AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__)     \
                     AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__)  \
                     AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__))

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kLanes = Vec::size();

// Attention work below this many multiply-adds runs on the calling thread (waking the others
// costs more); row kernels give each thread at least torch's grain of elements.
constexpr int64_t kParallelWork = 1 << 18;
constexpr int64_t kElementGrain = 32768;  // torch's at::internal::GRAIN_SIZE

template <typename T>
inline float load(const T* p, int64_t i) {
  return static_cast<float>(p[i]);
}

// kLanes values from p, widened to float32.
template <typename T>
inline Vec load_vec(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return Vec::loadu(p);
  } else {
    Vec out;
    at::vec::load_to_float(p, out);
    return out;
  }
}

// The row loops below step by kStep values: one vector of a 16-bit type, two of float32,
// so that a 16-bit row is read and written in whole vectors.
constexpr int64_t kStep = 2 * kLanes;

// kStep values as two float32 vectors.
struct VecPair {
  Vec lo, hi;
};

inline VecPair operator+(const VecPair& a, const VecPair& b) { return {a.lo + b.lo, a.hi + b.hi}; }
inline VecPair operator*(const VecPair& a, const VecPair& b) { return {a.lo * b.lo, a.hi * b.hi}; }
inline VecPair operator*(const VecPair& a, const Vec& b) { return {a.lo * b, a.hi * b}; }

// kStep values from p, widened to float32.
template <typename T>
inline VecPair load_step(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return {Vec::loadu(p), Vec::loadu(p + kLanes)};
  } else {
    static_assert(at::vec::Vectorized<T>::size() == kStep, "a 16-bit vector holds kStep values");
    auto [lo, hi] = at::vec::convert_to_float<T>(at::vec::Vectorized<T>::loadu(p));
    return {lo, hi};
  }
}

// kStep values to p, rounded to T.
template <typename T>
inline void store_step(T* p, const VecPair& v) {
  if constexpr (std::is_same_v<T, float>) {
    v.lo.store(p);
    v.hi.store(p + kLanes);
  } else {
    at::vec::convert_from_float<T>(v.lo, v.hi).store(p);
  }
}

// v rounded to T and widened back (in registers): where torch's chain of operations stores
// an intermediate.
template <typename T>
inline VecPair round_step(const VecPair& v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
    auto [lo, hi] = at::vec::convert_to_float<T>(at::vec::convert_from_float<T>(v.lo, v.hi));
    return {lo, hi};
  }
}

template <typename T>
inline float round_to(float v) {
  return static_cast<float>(static_cast<T>(v));
}

inline float sum_lanes(const Vec& v) {
  return at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, v);
}

// sum_i a[i] * b[i] over n.
template <typename A, typename B>
inline float dot(const A* a, const B* b, int64_t n) {
  Vec acc(0.f);
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) acc = at::vec::fmadd(load_vec(a + i), load_vec(b + i), acc);
  float sum = sum_lanes(acc);
  for (; i < n; ++i) sum += load(a, i) * load(b, i);
  return sum;
}

// y = x / sqrt(mean(x^2) + eps) * w over one row of d.
template <typename T>
void norm_row(const T* x, const T* w, T* y, int64_t d, float eps) {
  const float scale = 1.f / std::sqrt(dot(x, x, d) / static_cast<float>(d) + eps);
  const Vec scale_vec(scale);
  int64_t i = 0;
  for (; i + kStep <= d; i += kStep) {
    store_step(y + i, load_step(x + i) * scale_vec * load_step(w + i));
  }
  for (; i < d; ++i) y[i] = static_cast<T>(load(x, i) * scale * load(w, i));
}

// Rows [begin, end) of (rows, d) x: s = x + residual (rounded, if residual is given), y = norm(s).
template <typename T>
void norm_rows(const T* x, const T* residual, const T* w, T* s, T* y, int64_t begin,
               int64_t end, int64_t d, float eps) {
  for (int64_t r = begin; r < end; ++r) {
    const T* row = x + r * d;
    if (residual != nullptr) {
      const T* res = residual + r * d;
      T* sum = s + r * d;
      int64_t i = 0;
      for (; i + kStep <= d; i += kStep) {
        store_step(sum + i, load_step(row + i) + load_step(res + i));
      }
      for (; i < d; ++i) sum[i] = static_cast<T>(load(row, i) + load(res, i));
      row = sum;
    }
    norm_row(row, w, y + r * d, d, eps);
  }
}

// out[i] = a[i] * c[i] + b[i] * s[i] over n, the product a * c rounded to T first (as
// apply_rotary's `x * cos` is, before its addcmul).
template <typename T>
inline void rotate_part(const T* a, const T* b, const T* c, const T* s, T* out, int64_t n) {
  int64_t i = 0;
  for (; i + kStep <= n; i += kStep) {
    const VecPair scaled = round_step<T>(load_step(a + i) * load_step(c + i));
    store_step(out + i, scaled + load_step(b + i) * load_step(s + i));
  }
  for (; i < n; ++i) {
    out[i] = static_cast<T>(round_to<T>(load(a, i) * load(c, i)) + load(b, i) * load(s, i));
  }
}

// Rows [begin, end) of (T, H) heads of d: y = x * cos + (x2, x1) * signed_sin.
template <typename T>
void rotate_rows(const T* x, const T* cos, const T* sin, T* y, int64_t begin, int64_t end,
                 int64_t heads, int64_t d, int64_t token_stride, int64_t head_stride) {
  const int64_t half = d / 2;
  for (int64_t row = begin; row < end; ++row) {
    const int64_t t = row / heads, h = row % heads;
    const T* in = x + t * token_stride + h * head_stride;
    const T* c = cos + t * d;
    const T* s = sin + t * d;
    T* out = y + row * d;
    rotate_part(in, in + half, c, s, out, half);
    rotate_part(in + half, in, c + half, s + half, out + half, half);
  }
}

// exp(v) for silu in storage type T: ATen's faster exp (exp_u20, the one torch's flash
// attention uses) for bfloat16, whose silu, rounded, then equals F.silu's for every finite
// bfloat16 (checked exhaustively by the tests; the default model's 512-token gate_up on 2
// Zen 4 cores, alternated in one process: 0.34-0.50 ms against 0.43-0.71); the exact exp
// (torch's) for the other types.
template <typename T>
inline Vec silu_exp(const Vec& v) {
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    return v.exp_u20();
  } else {
    return v.exp();
  }
}

// Rows [begin, end) of (T, 2 I) gate|up: y = silu(gate) * up.
template <typename T>
void silu_mul_rows(const T* x, T* y, int64_t begin, int64_t end, int64_t width,
                   int64_t row_stride) {
  const Vec one(1.f);
  for (int64_t r = begin; r < end; ++r) {
    const T* gate = x + r * row_stride;
    const T* up = gate + width;
    T* out = y + r * width;
    int64_t i = 0;
    for (; i + kStep <= width; i += kStep) {  // silu(gate) rounded to T, as F.silu's is
      const VecPair g = load_step(gate + i);
      const VecPair silu{g.lo / (one + silu_exp<T>(g.lo.neg())),
                         g.hi / (one + silu_exp<T>(g.hi.neg()))};
      store_step(out + i, round_step<T>(silu) * load_step(up + i));
    }
    for (; i < width; ++i) {
      const float g = load(gate, i);
      out[i] = static_cast<T>(round_to<T>(g / (1.f + std::exp(-g))) * load(up, i));
    }
  }
}

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

struct DecodeShape {
  int64_t batch, heads, kv_heads, group, dim, v_dim, width, pool;
  int64_t k_slot_stride, k_head_stride, v_slot_stride, v_head_stride;
};

#if defined(CPU_CAPABILITY_AVX512)
// The sums of 16 vectors of 16 lanes, sum(v[j]) in lane j: a tree of 45 shuffles and adds
// in place of 16 horizontal sums. Scoring keys 16 at a time so took the default model's
// decode attention (30 layers, bfloat16, 2 threads, a Zen 4) from 16.8 to 12.1 ms for 64
// requests of 100-200 tokens, 157 to 66 ms for 128 of 150-300.
inline __m512 sum_each_of_16(const __m512* v) {
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

// scores[j] = q . key_j for 16 keys (q float32 of dim, a multiple of 16).
template <typename T>
inline void score_16_keys(const float* q, const T* const* keys, int64_t dim, float* scores) {
  __m512 acc[16];
  for (int t = 0; t < 16; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t i = 0; i < dim; i += 16) {
    const __m512 qv = _mm512_loadu_ps(q + i);
    for (int t = 0; t < 16; ++t) acc[t] = _mm512_fmadd_ps(load_vec(keys[t] + i), qv, acc[t]);
  }
  _mm512_storeu_ps(scores, sum_each_of_16(acc));
}

#if defined(__AVX512BF16__)
#define RADIXLM_BF16_DECODE_SCORES 1
// scores[j] = scale * q . key_j for 16 bfloat16 keys and a bfloat16 q of dim (a multiple of
// 32), on dot-product instructions (vdpbf16ps: each lane sums a pair of products, exact, in
// float32): half the instructions of widening the keys to float32, and no widening; the
// scale multiplies the sums (rather than q first). With the value rows read once for a
// group's queries (weighted_rows_of_group): 16 requests of ~500 tokens, the default model's
// 30 layers from the pool, 15.0 against 16.7 ms a step; one layer's (in cache) thirty times,
// 6.1 against 7.0 (2-core Zen 4, both builds side by side in one process).
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
  _mm512_storeu_ps(scores, _mm512_mul_ps(sum_each_of_16(acc), _mm512_set1_ps(scale)));
}
#endif
#endif

#if defined(CPU_CAPABILITY_AVX2)
// The sums of 8 vectors of 8 lanes, sum(v[j]) in lane j: two rounds of pairwise adds within
// 128-bit halves, then the halves' sums.
inline __m256 sum_each_of_8(const __m256* v) {
  const __m256 pairs[4] = {_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]),
                           _mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7])};
  const __m256 low = _mm256_hadd_ps(pairs[0], pairs[1]);   // halves of v[0..3]'s sums
  const __m256 high = _mm256_hadd_ps(pairs[2], pairs[3]);  // halves of v[4..7]'s sums
  return _mm256_add_ps(_mm256_permute2f128_ps(low, high, 0x20),
                       _mm256_permute2f128_ps(low, high, 0x31));
}

// scores[j] = q . key_j for 8 keys (q float32 of dim, a multiple of 8). With the value rows
// read once for a group's queries 32 values at a time (weighted_rows_of_group): 16 requests
// of 200 tokens in scattered slots, the default model's 30 layers, float32, 2-core Zen 3,
// 6.4 against 7.3 ms (best of 15, both builds alternated in one process).
template <typename T>
inline void score_8_keys(const float* q, const T* const* keys, int64_t dim, float* scores) {
  __m256 acc[8];
  for (int t = 0; t < 8; ++t) acc[t] = _mm256_setzero_ps();
  for (int64_t i = 0; i < dim; i += 8) {
    const __m256 qv = _mm256_loadu_ps(q + i);
    for (int t = 0; t < 8; ++t) acc[t] = _mm256_fmadd_ps(load_vec(keys[t] + i), qv, acc[t]);
  }
  _mm256_storeu_ps(scores, sum_each_of_8(acc));
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
                  T* out, const DecodeShape& s, float scale, int64_t begin, int64_t end) {
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
#if defined(CPU_CAPABILITY_AVX512)
    if (s.dim % 16 == 0) {  // 16 keys at a time, for each query of the group
      const T* keys[16];
      for (; j + 16 <= len; j += 16) {
        for (int t = 0; t < 16; ++t) {
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
          score_16_keys(qf.data() + g * s.dim, keys, s.dim, block_scores);
        }
      }
    }
#elif defined(CPU_CAPABILITY_AVX2)
    if (s.dim % 8 == 0) {  // 8 keys at a time, for each query of the group
      const T* keys[8];
      for (; j + 8 <= len; j += 8) {
        for (int t = 0; t < 8; ++t) {
          keys[t] = k + row_slots[j + t] * s.k_slot_stride + hk * s.k_head_stride;
        }
        for (int64_t g = 0; g < s.group; ++g) {
          score_8_keys(qf.data() + g * s.dim, keys, s.dim, scores.data() + g * s.width + j);
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

void check_norm_args(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "CPU tensors expected");
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(), "x and weight dtypes differ");
  TORCH_CHECK(weight.dim() == 1 && x.dim() >= 1 && x.size(-1) == weight.size(0),
              "weight must be (d,) for x (..., d)");
}

// How many times a norm's or RoPE's output (the row grain's unit) one of silu_mul's costs.
constexpr int64_t kSiluCost = 4;

// Rows of row_size outputs a thread takes at least: torch's grain of elements.
int64_t row_grain(int64_t row_size) {
  return std::max<int64_t>(1, kElementGrain / std::max<int64_t>(row_size, 1));
}

std::tuple<at::Tensor, at::Tensor> norm(const at::Tensor& x, const at::Tensor* residual,
                                        const at::Tensor& weight, double eps) {
  check_norm_args(x, weight);
  const int64_t d = x.size(-1);
  const at::Tensor a = x.contiguous();
  const at::Tensor b = residual != nullptr ? residual->contiguous() : at::Tensor();
  const at::Tensor w = weight.contiguous();
  at::Tensor sum = residual != nullptr ? at::empty_like(a) : at::Tensor();
  at::Tensor out = at::empty_like(a);
  const int64_t rows = d == 0 ? 0 : a.numel() / d;
  DISPATCH_STORAGE_TYPES(x.scalar_type(), "rms_norm", [&] {
    const scalar_t* bp = residual != nullptr ? b.data_ptr<scalar_t>() : nullptr;
    scalar_t* sp = residual != nullptr ? sum.data_ptr<scalar_t>() : nullptr;
    at::parallel_for(0, rows, row_grain(d), [&](int64_t begin, int64_t end) {
      norm_rows(a.data_ptr<scalar_t>(), bp, w.data_ptr<scalar_t>(), sp,
                out.data_ptr<scalar_t>(), begin, end, d, static_cast<float>(eps));
    });
  });
  return {out, sum};
}

}  // namespace

// rms_norm(x (..., d), weight (d,)) -> (..., d): F.rms_norm's result (one rounding).
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  return std::get<0>(norm(x, nullptr, weight, eps));
}

// add_rms_norm(x, residual, weight) -> (rms_norm(s), s), s = x + residual rounded to the
// storage type as torch's `x + residual` rounds it; x and residual (..., d) alike.
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.sizes() == residual.sizes() && x.scalar_type() == residual.scalar_type(),
              "x and residual differ in shape or dtype");
  return norm(x, &residual, weight, eps);
}

// paged_decode_attention: one query token per request over its keys in the paged pool.
//   q (B, H, D); k_buffer (N, H_kv, D) and v_buffer (N, H_kv, D_v), any strides with unit
//   stride in the last dim (values may be a view of the keys); slots (B, S) int64, the pool
//   slot of each request's key j (entries at j >= seq_lens[b] are not read); seq_lens (B,)
//   int64 in [1, S]. Query head h reads KV head h / (H / H_kv).
//   Returns (B, H, D_v) in q's dtype: softmax(q . k * scale) . v, float32 inside.
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_buffer,
                                  const at::Tensor& v_buffer, const at::Tensor& slots,
                                  const at::Tensor& seq_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_buffer.dim() == 3 && v_buffer.dim() == 3,
              "q, k_buffer and v_buffer must be 3-D");
  TORCH_CHECK(q.device().is_cpu() && k_buffer.device().is_cpu() && v_buffer.device().is_cpu(),
              "CPU tensors expected");
  TORCH_CHECK(q.scalar_type() == k_buffer.scalar_type() &&
                  q.scalar_type() == v_buffer.scalar_type(), "q, k and v dtypes differ");
  TORCH_CHECK(slots.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong,
              "slots and seq_lens must be int64");
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
                   static_cast<float>(scale), begin, end);
    });
  });
  return out;
}

// rotary(x (T, H, D), cos (T, 1, D), signed_sin (T, 1, D)) -> (T, H, D): the "rotate half"
// RoPE of rotary_embedding.apply_rotary, x * cos + (x2, x1) * signed_sin (x may be a view
// with unit stride in D).
at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& signed_sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.size(2) % 2 == 0,
              "x must be (T, H, D) with even D and unit stride in D");
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == cos.scalar_type() &&
                  x.scalar_type() == signed_sin.scalar_type(), "x, cos and sin dtypes differ");
  const int64_t tokens = x.size(0), heads = x.size(1), d = x.size(2);
  TORCH_CHECK(cos.numel() == tokens * d && signed_sin.numel() == tokens * d,
              "cos and sin must be (T, 1, D)");
  const at::Tensor c = cos.contiguous();
  const at::Tensor s = signed_sin.contiguous();
  at::Tensor out = at::empty({tokens, heads, d}, x.options());
  DISPATCH_STORAGE_TYPES(x.scalar_type(), "rotary", [&] {
    at::parallel_for(0, tokens * heads, row_grain(d), [&](int64_t begin, int64_t end) {
      rotate_rows(x.data_ptr<scalar_t>(), c.data_ptr<scalar_t>(), s.data_ptr<scalar_t>(),
                  out.data_ptr<scalar_t>(), begin, end, heads, d, x.stride(0), x.stride(1));
    });
  });
  return out;
}

// silu_mul(gate_up (T, 2 I)) -> (T, I): silu(gate_up[:, :I]) * gate_up[:, I:]. An output
// costs about kSiluCost times a norm's or RoPE's (an exponential and a division), so
// threads share rows from a quarter of the grain on (16 rows of the default model's 1536:
// 11.4 against 20.7 us on one thread, 2-core Zen 4).
at::Tensor silu_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0 && gate_up.stride(1) == 1,
              "gate_up must be (T, 2 I) with unit stride in its last dim");
  TORCH_CHECK(gate_up.device().is_cpu(), "a CPU tensor expected");
  const int64_t rows = gate_up.size(0), width = gate_up.size(1) / 2;
  at::Tensor out = at::empty({rows, width}, gate_up.options());
  DISPATCH_STORAGE_TYPES(gate_up.scalar_type(), "silu", [&] {
    at::parallel_for(0, rows, row_grain(kSiluCost * width), [&](int64_t begin, int64_t end) {
      silu_mul_rows(gate_up.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), begin, end, width,
                    gate_up.stride(0));
    });
  });
  return out;
}

// scatter_rows(buffer (N, ...), slots (T,) int64, rows (T, ...)): buffer[slots[t]] = rows[t],
// as buffer.index_copy_(0, slots, rows) (a KV pool's store); buffer contiguous, each row of
// rows contiguous (rows may be a view with any stride between rows), slots in [0, N).
void scatter_rows(at::Tensor& buffer, const at::Tensor& slots, const at::Tensor& rows) {
  TORCH_CHECK(buffer.device().is_cpu() && rows.device().is_cpu() && slots.device().is_cpu(),
              "CPU tensors expected");
  TORCH_CHECK(buffer.scalar_type() == rows.scalar_type(), "buffer and rows dtypes differ");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1, "slots must be (T,) int64");
  TORCH_CHECK(buffer.is_contiguous() && buffer.dim() >= 1, "buffer must be contiguous");
  TORCH_CHECK(rows.dim() == buffer.dim() && rows.size(0) == slots.size(0) &&
                  rows.sizes().slice(1) == buffer.sizes().slice(1),
              "rows must be (T, ...) with buffer's row shape");
  const int64_t count = rows.size(0);
  if (count == 0) return;
  const at::Tensor source = rows[0].is_contiguous() ? rows : rows.contiguous();
  const at::Tensor index = slots.contiguous();
  const int64_t* slot_p = index.data_ptr<int64_t>();
  const int64_t pool = buffer.size(0);
  for (int64_t t = 0; t < count; ++t) {
    TORCH_CHECK(slot_p[t] >= 0 && slot_p[t] < pool, "slot out of the buffer");
  }
  const int64_t row_bytes = buffer.numel() / std::max<int64_t>(pool, 1) * buffer.element_size();
  const int64_t source_stride = source.stride(0) * source.element_size();
  const char* from = static_cast<const char*>(source.data_ptr());
  char* to = static_cast<char*>(buffer.data_ptr());
  const int64_t grain = std::max<int64_t>(1, kElementGrain * 4 / std::max<int64_t>(row_bytes, 1));
  at::parallel_for(0, count, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      std::memcpy(to + slot_p[t] * row_bytes, from + t * source_stride, row_bytes);
    }
  });
}
