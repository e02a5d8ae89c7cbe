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
// walked by tiles of 8, 4, 2 and 1 rows, and its first two tiles ask for the next chunk's
// weights as they go, half each, into L2 (into L1 was slower; all of them in the first tile,
// as before, was slower too: the second tile's sums ran from L2 while the memory idled;
// benchmarks/RESULTS.md). Sums are float32 in the order of K whatever M is,
// so a row's outputs do not depend on the rows beside it; each is rounded once (to
// nearest even).
//
// All of the default model's weights a pass (134.5 M), a 2-core Zen 4 without AMX: faster
// than oneDNN's bfloat16 kernel on its blocked layout (and the plain rows of
// few_rows_matmul.cpp) at every row count measured, on one thread and two, most at few
// rows; at 512 rows near a core's peak of one 512-bit dot product a cycle
// (benchmarks/RESULTS.md).
//
// int8_pair_matmul runs the same tiles over int8 weights by pairs (weight-only int8, one
// scale an output column, applied to the float32 sums): each vector of 32 integers is
// widened to bfloat16 in registers (exact), per tile for passes of up to 8 rows, else once a
// chunk into a thread's buffer that all its tiles read (the same values, so the same sums:
// rows stay independent of their neighbours). Faster than bfloat16 pairs at one row (half
// the bytes) and even from 16 rows; faster than the int8 rows of few_rows_matmul.cpp and
// than widening to bfloat16 for oneDNN (benchmarks/RESULTS.md).
//
// pair_matmul_silu and int8_pair_matmul_silu take a gated MLP's gate_up weight (the gate's
// groups over the up's) and return silu(gate) * up: a thread computes a chunk of the gate's
// columns into its own rows, then the up's chunk of the same columns, whose tiles apply the
// SiLU and the product as they store. The (M, 2 I) products are never written nor read back,
// and the bits are silu_mul's of pair_matmul's: a little faster than pair_matmul then
// silu_mul, alone and in a whole pass (benchmarks/RESULTS.md).

#include "common.h"
#include "kernels.h"

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define RADIXLM_PAIR_MATMUL 1
#endif

namespace radixlm_pairs {

#define RADIXLM_INLINE __attribute__((always_inline))

#ifndef RADIXLM_PAIR_COLUMNS
#error "build through fused_ops.py, which defines RADIXLM_PAIR_COLUMNS"
#endif
constexpr int64_t kGroup = RADIXLM_PAIR_COLUMNS;  // output columns of one vector of sums
static_assert(kGroup == 16, "a group's sums are one 512-bit vector of float32");

struct Shape {
  int64_t M, K, N;
  int64_t group_stride;  // elements from one group of 16 columns to the next: K * 16
};

// Where a tile's sums go, rounded to bfloat16: into `out` (rows `stride` apart), or, where
// `gate` is given, as the up projection's products of a gated MLP: out = silu(gate) * up,
// `gate` holding the gate's rounded products of the same rows and columns (rows
// `gate_stride` apart).
struct Output {
  uint16_t* out;
  int64_t stride;
  const uint16_t* gate = nullptr;
  int64_t gate_stride = 0;

  Output from_row(int64_t row) const {
    return {out + row * stride, stride, gate == nullptr ? nullptr : gate + row * gate_stride,
            gate_stride};
  }
};

#ifdef RADIXLM_PAIR_MATMUL

// Work below this many multiply-adds runs on the calling thread.
constexpr int64_t kParallelWork = 1 << 17;

inline __m512bh as_pairs(__m512i v) { return (__m512bh)v; }

inline __m512bh broadcast_pair(const uint16_t* p) {
  int32_t pair;
  std::memcpy(&pair, p, sizeof(pair));
  return as_pairs(_mm512_set1_epi32(pair));
}

// How a tile reads a vector of 16 columns' pairs: bfloat16 as stored, or int8 widened to
// bfloat16 (exact: every int8 fits bfloat16's 8 significant bits), whose columns' scales
// then multiply the sums.
struct BFloat16Pairs {
  using Weight = uint16_t;
  static __m512bh load(const uint16_t* p) { return as_pairs(_mm512_loadu_si512(p)); }
};

struct Int8Pairs {
  using Weight = int8_t;
  static __m512bh load(const int8_t* p) {
    const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    const __m512 low = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(bytes)));
    const __m512 high =
        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(bytes, 1)));
    return _mm512_cvtne2ps_pbh(high, low);
  }
};

