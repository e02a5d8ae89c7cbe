// Products with GGUF block-quantized weights (see fused_ops.py; the layouts are llama.cpp's,
// decoded in torch by kernels/quantized/block_formats.py).
//
// quantized_matmul(x, blocks, type): out = x @ W.T for x (M, K) float32, bfloat16 or float16
// and W (N, K) stored as `blocks`, uint8 (N, row bytes), each row K / values blocks of the
// ggml type `type` (gguf.GGMLQuantizationType's number). The weights are decoded a chunk of
// a few rows at a time into a small float32 scratch that stays in L1 and multiplied from
// there against every row of x, so each weight is decoded once a pass, whatever M is; sums
// in float32, each output rounded once to x's type. Threads split the output rows.
//
// dequantize_blocks(blocks, type, out): W decoded into out (N, K), float32 or bfloat16 (the
// reused buffer a long pass multiplies with torch's GEMM).
//
// A decoded float32 weight equals block_formats.dequantize_rows's (the same products in the
// same order, under the build's ISO C++ mode, which contracts no multiply-add); the
// products' sums are ordered otherwise than a GEMM's, so they agree to float32 rounding.

#include "common.h"
#include "kernels.h"
#include "matmul_lanes.h"

namespace radixlm_quant {

using radixlm_matmul::kParallelWork;
using radixlm_matmul::kWidth;
using radixlm_matmul::Lanes;
using radixlm_matmul::load_activations;

// ggml_type's numbers for the served types (the GGUF format's, as gguf.GGMLQuantizationType).
enum GgmlType : int64_t {
  kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8,
  kQ4_K = 12, kQ5_K = 13, kQ6_K = 14, kQ8_K = 15,
};

// Values of x decoded a chunk of weight rows at a time: a multiple of every block's values,
// 8 rows of it (the widest tile) 16 KiB of float32, within L1.
constexpr int64_t kChunk = 512;
static_assert(kChunk % 256 == 0 && kChunk % kWidth == 0, "a chunk holds whole blocks");

inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

inline float float_at(const uint8_t* p) {
  float value;
  std::memcpy(&value, p, 4);
  return value;
}

// One block type: its values and bytes a block, and decode(block, out) writing its values.
struct Q4_0 {
  static constexpr int64_t kValues = 32, kBytes = 18;
  static void decode(const uint8_t* b, float* out) {
    const float d = half_at(b);
    const uint8_t* qs = b + 2;
    for (int k = 0; k < 16; ++k) {
      out[k] = d * static_cast<float>((qs[k] & 15) - 8);
      out[k + 16] = d * static_cast<float>((qs[k] >> 4) - 8);
    }
  }
};

struct Q4_1 {
  static constexpr int64_t kValues = 32, kBytes = 20;
  static void decode(const uint8_t* b, float* out) {
    const float d = half_at(b), m = half_at(b + 2);
    const uint8_t* qs = b + 4;
    for (int k = 0; k < 16; ++k) {
      out[k] = d * static_cast<float>(qs[k] & 15) + m;
      out[k + 16] = d * static_cast<float>(qs[k] >> 4) + m;
    }
  }
};

// Q5_0's and Q5_1's 5-bit values: low nibbles, the fifth bit of value i bit i of qh.
inline void five_bits(const uint8_t* qh_bytes, const uint8_t* qs, int32_t* q) {
  uint32_t qh;
  std::memcpy(&qh, qh_bytes, 4);
  for (int k = 0; k < 16; ++k) {
    q[k] = (qs[k] & 15) | (((qh >> k) & 1) << 4);
    q[k + 16] = (qs[k] >> 4) | (((qh >> (k + 16)) & 1) << 4);
  }
}

struct Q5_0 {
  static constexpr int64_t kValues = 32, kBytes = 22;
  static void decode(const uint8_t* b, float* out) {
    const float d = half_at(b);
    int32_t q[32];
    five_bits(b + 2, b + 6, q);
    for (int k = 0; k < 32; ++k) out[k] = d * static_cast<float>(q[k] - 16);
  }
};

struct Q5_1 {
  static constexpr int64_t kValues = 32, kBytes = 24;
  static void decode(const uint8_t* b, float* out) {
    const float d = half_at(b), m = half_at(b + 2);
    int32_t q[32];
    five_bits(b + 4, b + 8, q);
    for (int k = 0; k < 32; ++k) out[k] = d * static_cast<float>(q[k]) + m;
  }
};

struct Q8_0 {
  static constexpr int64_t kValues = 32, kBytes = 34;
  static void decode(const uint8_t* b, float* out) {
    const float d = half_at(b);
    const int8_t* qs = reinterpret_cast<const int8_t*>(b + 2);
    for (int k = 0; k < 32; ++k) out[k] = static_cast<float>(qs[k]) * d;
  }
};

// Q4_K's and Q5_K's 12 bytes of 6-bit sub-block scales and minimums: (d * scale, dmin * min)
// for each of the 8 sub-blocks of 32.
inline void k_scales(const uint8_t* b, float* scale, float* offset) {
  const float d = half_at(b), dmin = half_at(b + 2);
  const uint8_t* s = b + 4;
  for (int j = 0; j < 8; ++j) {
    const int sc = j < 4 ? s[j] & 63 : (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
    const int m = j < 4 ? s[j + 4] & 63 : (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    scale[j] = d * static_cast<float>(sc);
    offset[j] = dmin * static_cast<float>(m);
  }
}

struct Q4_K {
  static constexpr int64_t kValues = 256, kBytes = 144;
  static void decode(const uint8_t* b, float* out) {
    float scale[8], offset[8];
    k_scales(b, scale, offset);
    const uint8_t* qs = b + 16;
    for (int p = 0; p < 4; ++p) {  // sub-blocks 2p (low nibbles) and 2p + 1 (high)
      for (int k = 0; k < 32; ++k) {
        const uint8_t byte = qs[32 * p + k];
        out[64 * p + k] = scale[2 * p] * static_cast<float>(byte & 15) - offset[2 * p];
        out[64 * p + 32 + k] =
            scale[2 * p + 1] * static_cast<float>(byte >> 4) - offset[2 * p + 1];
      }
    }
  }
};

struct Q5_K {
  static constexpr int64_t kValues = 256, kBytes = 176;
  static void decode(const uint8_t* b, float* out) {
    float scale[8], offset[8];
    k_scales(b, scale, offset);
    const uint8_t* qh = b + 16;  // sub-block s takes bit s of qh[k]
    const uint8_t* qs = b + 48;
    for (int p = 0; p < 4; ++p) {
      for (int k = 0; k < 32; ++k) {
        const uint8_t byte = qs[32 * p + k];
        const int low = (byte & 15) | (((qh[k] >> (2 * p)) & 1) << 4);
        const int high = (byte >> 4) | (((qh[k] >> (2 * p + 1)) & 1) << 4);
        out[64 * p + k] = scale[2 * p] * static_cast<float>(low) - offset[2 * p];
        out[64 * p + 32 + k] = scale[2 * p + 1] * static_cast<float>(high) - offset[2 * p + 1];
      }
    }
  }
};

struct Q6_K {
  static constexpr int64_t kValues = 256, kBytes = 210;
  static void decode(const uint8_t* b, float* out) {
    const uint8_t* ql = b;
    const uint8_t* qh = b + 128;
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
    const float d = half_at(b + 208);
    float scale[16];
    for (int j = 0; j < 16; ++j) scale[j] = d * static_cast<float>(sc[j]);
    for (int h = 0; h < 2; ++h) {  // halves of 128: four runs of 32 from 64 + 32 bytes
      const uint8_t* l = ql + 64 * h;
      const uint8_t* hi = qh + 32 * h;
      float* o = out + 128 * h;
      const float* s = scale + 8 * h;
      for (int k = 0; k < 32; ++k) {
        const int q0 = ((l[k] & 15) | ((hi[k] & 3) << 4)) - 32;
        const int q1 = ((l[k + 32] & 15) | (((hi[k] >> 2) & 3) << 4)) - 32;
        const int q2 = ((l[k] >> 4) | (((hi[k] >> 4) & 3) << 4)) - 32;
        const int q3 = ((l[k + 32] >> 4) | (((hi[k] >> 6) & 3) << 4)) - 32;
        const int sub = k / 16;
        o[k] = s[sub] * static_cast<float>(q0);
        o[k + 32] = s[sub + 2] * static_cast<float>(q1);
        o[k + 64] = s[sub + 4] * static_cast<float>(q2);
        o[k + 96] = s[sub + 6] * static_cast<float>(q3);
      }
    }
  }
};

struct Q8_K {
  static constexpr int64_t kValues = 256, kBytes = 292;
  static void decode(const uint8_t* b, float* out) {
    const float d = float_at(b);
    const int8_t* qs = reinterpret_cast<const int8_t*>(b + 4);
    for (int k = 0; k < 256; ++k) out[k] = d * static_cast<float>(qs[k]);
  }
};

// Calls fn(Format{}) for the format of ggml type `type`.
template <typename Fn>
void dispatch_format(int64_t type, Fn&& fn) {
  switch (type) {
    case kQ4_0: return fn(Q4_0{});
    case kQ4_1: return fn(Q4_1{});
    case kQ5_0: return fn(Q5_0{});
    case kQ5_1: return fn(Q5_1{});
    case kQ8_0: return fn(Q8_0{});
    case kQ4_K: return fn(Q4_K{});
    case kQ5_K: return fn(Q5_K{});
    case kQ6_K: return fn(Q6_K{});
    case kQ8_K: return fn(Q8_K{});
    default: TORCH_CHECK(false, "ggml type ", type, " is not served in blocks");
  }
}

// Values [first, first + count) of a row (both multiples of F's values) into out; asks for
// the row's next chunk as it goes (a few rows are read side by side, more streams than the
// CPU's own prefetcher follows well).
template <typename F>
inline void decode_span(const uint8_t* row, int64_t first, int64_t count, float* out) {
  const uint8_t* b = row + first / F::kValues * F::kBytes;
  const int64_t blocks = count / F::kValues;
  const uint8_t* ahead = b + blocks * F::kBytes;
  for (int64_t j = 0; j < blocks * F::kBytes; j += 64) __builtin_prefetch(ahead + j, 0, 3);
  for (int64_t i = 0; i < blocks; ++i) F::decode(b + i * F::kBytes, out + i * F::kValues);
}

// a * b + c lane by lane, rounded once.
inline Lanes multiply_add(Lanes a, Lanes b, Lanes c) {
#if defined(CPU_CAPABILITY_AVX512)
  return reinterpret_cast<Lanes>(_mm512_fmadd_ps(reinterpret_cast<__m512>(a),
                                                 reinterpret_cast<__m512>(b),
                                                 reinterpret_cast<__m512>(c)));
#elif defined(CPU_CAPABILITY_AVX2)
  return reinterpret_cast<Lanes>(_mm256_fmadd_ps(reinterpret_cast<__m256>(a),
                                                 reinterpret_cast<__m256>(b),
                                                 reinterpret_cast<__m256>(c)));
#else
  for (int64_t i = 0; i < kWidth; ++i) c[i] = std::fma(a[i], b[i], c[i]);
  return c;
#endif
}

// acc[m][r] += x row m . scratch row r over `count` values, MB rows of x, R weight rows.
template <int R, int MB, typename X>
inline void accumulate(const X* x, int64_t x_stride, const float* scratch, int64_t count,
                       Lanes* acc) {
  Lanes a[MB][R];
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < R; ++r) a[m][r] = acc[m * R + r];
  for (int64_t k = 0; k < count; k += kWidth) {
    Lanes wide[R];
    for (int r = 0; r < R; ++r) std::memcpy(&wide[r], scratch + r * kChunk + k, sizeof(Lanes));
    for (int m = 0; m < MB; ++m) {
      const Lanes xv = load_activations(x + m * x_stride + k);
      for (int r = 0; r < R; ++r) a[m][r] = multiply_add(xv, wide[r], a[m][r]);
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < R; ++r) acc[m * R + r] = a[m][r];
}

// Rows [0, M) of x, 4 at a time, against the R decoded rows of the scratch.
template <int R, typename X>
inline void accumulate_rows(const X* x, int64_t M, int64_t K, const float* scratch,
                            int64_t count, Lanes* acc) {
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) accumulate<R, 4>(x + m * K, K, scratch, count, acc + m * R);
  const X* rest = x + m * K;
  Lanes* rest_acc = acc + m * R;
  switch (M - m) {
    case 3: accumulate<R, 3>(rest, K, scratch, count, rest_acc); break;
    case 2: accumulate<R, 2>(rest, K, scratch, count, rest_acc); break;
    case 1: accumulate<R, 1>(rest, K, scratch, count, rest_acc); break;
    default: break;
  }
}

// out (M, N) = x (M, K) @ W.T, weight rows R at a time (the last tile may hold fewer).
template <typename F, int R, typename X>
void matmul_tiles(const X* x, int64_t M, int64_t K, const uint8_t* w, int64_t N, X* out) {
  const int64_t row_bytes = K / F::kValues * F::kBytes;
  const int64_t tiles = (N + R - 1) / R;
  const int64_t grain = std::max<int64_t>(1, kParallelWork / std::max<int64_t>(R * K * M, 1));
  at::parallel_for(0, tiles, grain, [&](int64_t begin, int64_t end) {
    std::vector<Lanes> scratch_lanes(R * kChunk / kWidth);
    float* scratch = reinterpret_cast<float*>(scratch_lanes.data());
    std::vector<Lanes> acc(M * R);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n = t * R;
      const int64_t rows = std::min<int64_t>(R, N - n);
      std::fill(acc.begin(), acc.end(), Lanes{});
      std::fill(scratch, scratch + R * kChunk, 0.f);  // rows past N stay zero
      for (int64_t k = 0; k < K; k += kChunk) {
        const int64_t count = std::min(kChunk, K - k);
        for (int64_t r = 0; r < rows; ++r) {
          decode_span<F>(w + (n + r) * row_bytes, k, count, scratch + r * kChunk);
        }
        accumulate_rows<R>(x + k, M, K, scratch, count, acc.data());
      }
      for (int64_t m = 0; m < M; ++m) {
        for (int64_t r = 0; r < rows; ++r) {
          float sum = 0.f;
          for (int64_t i = 0; i < kWidth; ++i) sum += acc[m * R + r][i];
          out[m * N + n + r] = static_cast<X>(sum);
        }
      }
    }
  });
}

// One row of x: 8 weight rows a tile (8 streams of weights); more: 4 by 4 of x on AVX-512's
// 32 registers, 3 by 4 on AVX2's 16.
template <typename F, typename X>
void matmul(const X* x, int64_t M, int64_t K, const uint8_t* w, int64_t N, X* out) {
#if defined(CPU_CAPABILITY_AVX512)
  constexpr int kWeightsPerTile = 4;
#else
  constexpr int kWeightsPerTile = 3;
#endif
  if (M == 1) {
    matmul_tiles<F, 8>(x, M, K, w, N, out);
  } else {
    matmul_tiles<F, kWeightsPerTile>(x, M, K, w, N, out);
  }
}

// The values a row of `blocks` holds in ggml type `type` (checking the arguments).
int64_t row_values(const at::Tensor& blocks, int64_t type) {
  TORCH_CHECK(blocks.device().is_cpu() && blocks.scalar_type() == at::kByte &&
                  blocks.dim() == 2 && blocks.is_contiguous(),
              "blocks must be a contiguous uint8 (N, row bytes) CPU tensor");
  int64_t values = 0;
  dispatch_format(type, [&](auto format) {
    using F = decltype(format);
    TORCH_CHECK(blocks.size(1) % F::kBytes == 0, "a row of blocks must be a multiple of ",
                F::kBytes, " bytes, got ", blocks.size(1));
    values = blocks.size(1) / F::kBytes * F::kValues;
  });
  return values;
}

}  // namespace radixlm_quant

