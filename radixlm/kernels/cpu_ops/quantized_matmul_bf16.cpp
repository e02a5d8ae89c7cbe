// quantized_matmul's passes of a few bfloat16 rows (up to kMaxRows; 1 for Q4_0 to Q5_1) on
// AVX-512 BF16 dot products (see quantized_matmul.cpp, which hands them here where
// quantized_bf16_dots_serve says so).
//
// Each block's quantized integers are decoded exactly, before any scale, and converted to
// bfloat16 (exact for these small integers: a table lookup, vpermw, for the 4-, 5- and 6-bit
// ones; Q8_0's and Q8_K's 8-bit ones are widened to float32 instead, with x once a call: their
// products are as exact, and the conversion to bfloat16 would cost more than it saves). One
// dot-product instruction (vdpbf16ps: products of two bfloat16 are exact in float32) sums 32
// of them times x into 16 lanes, and the block's (or K sub-block's) scale multiplies it once:
//   symmetric types (Q4_0, Q5_0, Q8_0, Q6_K, Q8_K): out += d * sum(q x);
//   affine types (Q4_1, Q5_1, Q4_K, Q5_K): out += d * sc * sum(q x) + offset * sum(x),
// with the offset m (Q4_1, Q5_1) or -dmin * m (K types), and each 32 values' sum(x) of a row
// of x computed once per call, shared by every weight row. The results differ from the
// float32 lanes' (d * q decoded, then multiplied) only by float32 rounding of the sums.
// Threads split the output rows, R weight rows a tile, as the float32 path does; more than 4
// rows of x go 4 at a time over each tile while its blocks are in L1.

#include "common.h"
#include "kernels.h"
#include "gguf_blocks.h"
#include "matmul_lanes.h"

#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)

namespace radixlm_quant_bf16 {

using radixlm_matmul::kParallelWork;
using radixlm_matmul::kPrefetchBytes;
using radixlm_quant::float_at;
using radixlm_quant::half_at;

constexpr int64_t kMaxRows = 32;  // (the row limits that pay are gguf_weight.py's)

// The float16 at p (a block's scale) in all 16 lanes: broadcast as float16 and widened in
// vector registers (the scalar conversion and broadcast took more of the shuffle port that
// the blocks' decoding needs: benchmarks/RESULTS.md).
inline __m512 broadcast_half(const uint8_t* p) {
  int16_t bits;
  std::memcpy(&bits, p, 2);
  return _mm512_cvtph_ps(_mm256_set1_epi16(bits));
}

// bfloat16 lookup tables of the integers a type's indices stand for (vpermw reads an index's
// low 5 bits; vpermt2w its low 6 from two tables).
struct Tables {
  __m512i low = _mm512_setzero_si512(), high = _mm512_setzero_si512();
};

// The bfloat16 values first + (i % period) for the 32 indices i.
inline __m512i value_table(int first, int period) {
  alignas(64) float v[32];
  for (int i = 0; i < 32; ++i) v[i] = static_cast<float>(first + i % period);
  return reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(_mm512_load_ps(v + 16), _mm512_load_ps(v)));
}

inline __m512bh lookup(__m512i words, __m512i table) {
  return reinterpret_cast<__m512bh>(_mm512_permutexvar_epi16(words, table));
}

// 16 bytes p[0..15]: their low nibbles in words 0..15, high nibbles in words 16..31 (the low
// words keep the whole byte: a table of period 16 reads only the nibble).
inline __m512i nibble_words(const uint8_t* p) {
  const __m512i w = _mm512_cvtepu8_epi16(
      _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  return _mm512_mask_srli_epi16(w, 0xFFFF0000u, w, 4);
}

// Q5_0's and Q5_1's 32 five-bit indices: nibbles, bit 4 of index i bit i of qh (added
// where set: the nibble's bit 4 is clear).
inline __m512i five_bit_words(const uint8_t* qh_bytes, const uint8_t* qs) {
  uint32_t qh;
  std::memcpy(&qh, qh_bytes, 4);
  const __m512i low = _mm512_and_si512(nibble_words(qs), _mm512_set1_epi16(15));
  return _mm512_mask_add_epi16(low, qh, low, _mm512_set1_epi16(16));
}

// 32 signed bytes times 32 values of x widened to float32 (xf), 16 float32 sums: 8-bit
// integers cost more to convert to bfloat16 than to float32, where their products with
// bfloat16 x are as exact.
inline __m512 int8_dot(const uint8_t* p, const float* xf) {
  const auto ints = [&](int at) {
    return _mm512_cvtepi32_ps(
        _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + at))));
  };
  return _mm512_fmadd_ps(ints(16), _mm512_loadu_ps(xf + 16),
                         _mm512_mul_ps(ints(0), _mm512_loadu_ps(xf)));
}

