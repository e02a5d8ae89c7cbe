// bfloat16 matmuls on AVX-512 BF16 dot products over a weight laid out by column pairs, for
// passes of any number of rows (see fused_ops.py and models/layers/cpu_weight_layout.py).
//
// out = x @ w.T for x (M, K) bfloat16 and w (N, K) bfloat16 stored as pairs (N / 16, K / 2,
// 16, 2): for each group of 16 output columns and each pair of K, the 16 columns' two weights
// side by side, one 512-bit vector. One dot-product instruction (vdpbf16ps) multiplies it by a
// row's pair of activations broadcast to every lane and adds both products to that row's 16
// float32 sums: no horizontal sums, and 16 outputs a store. A tile keeps R rows by C groups of
// sums in registers (8 by 3 at most: 24 of the 32 vector registers) and reads each weight
// vector once for its R rows; a thread's chunk of C groups (C * K * 32 bytes, within L2) is
// walked by tiles of 8, 4, 2 and 1 rows, and the first tile of a chunk asks for the next
// chunk's weights as it goes, into L2 (into L1 that was slower: all the model's weights at
// one row on one thread, 17.5 ms against 13.3). Sums are float32 in the order of K whatever
// M is, so a row's outputs do not depend on the rows beside it; each is rounded once (to
// nearest even).
//
// All of the default model's weights a pass (134.5 M), a 2-core Zen 4 without AMX, against
// oneDNN's bfloat16 kernel on its blocked layout (and the plain rows of few_rows_matmul.cpp),
// 2 threads: one row 12.5 ms against 18.0 (15.3), 4 rows 13.1 against 17.0 (16.9), 16 rows
// 18.5 against 22.3 (230 GFLOP/s), 128 rows 86 against 90, 512 rows 337 against 340 (410
// GFLOP/s); one thread: one row 11.5 against 19.7 (16.5), 16 rows 24.0 against 30.2, 512
// rows 652 against 661 (211 GFLOP/s, near a core's peak of one 512-bit dot product a cycle).

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define RADIXLM_PAIR_MATMUL 1
#endif

namespace radixlm_pairs {

constexpr int64_t kGroup = 16;  // output columns of one vector of sums

#ifdef RADIXLM_PAIR_MATMUL

// Work below this many multiply-adds runs on the calling thread.
constexpr int64_t kParallelWork = 1 << 17;

inline __m512bh as_pairs(__m512i v) { return (__m512bh)v; }

inline __m512bh broadcast_pair(const uint16_t* p) {
  int32_t pair;
  std::memcpy(&pair, p, sizeof(pair));
  return as_pairs(_mm512_set1_epi32(pair));
}

struct Shape {
  int64_t M, K, N;
  int64_t group_stride;  // elements from one group of 16 columns to the next: K * 16
};

// Rows [0, R) of x against groups [0, C) from w into out. With `ahead`, one cache line of
// the next chunk per group and pair is requested (the whole chunk over the pairs).
template <int R, int C>
inline void tile(const uint16_t* x, const uint16_t* w, uint16_t* out, const Shape& s,
                 const char* ahead) {
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  const int64_t pairs = s.K / 2;
  for (int64_t p = 0; p < pairs; ++p) {
    __m512bh wv[C];
    for (int c = 0; c < C; ++c) {
      wv[c] = as_pairs(_mm512_loadu_si512(w + c * s.group_stride + p * 2 * kGroup));
    }
    if (ahead != nullptr) {
      for (int c = 0; c < C; ++c) _mm_prefetch(ahead + (p * C + c) * 64, _MM_HINT_T1);
    }
    for (int r = 0; r < R; ++r) {
      const __m512bh xv = broadcast_pair(x + r * s.K + 2 * p);
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], xv, wv[c]);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < C; ++c) {
      const __m256bh rounded = _mm512_cvtneps_pbh(acc[r][c]);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * s.N + c * kGroup),
                          (__m256i)rounded);
    }
  }
}