at::Tensor quantized_matmul(const at::Tensor& x, const at::Tensor& blocks, int64_t type) {
  const int64_t K = radixlm_quant::row_values(blocks, type);
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.size(1) == K,
              "x must be a CPU (M, K) tensor for K = ", K);
  const at::Tensor a = x.contiguous();
  const int64_t M = a.size(0), N = blocks.size(0);
  at::Tensor out = at::empty({M, N}, a.options());
  if (M == 0 || N == 0) return out;
  const uint8_t* w = blocks.data_ptr<uint8_t>();
  DISPATCH_STORAGE_TYPES(a.scalar_type(), "quantized_matmul", [&] {
    radixlm_quant::dispatch_format(type, [&](auto format) {
      radixlm_quant::matmul<decltype(format)>(a.data_ptr<scalar_t>(), M, K, w, N,
                                               out.data_ptr<scalar_t>());
    });
  });
  return out;
}

void dequantize_blocks(const at::Tensor& blocks, int64_t type, at::Tensor& out) {
  const int64_t K = radixlm_quant::row_values(blocks, type);
  const int64_t N = blocks.size(0);
  TORCH_CHECK(out.device().is_cpu() && out.is_contiguous() && out.dim() == 2 &&
                  out.size(0) == N && out.size(1) == K &&
                  (out.scalar_type() == at::kFloat || out.scalar_type() == at::kBFloat16),
              "out must be a contiguous float32 or bfloat16 (", N, ", ", K, ") CPU tensor");
  const uint8_t* w = blocks.data_ptr<uint8_t>();
  const int64_t row_bytes = blocks.size(1);
  const bool wide = out.scalar_type() == at::kFloat;
  void* data = out.data_ptr();
  radixlm_quant::dispatch_format(type, [&](auto format) {
    using F = decltype(format);
    const int64_t grain = std::max<int64_t>(1, radixlm_matmul::kParallelWork / (8 * K));
    at::parallel_for(0, N, grain, [&](int64_t begin, int64_t end) {
      std::vector<float> scratch(wide ? 0 : radixlm_quant::kChunk);
      for (int64_t n = begin; n < end; ++n) {
        for (int64_t k = 0; k < K; k += radixlm_quant::kChunk) {
          const int64_t count = std::min(radixlm_quant::kChunk, K - k);
          if (wide) {
            float* row = static_cast<float*>(data) + n * K;
            radixlm_quant::decode_span<F>(w + n * row_bytes, k, count, row + k);
          } else {
            radixlm_quant::decode_span<F>(w + n * row_bytes, k, count, scratch.data());
            at::BFloat16* row = static_cast<at::BFloat16*>(data) + n * K + k;
            at::vec::convert(scratch.data(), row, count);
          }
        }
      }
    });
  });
}