// A type: kValues and kBytes a block, kAffine, tables(), and block(b, tables, offsets, fn),
// which calls fn(first, dot, scale) for each 32 values from `first` (dot(x, xf) their
// integers' dot products with those 32 values of x, bfloat16 at x or widened at xf, 16 float32
// sums; scale the lanes those sums are multiplied by) and, for an affine type, writes each 32
// values' offset to offsets. (Q8_0 and Q8_K read xf, the others x.)
inline auto dot_with(__m512bh q) {
  return [q](const at::BFloat16* x, const float*) {
    return _mm512_dpbf16_ps(_mm512_setzero_ps(), q,
                            reinterpret_cast<__m512bh>(_mm512_loadu_si512(x)));
  };
}

struct Q4_0 {
  static constexpr int64_t kValues = 32, kBytes = 18;
  static constexpr bool kAffine = false;
  static Tables tables() { return Tables{value_table(-8, 16)}; }
  template <typename Fn>
  static void block(const uint8_t* b, const Tables& t, float*, Fn&& fn) {
    fn(0, dot_with(lookup(nibble_words(b + 2), t.low)), broadcast_half(b));
  }
};

struct Q4_1 {
  static constexpr int64_t kValues = 32, kBytes = 20;
  static constexpr bool kAffine = true;
  static Tables tables() { return Tables{value_table(0, 16)}; }
  template <typename Fn>
  static void block(const uint8_t* b, const Tables& t, float* offsets, Fn&& fn) {
    offsets[0] = half_at(b + 2);
    fn(0, dot_with(lookup(nibble_words(b + 4), t.low)), broadcast_half(b));
  }
};

struct Q5_0 {
  static constexpr int64_t kValues = 32, kBytes = 22;
  static constexpr bool kAffine = false;
  static Tables tables() { return Tables{value_table(-16, 32)}; }
  template <typename Fn>
  static void block(const uint8_t* b, const Tables& t, float*, Fn&& fn) {
    fn(0, dot_with(lookup(five_bit_words(b + 2, b + 6), t.low)), broadcast_half(b));
  }
};

struct Q5_1 {
  static constexpr int64_t kValues = 32, kBytes = 24;
  static constexpr bool kAffine = true;
  static Tables tables() { return Tables{value_table(0, 32)}; }
  template <typename Fn>
  static void block(const uint8_t* b, const Tables& t, float* offsets, Fn&& fn) {
    offsets[0] = half_at(b + 2);
    fn(0, dot_with(lookup(five_bit_words(b + 4, b + 8), t.low)), broadcast_half(b));
  }
};

struct Q8_0 {
  static constexpr int64_t kValues = 32, kBytes = 34;
  static constexpr bool kAffine = false;
  static Tables tables() { return Tables{}; }
  template <typename Fn>
  static void block(const uint8_t* b, const Tables&, float*, Fn&& fn) {
    fn(0, [&](const at::BFloat16*, const float* xf) { return int8_dot(b + 2, xf); },
       broadcast_half(b));
  }
};