// All M rows against the C groups at w (output columns from out), tiles of 8, 4, 2, 1 rows.
template <int C>
void chunk(const uint16_t* x, const uint16_t* w, uint16_t* out, const Shape& s,
           const char* ahead) {
  int64_t m = 0;
  for (; m + 8 <= s.M; m += 8) tile<8, C>(x + m * s.K, w, out + m * s.N, s, m ? nullptr : ahead);
  const int64_t rest = s.M - m;
  if (rest & 4) {
    tile<4, C>(x + m * s.K, w, out + m * s.N, s, m ? nullptr : ahead);
    m += 4;
  }
  if (rest & 2) {
    tile<2, C>(x + m * s.K, w, out + m * s.N, s, m ? nullptr : ahead);
    m += 2;
  }
  if (rest & 1) tile<1, C>(x + m * s.K, w, out + m * s.N, s, m ? nullptr : ahead);
}

// The last chunk of a thread's share may have fewer groups than the others.
template <int C>
void chunk_of(int64_t groups, const uint16_t* x, const uint16_t* w, uint16_t* out,
              const Shape& s, const char* ahead) {
  if constexpr (C > 1) {
    if (groups < C) return chunk_of<C - 1>(groups, x, w, out, s, ahead);
  }
  chunk<C>(x, w, out, s, ahead);
}

// C groups a chunk: 3 where tiles of 8 rows are walked (24 sums, 3 weight vectors and a
// broadcast row: 28 registers), else 4 (4 rows by 4 groups; one row reads 4 weight streams).
template <int C>
void matmul(const uint16_t* x, const uint16_t* w, uint16_t* out, const Shape& s) {
  const int64_t groups = s.N / kGroup;
  const int64_t chunks = (groups + C - 1) / C;
  const int64_t work = std::max<int64_t>(1, s.M * s.K * C * kGroup);
  at::parallel_for(0, chunks, std::max<int64_t>(1, kParallelWork / work),
                   [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t g = t * C;
      const uint16_t* weights = w + g * s.group_stride;
      const char* ahead = t + 1 < end
          ? reinterpret_cast<const char*>(weights + C * s.group_stride) : nullptr;
      chunk_of<C>(std::min<int64_t>(C, groups - g), x, weights, out + g * kGroup, s, ahead);
    }
  });
}

#endif  // RADIXLM_PAIR_MATMUL

}  // namespace radixlm_pairs

bool pair_matmul_available() {
#ifdef RADIXLM_PAIR_MATMUL
  return true;
#else
  return false;
#endif
}

at::Tensor pair_matmul(const at::Tensor& x, const at::Tensor& pairs) {
  TORCH_CHECK(pair_matmul_available(), "pair_matmul needs a build with AVX-512 BF16");
  TORCH_CHECK(x.device().is_cpu() && pairs.device().is_cpu(), "CPU tensors expected");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && pairs.scalar_type() == at::kBFloat16,
              "x and pairs must be bfloat16");
  TORCH_CHECK(pairs.dim() == 4 && pairs.size(2) == radixlm_pairs::kGroup && pairs.size(3) == 2 &&
                  pairs.is_contiguous(),
              "pairs must be a contiguous (N / 16, K / 2, 16, 2)");
  TORCH_CHECK(x.dim() == 2 && x.size(1) == 2 * pairs.size(1),
              "x must be (M, K) for pairs (N / 16, K / 2, 16, 2)");
  const at::Tensor a = x.contiguous();
  const int64_t M = a.size(0), N = pairs.size(0) * radixlm_pairs::kGroup;
  at::Tensor out = at::empty({M, N}, a.options());
  if (M == 0 || N == 0) return out;
#ifdef RADIXLM_PAIR_MATMUL
  const int64_t K = a.size(1);
  const radixlm_pairs::Shape shape{M, K, N, K * radixlm_pairs::kGroup};
  const auto* xs = reinterpret_cast<const uint16_t*>(a.data_ptr<at::BFloat16>());
  const auto* ws = reinterpret_cast<const uint16_t*>(pairs.data_ptr<at::BFloat16>());
  auto* os = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  if (M >= 8) {
    radixlm_pairs::matmul<3>(xs, ws, os, shape);
  } else {
    radixlm_pairs::matmul<4>(xs, ws, os, shape);
  }
#endif
  return out;
}