// silu(gate) * up for 16 columns: both rounded to bfloat16 as stored (the up products by
// the tile, the gate's by the tile before), the SiLU rounded as F.silu's output is, the
// product rounded once: what fused_ops.cpp's silu_mul computes from the two products, bit
// for bit (the same exp, the same division, ATen's rounding).
__attribute__((noinline)) __m256i silu_times(__m256bh up_rounded, const uint16_t* gate) {
  using Vec = at::vec::Vectorized<float>;
  __m512 up, g;
  at::vec::cvtbf16_fp32((__m256i)up_rounded, up);
  at::vec::cvtbf16_fp32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(gate)), g);
  const Vec gate_vec(g);
  __m512 silu = gate_vec / (Vec(1.f) + gate_vec.neg().exp_u20());
  at::vec::cvtbf16_fp32(at::vec::cvtfp32_bf16(silu), silu);
  return at::vec::cvtfp32_bf16(_mm512_mul_ps(silu, up));
}

// Rows [0, R) of x against groups [0, C) from w into o, the sums of group c multiplied by
// scales[c * 16, c * 16 + 16) where scales is given; `Gated`: o has a gate (silu_times, a
// call made only from these instances, so the plain tiles' code is what it was without
// it; inlined into every tile, an engine's batch-1 decode read 88 against 97 tok/s, within
// the host's noise but not worth the doubt). `ahead_lines` 64-byte lines from
// `ahead` (the next chunk's weights, or a share of them) are requested into L2 evenly as
// the pairs go.
template <class Pairs, int R, int C, bool Gated>
inline void tile(const uint16_t* x, const typename Pairs::Weight* w, const float* scales,
                 const Output& o, const Shape& s, const char* ahead, int64_t ahead_lines) {
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  const int64_t pairs = s.K / 2;
  const auto walk = [&](auto ask) RADIXLM_INLINE {  // the sums, ask(p) at each pair p
    for (int64_t p = 0; p < pairs; ++p) {
      __m512bh wv[C];
      for (int c = 0; c < C; ++c) wv[c] = Pairs::load(w + c * s.group_stride + p * 2 * kGroup);
      ask(p);
      for (int r = 0; r < R; ++r) {
        const __m512bh xv = broadcast_pair(x + r * s.K + 2 * p);
        for (int c = 0; c < C; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], xv, wv[c]);
      }
    }
  };
  constexpr int64_t kVectorBytes = 2 * kGroup * sizeof(typename Pairs::Weight);
  if (ahead_lines == 0) {
    walk([](int64_t) RADIXLM_INLINE {});
  } else if (ahead_lines == C * pairs * kVectorBytes / 64) {  // C lines each 64 bytes
    walk([&](int64_t p) RADIXLM_INLINE {
      if ((p * kVectorBytes) % 64 == 0) {
        const char* lines = ahead + p * kVectorBytes * C;
        for (int c = 0; c < C; ++c) _mm_prefetch(lines + c * 64, _MM_HINT_T1);
      }
    });
  } else {  // ahead_lines / pairs lines a pair; `owed` counts in 1 / pairs of a line
    int64_t owed = 0;
    walk([&](int64_t) RADIXLM_INLINE {
      for (owed += ahead_lines; owed >= pairs; owed -= pairs, ahead += 64) {
        _mm_prefetch(ahead, _MM_HINT_T1);
      }
    });
  }
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < C; ++c) {
      __m512 sums = acc[r][c];
      if (scales != nullptr) sums = _mm512_mul_ps(sums, _mm512_loadu_ps(scales + c * kGroup));
      const __m256bh rounded = _mm512_cvtneps_pbh(sums);
      auto* to = reinterpret_cast<__m256i*>(o.out + r * o.stride + c * kGroup);
      if constexpr (Gated) {
        _mm256_storeu_si256(to, silu_times(rounded, o.gate + r * o.gate_stride + c * kGroup));
      } else {
        _mm256_storeu_si256(to, (__m256i)rounded);
      }
    }
  }
}