// Q4_K's and Q5_K's sub-block scales d * sc (as one vector, sub-block j in lane j) and
// offsets -dmin * m, from the 12 bytes of 6-bit sc and m (their unpacking as llama.cpp's).
inline __m256 k_scales(const uint8_t* b, float* offsets) {
  uint32_t u[4];
  std::memcpy(u, b + 4, 12);
  constexpr uint32_t kLow6 = 0x3f3f3f3f, kLow4 = 0x0f0f0f0f, kLow2 = 0x03030303;
  u[3] = ((u[2] >> 4) & kLow4) | (((u[1] >> 6) & kLow2) << 4);
  const uint32_t mins = u[1] & kLow6;
  u[1] = (u[2] & kLow4) | (((u[0] >> 6) & kLow2) << 4);
  u[2] = mins;
  u[0] &= kLow6;  // u[0..1]: the 8 sc, u[2..3]: the 8 m
  const auto widen = [&](int at) {
    return _mm256_cvtepi32_ps(
        _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(u + at))));
  };
  _mm256_store_ps(offsets, _mm256_mul_ps(_mm256_set1_ps(-half_at(b + 2)), widen(2)));
  return _mm256_mul_ps(_mm256_set1_ps(half_at(b)), widen(0));
}


struct Q4_K {
  static constexpr int64_t kValues = 256, kBytes = 144;
  static constexpr bool kAffine = true;
  static Tables tables() { return Tables{value_table(0, 16)}; }
  template <typename Fn>
  static void block(const uint8_t* b, const Tables& t, float* offsets, Fn&& fn) {
    alignas(32) float scale[8];
    _mm256_store_ps(scale, k_scales(b, offsets));
    for (int p = 0; p < 4; ++p) {  // sub-blocks 2p (low nibbles) and 2p + 1 (high)
      const __m512i w = _mm512_cvtepu8_epi16(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16 + 32 * p)));
      fn(64 * p, dot_with(lookup(w, t.low)), _mm512_set1_ps(scale[2 * p]));
      fn(64 * p + 32, dot_with(lookup(_mm512_srli_epi16(w, 4), t.low)), _mm512_set1_ps(scale[2 * p + 1]));
    }
  }
};

struct Q5_K {
  static constexpr int64_t kValues = 256, kBytes = 176;
  static constexpr bool kAffine = true;
  static Tables tables() { return Tables{value_table(0, 32)}; }
  template <typename Fn>
  static void block(const uint8_t* b, const Tables& t, float* offsets, Fn&& fn) {
    alignas(32) float scale[8];
    _mm256_store_ps(scale, k_scales(b, offsets));
    const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16));
    const __m512i fifteen = _mm512_set1_epi16(15), sixteen = _mm512_set1_epi16(16);
    for (int p = 0; p < 4; ++p) {  // sub-block s takes bit s of qh[k] (qs at 48)
      const __m512i w = _mm512_cvtepu8_epi16(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 48 + 32 * p)));
      const __mmask32 low_bit = _mm256_test_epi8_mask(qh, _mm256_set1_epi8(1 << (2 * p)));
      const __mmask32 high_bit = _mm256_test_epi8_mask(qh, _mm256_set1_epi8(2 << (2 * p)));
      const __m512i low = _mm512_and_si512(w, fifteen);
      const __m512i high = _mm512_srli_epi16(w, 4);
      fn(64 * p, dot_with(lookup(_mm512_mask_add_epi16(low, low_bit, low, sixteen), t.low)),
         _mm512_set1_ps(scale[2 * p]));
      fn(64 * p + 32,
         dot_with(lookup(_mm512_mask_add_epi16(high, high_bit, high, sixteen), t.low)),
         _mm512_set1_ps(scale[2 * p + 1]));
    }
  }
};

