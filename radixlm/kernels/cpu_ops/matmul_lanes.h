// What the matmuls of few_rows_matmul.cpp, blocked_matmul.cpp and quantized_matmul.cpp
// share: the prefetch distance and parallel threshold, and float32 lanes as the compiler's
// vector extension with the loads that widen activations and weights into them and their
// fused multiply-add.

#pragma once

#include "common.h"

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

namespace radixlm_matmul {

// How far ahead of the rows being read the weights are requested, in bytes of the
// (contiguous) rows of a thread's blocks: 16 KiB the best of 4-32 KiB over one large weight;
// 8, 16 and 32 KiB gave the same decode step.
constexpr int64_t kPrefetchBytes = 16 * 1024;
// Work below this many multiply-adds runs on the calling thread (waking the others costs
// more than the work saves).
constexpr int64_t kParallelWork = 1 << 17;

// One SIMD register of float32 lanes as GCC's and Clang's vector extension: arrays of these
// stay in registers where arrays of ATen's vector class are kept on the stack.
using Vec = at::vec::Vectorized<float>;
constexpr int64_t kWidth = Vec::size();
typedef float Lanes __attribute__((vector_size(sizeof(float) * kWidth)));

inline Lanes to_lanes(const Vec& v) {
  Lanes out;
  v.store(&out);
  return out;
}

// kWidth int8 weights from p, widened to float32.
inline Lanes load_int8(const int8_t* p) {
#if defined(CPU_CAPABILITY_AVX512)
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return to_lanes(Vec(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes))));
#elif defined(CPU_CAPABILITY_AVX2)
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return to_lanes(Vec(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes))));
#else
  Lanes out;
  for (int64_t i = 0; i < kWidth; ++i) out[i] = static_cast<float>(p[i]);
  return out;
#endif
}

// kWidth activations from p, widened to float32.
template <typename T>
inline Lanes load_activations(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return to_lanes(Vec::loadu(p));
  } else {
    Vec out;
    at::vec::load_to_float(p, out);
    return to_lanes(out);
  }
}

// kWidth weights from p, widened to float32.
template <typename W>
inline Lanes load_weights(const W* p) {
  if constexpr (std::is_same_v<W, int8_t>) {
    return load_int8(p);
  } else {
    return load_activations(p);
  }
}

// a * b + c lane by lane, rounded once. Written `c + a * b`, GCC fused it in some tile shapes
// and not in others (builds tuned for Zen), and a row's products must not depend on the tile
// it falls in.
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

inline const float* scaled(const float* scales, int64_t n) {
  return scales == nullptr ? nullptr : scales + n;
}

}  // namespace radixlm_matmul