// All M rows against the C groups at w (output columns from o's), tiles of 8, 4, 2, 1 rows.
// int8 groups that more than one tile reads are widened once, into the thread's buffer, and
// the tiles read that: the same bfloat16 values in the same order, so the same sums.
template <class Pairs, int C, bool Gated>
void chunk(const uint16_t* x, const typename Pairs::Weight* w, const float* scales,
           const Output& o, const Shape& s, const char* ahead, int64_t lines) {
  if constexpr (std::is_same_v<Pairs, Int8Pairs>) {
    if (s.M > 8) {
      thread_local std::vector<uint16_t> widened;
      const int64_t elements = C * s.group_stride;
      widened.resize(elements);
      for (int64_t i = 0; i < elements; i += 2 * kGroup) {
        _mm512_storeu_si512(widened.data() + i, (__m512i)Int8Pairs::load(w + i));
      }
      return chunk<BFloat16Pairs, C, Gated>(x, widened.data(), scales, o, s, ahead, lines);
    }
  }
  // The first `askers` tiles (two, or the one) ask for the next chunk's lines, a run each.
  const int64_t askers = std::min<int64_t>(2, s.M / 8 + __builtin_popcountll(s.M % 8));
  int64_t m = 0, t = 0;
  const auto share = [&](int64_t tile) {  // tile's run: its first line and count
    const int64_t first = tile < askers ? tile * lines / askers : 0;
    const int64_t end = tile < askers ? (tile + 1) * lines / askers : 0;
    return std::pair{ahead + first * 64, end - first};
  };
  for (; m + 8 <= s.M; m += 8, ++t) {
    const auto [from, count] = share(t);
    tile<Pairs, 8, C, Gated>(x + m * s.K, w, scales, o.from_row(m), s, from, count);
  }
  for (int rows = 4; rows > 0; rows /= 2) {  // the rest: a tile of 4, 2, 1 rows each
    if ((s.M - m) & rows) {
      const auto [from, count] = share(t);
      const Output rest = o.from_row(m);
      if (rows == 4) tile<Pairs, 4, C, Gated>(x + m * s.K, w, scales, rest, s, from, count);
      if (rows == 2) tile<Pairs, 2, C, Gated>(x + m * s.K, w, scales, rest, s, from, count);
      if (rows == 1) tile<Pairs, 1, C, Gated>(x + m * s.K, w, scales, rest, s, from, count);
      m += rows, ++t;
    }
  }
}

// The last chunk of a thread's share may have fewer groups than the others.
template <class Pairs, int C, bool Gated>
void chunk_of(int64_t groups, const uint16_t* x, const typename Pairs::Weight* w,
              const float* scales, const Output& o, const Shape& s, const char* ahead,
              int64_t lines) {
  if constexpr (C > 1) {
    if (groups < C) {
      return chunk_of<Pairs, C - 1, Gated>(groups, x, w, scales, o, s, ahead, lines);
    }
  }
  chunk<Pairs, C, Gated>(x, w, scales, o, s, ahead, lines);
}