struct Q6_K {
  static constexpr int64_t kValues = 256, kBytes = 210;
  static constexpr bool kAffine = false;
  static Tables tables() { return Tables{value_table(-32, 32), value_table(0, 32)}; }
  template <typename Fn>
  static void block(const uint8_t* b, const Tables& t, float*, Fn&& fn) {
    const __m512 scales = _mm512_mul_ps(
        broadcast_half(b + 208),
        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192)))));
    const __m256i nibble = _mm256_set1_epi8(15), two_bits = _mm256_set1_epi8(0x30);
    const __m512i halves = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    const auto put = [&](int first, __m256i index, int s) {
      const __m512bh q = reinterpret_cast<__m512bh>(
          _mm512_permutex2var_epi16(t.low, _mm512_cvtepu8_epi16(index), t.high));
      // lanes 0-7 sum values 0-15 (sub-block s), lanes 8-15 values 16-31 (s + 1)
      fn(first, dot_with(q),
         _mm512_permutexvar_ps(_mm512_add_epi32(halves, _mm512_set1_epi32(s)), scales));
    };
    for (int h = 0; h < 2; ++h) {  // halves of 128: four runs of 32 from 64 + 32 bytes
      const auto load = [&](int at) {
        return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + at));
      };
      const __m256i l0 = load(64 * h), l1 = load(64 * h + 32), hi = load(128 + 32 * h);
      const auto index = [&](__m256i low4, __m256i high2) {
        return _mm256_or_si256(_mm256_and_si256(low4, nibble), _mm256_and_si256(high2, two_bits));
      };
      put(128 * h, index(l0, _mm256_slli_epi16(hi, 4)), 8 * h);
      put(128 * h + 32, index(l1, _mm256_slli_epi16(hi, 2)), 8 * h + 2);
      put(128 * h + 64, index(_mm256_srli_epi16(l0, 4), hi), 8 * h + 4);
      put(128 * h + 96, index(_mm256_srli_epi16(l1, 4), _mm256_srli_epi16(hi, 2)), 8 * h + 6);
    }
  }
};

struct Q8_K {
  static constexpr int64_t kValues = 256, kBytes = 292;
  static constexpr bool kAffine = false;
  static Tables tables() { return Tables{}; }
  template <typename Fn>
  static void block(const uint8_t* b, const Tables&, float*, Fn&& fn) {
    const __m512 d = _mm512_set1_ps(float_at(b));
    for (int k = 0; k < 256; k += 32) {
      fn(k, [&](const at::BFloat16*, const float* xf) { return int8_dot(b + 4 + k, xf); }, d);
    }
  }
};

// Rows [0, MB) of x (widened at xf for Q8_0 and Q8_K; their sums of each 32 values in xsum,
// K / 32 a row, for an affine one) against weight rows [0, R) into out[m * ld + r].
template <typename F, int R, int MB>
inline void tile(const at::BFloat16* x, const float* xf, const float* xsum, int64_t K,
                 const uint8_t* w,
                 int64_t row_bytes, const Tables& t, at::BFloat16* out, int64_t ld) {
  constexpr int kSums = F::kValues / 32;
  __m512 acc[MB][R];
  float offset_acc[MB][R];
  for (int m = 0; m < MB; ++m) {
    for (int r = 0; r < R; ++r) {
      acc[m][r] = _mm512_setzero_ps();
      offset_acc[m][r] = 0.f;
    }
  }
  const int64_t blocks = K / F::kValues;
  for (int64_t i = 0; i < blocks; ++i) {
    const at::BFloat16* xb = x + i * F::kValues;
    const float* xfb = xf + i * F::kValues;
    for (int r = 0; r < R; ++r) {
      const uint8_t* block = w + r * row_bytes + i * F::kBytes;
      for (int64_t j = 0; j < F::kBytes; j += 64) __builtin_prefetch(block + kPrefetchBytes + j, 0, 3);
      alignas(32) float offsets[kSums];
      F::block(block, t, offsets, [&](int first, auto&& dot, __m512 scale) {
        for (int m = 0; m < MB; ++m) {
          acc[m][r] = _mm512_fmadd_ps(dot(xb + m * K + first, xfb + m * K + first), scale,
                                      acc[m][r]);
        }
      });
      if constexpr (F::kAffine) {
        for (int m = 0; m < MB; ++m) {
          const float* xs = xsum + m * (K / 32) + i * kSums;
          if constexpr (kSums == 8) {
            acc[m][r] = _mm512_fmadd_ps(
                _mm512_insertf32x8(_mm512_setzero_ps(), _mm256_load_ps(offsets), 0),
                _mm512_insertf32x8(_mm512_setzero_ps(), _mm256_loadu_ps(xs), 0), acc[m][r]);
          } else {
            offset_acc[m][r] += offsets[0] * xs[0];
          }
        }
      }
    }
  }
  for (int m = 0; m < MB; ++m) {
    for (int r = 0; r < R; ++r) {
      out[m * ld + r] =
          static_cast<at::BFloat16>(_mm512_reduce_add_ps(acc[m][r]) + offset_acc[m][r]);
    }
  }
}

