// What the CPU kernels' sources share (see fused_ops.py): ATen's headers, the dispatch over
// the serving dtypes, and the float32 vector helpers of the row kernels and decode attention.
//
// Each source includes this header and compiles on its own. The build defines
// CPU_CAPABILITY (and CPU_CAPABILITY_AVX2 or CPU_CAPABILITY_AVX512) for the building CPU,
// so ATen's vectors are that CPU's, and the constants fused_ops.py shares with the kernels
// (RADIXLM_*: see _shared_constants there).

#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

// float32, bfloat16 and float16 storage (the serving dtypes).
#define DISPATCH_STORAGE_TYPES(TYPE, NAME, ...)                    \
  AT_DISPATCH_SWITCH(TYPE, NAME,                                   \
                     AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__)     \
                     AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__)  \
                     AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__))

namespace radixlm_vec {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kLanes = Vec::size();

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

}  // namespace radixlm_vec