// C groups a chunk: 3 where tiles of 8 rows are walked (24 sums, 3 weight vectors and a
// broadcast row: 28 registers), else 4 (4 rows by 4 groups; one row reads 4 weight streams).
template <class Pairs, int C>
void matmul(const uint16_t* x, const typename Pairs::Weight* w, const float* scales,
            uint16_t* out, const Shape& s) {
  const int64_t groups = s.N / kGroup;
  const int64_t chunks = (groups + C - 1) / C;
  const int64_t work = std::max<int64_t>(1, s.M * s.K * C * kGroup);
  at::parallel_for(0, chunks, std::max<int64_t>(1, kParallelWork / work),
                   [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t g = t * C;
      const auto* weights = w + g * s.group_stride;
      // The next chunk's weights, as 64-byte lines (none after the thread's last chunk).
      const int64_t next_groups = t + 1 < end ? std::min<int64_t>(C, groups - g - C) : 0;
      const auto* ahead = reinterpret_cast<const char*>(weights + C * s.group_stride);
      const int64_t lines = next_groups * s.group_stride * sizeof(*w) / 64;
      chunk_of<Pairs, C, false>(std::min<int64_t>(C, groups - g), x, weights,
                         scales == nullptr ? nullptr : scales + g * kGroup,
                         Output{out + g * kGroup, s.N}, s, ahead, lines);
    }
  });
}

// A gated MLP's silu(x @ gate.T) * (x @ up.T) for w stacking the gate's groups over the
// up's (N = 2 I): a thread takes the gate's chunk of C groups into its own rows (M by 16 C,
// within L2), then the up's chunk of the same columns, whose tiles end in silu_times into
// out (M, I). The products are those of matmul: the same tiles, the same sums.
template <class Pairs, int C>
void gated_matmul(const uint16_t* x, const typename Pairs::Weight* w, const float* scales,
                  uint16_t* out, const Shape& s) {
  const int64_t half = s.N / kGroup / 2;  // groups of the gate, and of the up
  const int64_t chunks = (half + C - 1) / C;
  const int64_t work = std::max<int64_t>(1, 2 * s.M * s.K * C * kGroup);
  const int64_t bytes = s.group_stride * sizeof(*w);  // of one group's weights
  at::parallel_for(0, chunks, std::max<int64_t>(1, kParallelWork / work),
                   [&](int64_t begin, int64_t end) {
    thread_local std::vector<uint16_t> gate_rows;
    gate_rows.resize(s.M * C * kGroup);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t g = t * C, count = std::min<int64_t>(C, half - g);
      const auto* gate_w = w + g * s.group_stride;
      const auto* up_w = w + (half + g) * s.group_stride;
      const int64_t next = t + 1 < end ? std::min<int64_t>(C, half - g - C) : 0;
      const auto* next_w = reinterpret_cast<const char*>(gate_w + C * s.group_stride);
      chunk_of<Pairs, C, false>(count, x, gate_w, scales == nullptr ? nullptr : scales + g * kGroup,
                         Output{gate_rows.data(), C * kGroup}, s,
                         reinterpret_cast<const char*>(up_w), count * bytes / 64);
      chunk_of<Pairs, C, true>(count, x, up_w,
                         scales == nullptr ? nullptr : scales + (half + g) * kGroup,
                         Output{out + g * kGroup, half * kGroup, gate_rows.data(), C * kGroup},
                         s, next_w, next * bytes / 64);
    }
  });
}