// Rows [0, M) of x against weight rows [0, R) into out[m * ld + r]: MB rows at a time while
// the tile's blocks stay in L1 (each group decodes them again), the last group smaller.
template <typename F, int R, int MB>
inline void row_groups(const at::BFloat16* x, const float* xf, const float* xsum, int64_t M,
                       int64_t K, const uint8_t* w, int64_t row_bytes, const Tables& t,
                       at::BFloat16* out, int64_t ld) {
  const auto group = [&](auto rows, int64_t m) {
    constexpr int kRows = decltype(rows)::value;
    tile<F, R, kRows>(x + m * K, xf + (xf != nullptr ? m * K : 0), xsum + m * (K / 32), K, w,
                      row_bytes, t, out + m * ld, ld);
  };
  int64_t m = 0;
  for (; m + MB <= M; m += MB) group(std::integral_constant<int, MB>(), m);
  switch (M - m) {
    case 3: return group(std::integral_constant<int, 3>(), m);
    case 2: return group(std::integral_constant<int, 2>(), m);
    case 1: return group(std::integral_constant<int, 1>(), m);
    default: return;
  }
}

// A weight's part: its blocks, rows and ggml type, and its first column of the output.
struct Part {
  const uint8_t* w;
  int64_t rows, type, first;
};

// fn(F{}) for the block type of ggml type `type`; false where there is none here.
template <typename Fn>
bool with_type(int64_t type, Fn&& fn) {
  switch (type) {
    case radixlm_quant::kQ4_0: fn(Q4_0{}); return true;
    case radixlm_quant::kQ4_1: fn(Q4_1{}); return true;
    case radixlm_quant::kQ5_0: fn(Q5_0{}); return true;
    case radixlm_quant::kQ5_1: fn(Q5_1{}); return true;
    case radixlm_quant::kQ8_0: fn(Q8_0{}); return true;
    case radixlm_quant::kQ4_K: fn(Q4_K{}); return true;
    case radixlm_quant::kQ5_K: fn(Q5_K{}); return true;
    case radixlm_quant::kQ6_K: fn(Q6_K{}); return true;
    case radixlm_quant::kQ8_K: fn(Q8_K{}); return true;
    default: return false;
  }
}

// out (M, sum of the parts' rows; rows ld apart) = x (M, K) @ W.T for W stacked from
// `parts`, in one parallel region: each part in tiles of R weight rows and then its rest row
// by row, all the parts' tiles split between the threads.
template <int R, int MB>
void run(const at::BFloat16* x, const float* xf, const float* xsum, int64_t M, int64_t K,
         const std::vector<Part>& parts, at::BFloat16* out, int64_t ld) {
  std::vector<int64_t> first_item{0};  // each part's first tile (then one past the last)
  for (const Part& part : parts) {
    first_item.push_back(first_item.back() + part.rows / R + part.rows % R);
  }
  const int64_t grain = std::max<int64_t>(1, kParallelWork / (R * K * M));
  at::parallel_for(0, first_item.back(), grain, [&](int64_t begin, int64_t end) {
    size_t p = 0;
    Tables t;
    int64_t tables_of = -1;  // the type t holds the tables of
    for (int64_t i = begin; i < end; ++i) {
      while (i >= first_item[p + 1]) ++p;
      const Part& part = parts[p];
      const int64_t local = i - first_item[p], tiles = part.rows / R;
      with_type(part.type, [&](auto format) {
        using F = decltype(format);
        if (tables_of != part.type) t = F::tables(), tables_of = part.type;
        const int64_t row_bytes = K / F::kValues * F::kBytes;
        if (local < tiles) {
          row_groups<F, R, MB>(x, xf, xsum, M, K, part.w + local * R * row_bytes, row_bytes, t,
                               out + part.first + local * R, ld);
        } else {
          const int64_t n = tiles * R + local - tiles;
          row_groups<F, 1, MB>(x, xf, xsum, M, K, part.w + n * row_bytes, row_bytes, t,
                               out + part.first + n, ld);
        }
      });
    }
  });
}

