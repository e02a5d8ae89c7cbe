// GGUF's block formats (llama.cpp's layouts; kernels/quantized/block_formats.py decodes the
// same in torch) for quantized_matmul.cpp: each type's geometry and its values decoded into
// float32 lanes in registers, and the switch over ggml type numbers.

#pragma once

#include "common.h"
#include "matmul_lanes.h"

namespace radixlm_quant {

using radixlm_matmul::kWidth;
using radixlm_matmul::Lanes;

// ggml_type's numbers for the served types (the GGUF format's, as gguf.GGMLQuantizationType).
enum GgmlType : int64_t {
  kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8,
  kQ4_K = 12, kQ5_K = 13, kQ6_K = 14, kQ8_K = 15,
};

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

// kWidth bytes as int32 lanes, and int32 lanes as float32 ones (GCC's and Clang's vector
// extension: the building CPU's widening instructions).
typedef uint8_t UBytes __attribute__((vector_size(kWidth)));
typedef int8_t SBytes __attribute__((vector_size(kWidth)));
typedef int32_t Ints __attribute__((vector_size(kWidth * 4)));
typedef uint32_t UInts __attribute__((vector_size(kWidth * 4)));

// kWidth bytes from p (signed where Bytes is SBytes) widened to int32 lanes. (GCC 12
// scalarizes __builtin_convertvector from bytes; the intrinsics are one instruction.)
template <typename Bytes = UBytes>
inline Ints load_ints(const uint8_t* p) {
  constexpr bool is_signed = std::is_same_v<Bytes, SBytes>;
#if defined(CPU_CAPABILITY_AVX512)
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return reinterpret_cast<Ints>(is_signed ? _mm512_cvtepi8_epi32(bytes)
                                          : _mm512_cvtepu8_epi32(bytes));
#elif defined(CPU_CAPABILITY_AVX2)
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return reinterpret_cast<Ints>(is_signed ? _mm256_cvtepi8_epi32(bytes)
                                          : _mm256_cvtepu8_epi32(bytes));
#else
  Ints out;
  for (int64_t i = 0; i < kWidth; ++i) {
    out[i] = is_signed ? static_cast<int8_t>(p[i]) : static_cast<int32_t>(p[i]);
  }
  return out;
#endif
}

inline Lanes to_float(Ints v) {
#if defined(CPU_CAPABILITY_AVX512)
  return reinterpret_cast<Lanes>(_mm512_cvtepi32_ps(reinterpret_cast<__m512i>(v)));
#elif defined(CPU_CAPABILITY_AVX2)
  return reinterpret_cast<Lanes>(_mm256_cvtepi32_ps(reinterpret_cast<__m256i>(v)));
#else
  return __builtin_convertvector(v, Lanes);
#endif
}

inline Lanes splat(float v) {
#if defined(CPU_CAPABILITY_AVX512)
  return reinterpret_cast<Lanes>(_mm512_set1_ps(v));
#elif defined(CPU_CAPABILITY_AVX2)
  return reinterpret_cast<Lanes>(_mm256_set1_ps(v));
#else
  Lanes out;
  for (int64_t i = 0; i < kWidth; ++i) out[i] = v;
  return out;
#endif
}

// Bit first + i of `bits` in lane i.
inline Ints bit_lanes(uint32_t bits, int first) {
  UInts shifts;
  for (int64_t i = 0; i < kWidth; ++i) shifts[i] = static_cast<uint32_t>(first + i);
  return (Ints)(((UInts{} + bits) >> shifts) & 1u);
}

// One block type: its values and bytes a block, and lanes(block, fn), which hands its values
// to fn(first, Lanes) kWidth at a time, in registers (decode() writes them out). The
// products are gguf's, in its order. (A multiply-add the compiler may form from `a * q + m`
// rounds as the two operations do: every such product, a float16 scale times a 6-bit
// sub-scale times a 5-bit value, is exact in float32.)
struct Q4_0 {
  static constexpr int64_t kValues = 32, kBytes = 18;
  template <typename Fn>
  static void lanes(const uint8_t* b, Fn&& fn) {
    const Lanes d = splat(half_at(b));
    for (int j = 0; j < 16; j += kWidth) {
      const Ints q = load_ints(b + 2 + j);
      fn(j, d * to_float((q & 15) - 8));
      fn(16 + j, d * to_float((q >> 4) - 8));
    }
  }
};

struct Q4_1 {
  static constexpr int64_t kValues = 32, kBytes = 20;
  template <typename Fn>
  static void lanes(const uint8_t* b, Fn&& fn) {
    const Lanes d = splat(half_at(b)), m = splat(half_at(b + 2));
    for (int j = 0; j < 16; j += kWidth) {
      const Ints q = load_ints(b + 4 + j);
      fn(j, d * to_float(q & 15) + m);
      fn(16 + j, d * to_float(q >> 4) + m);
    }
  }
};

// Q5_0's and Q5_1's 5-bit values: low nibbles, the fifth bit of value i bit i of the
// little-endian uint32 qh. fn(first, q) for the kWidth values from `first`.
template <typename Fn>
inline void five_bits(const uint8_t* qh_bytes, const uint8_t* qs, Fn&& fn) {
  uint32_t qh;
  std::memcpy(&qh, qh_bytes, 4);
  for (int j = 0; j < 16; j += kWidth) {
    const Ints q = load_ints(qs + j);
    fn(j, (q & 15) | (bit_lanes(qh, j) << 4));
    fn(16 + j, (q >> 4) | (bit_lanes(qh, 16 + j) << 4));
  }
}

struct Q5_0 {
  static constexpr int64_t kValues = 32, kBytes = 22;
  template <typename Fn>
  static void lanes(const uint8_t* b, Fn&& fn) {
    const Lanes d = splat(half_at(b));
    five_bits(b + 2, b + 6, [&](int first, Ints q) { fn(first, d * to_float(q - 16)); });
  }
};

struct Q5_1 {
  static constexpr int64_t kValues = 32, kBytes = 24;
  template <typename Fn>
  static void lanes(const uint8_t* b, Fn&& fn) {
    const Lanes d = splat(half_at(b)), m = splat(half_at(b + 2));
    five_bits(b + 4, b + 8, [&](int first, Ints q) { fn(first, d * to_float(q) + m); });
  }
};

struct Q8_0 {
  static constexpr int64_t kValues = 32, kBytes = 34;
  template <typename Fn>
  static void lanes(const uint8_t* b, Fn&& fn) {
    const Lanes d = splat(half_at(b));
    for (int j = 0; j < 32; j += kWidth) fn(j, to_float(load_ints<SBytes>(b + 2 + j)) * d);
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
  template <typename Fn>
  static void lanes(const uint8_t* b, Fn&& fn) {
    float scale[8], offset[8];
    k_scales(b, scale, offset);
    for (int p = 0; p < 4; ++p) {  // sub-blocks 2p (low nibbles) and 2p + 1 (high)
      for (int j = 0; j < 32; j += kWidth) {
        const Ints q = load_ints(b + 16 + 32 * p + j);
        fn(64 * p + j, splat(scale[2 * p]) * to_float(q & 15) - splat(offset[2 * p]));
        fn(64 * p + 32 + j,
           splat(scale[2 * p + 1]) * to_float(q >> 4) - splat(offset[2 * p + 1]));
      }
    }
  }
};

struct Q5_K {
  static constexpr int64_t kValues = 256, kBytes = 176;
  template <typename Fn>
  static void lanes(const uint8_t* b, Fn&& fn) {
    float scale[8], offset[8];
    k_scales(b, scale, offset);
    for (int p = 0; p < 4; ++p) {  // sub-block s takes bit s of qh[k] (qh at 16, qs at 48)
      for (int j = 0; j < 32; j += kWidth) {
        const Ints q = load_ints(b + 48 + 32 * p + j);
        const Ints high = load_ints(b + 16 + j);
        const Ints low = (q & 15) | (((high >> (2 * p)) & 1) << 4);
        const Ints top = (q >> 4) | (((high >> (2 * p + 1)) & 1) << 4);
        fn(64 * p + j, splat(scale[2 * p]) * to_float(low) - splat(offset[2 * p]));
        fn(64 * p + 32 + j, splat(scale[2 * p + 1]) * to_float(top) - splat(offset[2 * p + 1]));
      }
    }
  }
};

struct Q6_K {
  static constexpr int64_t kValues = 256, kBytes = 210;
  template <typename Fn>
  static void lanes(const uint8_t* b, Fn&& fn) {
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
    const float d = half_at(b + 208);
    for (int h = 0; h < 2; ++h) {  // halves of 128: four runs of 32 from 64 + 32 bytes
      const uint8_t* ql = b + 64 * h;
      const uint8_t* qh = b + 128 + 32 * h;
      const int8_t* s = sc + 8 * h;
      for (int k = 0; k < 32; k += kWidth) {
        const Ints l0 = load_ints(ql + k), l1 = load_ints(ql + 32 + k);
        const Ints hi = load_ints(qh + k);
        const int sub = k / 16;  // (a run of kWidth lies within one sub-block of 16)
        const auto put = [&](int first, int s_index, Ints q) {
          fn(128 * h + first, splat(d * static_cast<float>(s[s_index])) * to_float(q - 32));
        };
        put(k, sub, (l0 & 15) | ((hi & 3) << 4));
        put(32 + k, sub + 2, (l1 & 15) | (((hi >> 2) & 3) << 4));
        put(64 + k, sub + 4, (l0 >> 4) | (((hi >> 4) & 3) << 4));
        put(96 + k, sub + 6, (l1 >> 4) | (((hi >> 6) & 3) << 4));
      }
    }
  }
};

struct Q8_K {
  static constexpr int64_t kValues = 256, kBytes = 292;
  template <typename Fn>
  static void lanes(const uint8_t* b, Fn&& fn) {
    const Lanes d = splat(float_at(b));
    for (int k = 0; k < 256; k += kWidth) fn(k, d * to_float(load_ints<SBytes>(b + 4 + k)));
  }
};

// F's block `b` written out as float32.
template <typename F>
inline void decode(const uint8_t* b, float* out) {
  F::lanes(b, [&](int first, Lanes w) { std::memcpy(out + first, &w, sizeof(Lanes)); });
}

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

}  // namespace radixlm_quant