template <class Pairs>
void matmul_rows(const uint16_t* x, const typename Pairs::Weight* w, const float* scales,
                 uint16_t* out, const Shape& s, bool gated) {
  if (s.M >= 8) {
    if (gated) return gated_matmul<Pairs, 3>(x, w, scales, out, s);
    matmul<Pairs, 3>(x, w, scales, out, s);
  } else {
    if (gated) return gated_matmul<Pairs, 4>(x, w, scales, out, s);
    matmul<Pairs, 4>(x, w, scales, out, s);
  }
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

namespace radixlm_pairs {

// x (M, K) bfloat16 against pairs (N / 16, K / 2, 16, 2), bfloat16 or int8 with scales (N,)
// float32 (weight ~= int8 * scale, output column by column; `scales` undefined for
// bfloat16): (M, N) bfloat16, or `gated`, silu(the first N / 2 columns) * the others, (M,
// N / 2). Checks the arguments.
at::Tensor product(const at::Tensor& x, const at::Tensor& pairs, const at::Tensor& scales,
                   bool gated) {
  TORCH_CHECK(pair_matmul_available(), "the pair kernels need a build with AVX-512 BF16");
  TORCH_CHECK(x.device().is_cpu() && pairs.device().is_cpu(), "CPU tensors expected");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "x must be bfloat16");
  const bool int8 = scales.defined();
  TORCH_CHECK(pairs.scalar_type() == (int8 ? at::kChar : at::kBFloat16), "pairs must be ",
              int8 ? at::kChar : at::kBFloat16);
  TORCH_CHECK(pairs.dim() == 4 && pairs.size(2) == kGroup && pairs.size(3) == 2 &&
                  pairs.is_contiguous(),
              "pairs must be a contiguous (N / 16, K / 2, 16, 2)");
  TORCH_CHECK(x.dim() == 2 && x.size(1) == 2 * pairs.size(1),
              "x must be (M, K) for pairs (N / 16, K / 2, 16, 2)");
  TORCH_CHECK(!gated || pairs.size(0) % 2 == 0,
              "gated pairs must stack gate and up of 16 I columns each (N / 16 even)");
  const at::Tensor a = x.contiguous();
  const int64_t M = a.size(0), K = a.size(1), N = pairs.size(0) * kGroup;
  if (int8) {
    TORCH_CHECK(scales.device().is_cpu() && scales.scalar_type() == at::kFloat &&
                    scales.dim() == 1 && scales.size(0) == N && scales.is_contiguous(),
                "scales must be a contiguous (N,) float32");
  }
  at::Tensor out = at::empty({M, gated ? N / 2 : N}, a.options());
  if (M == 0 || N == 0) return out;
#ifdef RADIXLM_PAIR_MATMUL
  const auto* rows = reinterpret_cast<const uint16_t*>(a.data_ptr<at::BFloat16>());
  auto* to = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const Shape shape{M, K, N, K * kGroup};
  if (int8) {
    matmul_rows<Int8Pairs>(rows, pairs.data_ptr<int8_t>(), scales.data_ptr<float>(), to, shape,
                           gated);
  } else {
    matmul_rows<BFloat16Pairs>(
        rows, reinterpret_cast<const uint16_t*>(pairs.data_ptr<at::BFloat16>()), nullptr, to,
        shape, gated);
  }
#endif
  return out;
}

}  // namespace radixlm_pairs

at::Tensor pair_matmul(const at::Tensor& x, const at::Tensor& pairs) {
  return radixlm_pairs::product(x, pairs, at::Tensor(), false);
}

// pair_matmul_silu(x, pairs) = silu_mul(pair_matmul(x, pairs)) bit for bit, for pairs that
// stack a gated MLP's gate over its up: (M, N / 2), without the (M, N) products.
at::Tensor pair_matmul_silu(const at::Tensor& x, const at::Tensor& pairs) {
  return radixlm_pairs::product(x, pairs, at::Tensor(), true);
}

// int8_pair_matmul: x (M, K) bfloat16 against an int8 weight by pairs with scales (N,)
// float32 (weight ~= int8 * scale, output column by column): (M, N) bfloat16.
at::Tensor int8_pair_matmul(const at::Tensor& x, const at::Tensor& pairs,
                            const at::Tensor& scales) {
  return radixlm_pairs::product(x, pairs, scales, false);
}

// int8_pair_matmul_silu: silu_mul(int8_pair_matmul(x, pairs, scales)) bit for bit.
at::Tensor int8_pair_matmul_silu(const at::Tensor& x, const at::Tensor& pairs,
                                 const at::Tensor& scales) {
  return radixlm_pairs::product(x, pairs, scales, true);
}