// Each 32 values' sum of x's M rows (M * K / 32 of them), in float32.
std::vector<float> sums_of_32(const at::BFloat16* x, int64_t M, int64_t K) {
  std::vector<float> sums(M * K / 32);
  for (int64_t i = 0; i < M * K / 32; ++i) {
    const __m512i v = _mm512_loadu_si512(x + 32 * i);
    const auto widen = [](__m256i half) {
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
    };
    sums[i] = _mm512_reduce_add_ps(_mm512_add_ps(widen(_mm512_castsi512_si256(v)),
                                                 widen(_mm512_extracti64x4_epi64(v, 1))));
  }
  return sums;
}

void matmul(const at::BFloat16* x, int64_t M, int64_t K, const std::vector<Part>& parts,
            at::BFloat16* out, int64_t ld) {
  bool affine = false, wide_x = false;
  for (const Part& part : parts) {
    with_type(part.type, [&](auto format) {
      using F = decltype(format);
      affine |= F::kAffine;
      wide_x |= std::is_same_v<F, Q8_0> || std::is_same_v<F, Q8_K>;
    });
  }
  const std::vector<float> xsum = affine ? sums_of_32(x, M, K) : std::vector<float>();
  std::vector<float> wide(wide_x ? M * K : 0);
  if (wide_x) at::vec::convert(x, wide.data(), M * K);
  const float *s = xsum.data(), *xf = wide_x ? wide.data() : nullptr;
  // One row: 8 weight rows a tile (8 streams of weights); more: 4 by 4 rows of x.
  if (M == 1) return run<8, 1>(x, xf, s, M, K, parts, out, ld);
  return run<4, 4>(x, xf, s, M, K, parts, out, ld);
}

}  // namespace radixlm_quant_bf16

#endif

// Which passes the dot products take: bfloat16 x of 1 to kMaxRows rows, on a build with
// AVX-512 BF16; for the 32-value types of 4 and 5 bits (Q4_0 to Q5_1), one row only (over
// more rows, one scale a row per 32 values costs as many multiply-adds as the float32 lanes'
// decoding saves; from 8 rows on the two timed the same, benchmarks/RESULTS.md).
bool quantized_bf16_dots_serve(const at::Tensor& x, int64_t type) {
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
  const bool nibbles = type == radixlm_quant::kQ4_0 || type == radixlm_quant::kQ4_1 ||
                       type == radixlm_quant::kQ5_0 || type == radixlm_quant::kQ5_1;
  return x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.size(0) >= 1 &&
         x.size(0) <= (nibbles ? 1 : radixlm_quant_bf16::kMaxRows);
#else
  (void)x, (void)type;
  return false;
#endif
}

bool quantized_matmul_bf16_dots(const at::Tensor& x, const std::vector<const uint8_t*>& parts,
                                const std::vector<int64_t>& rows,
                                const std::vector<int64_t>& types, at::BFloat16* out,
                                int64_t ld) {
  for (int64_t type : types) {
    if (!quantized_bf16_dots_serve(x, type)) return false;
  }
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
  namespace q = radixlm_quant_bf16;
  std::vector<q::Part> stacked;
  int64_t first = 0;
  for (size_t i = 0; i < parts.size(); ++i) {
    stacked.push_back(q::Part{parts[i], rows[i], types[i], first});
    first += rows[i];
  }
  q::matmul(x.data_ptr<at::BFloat16>(), x.size(0), x.size(1), stacked, out, ld);
  return true;
#else
  return false;
#endif
}
