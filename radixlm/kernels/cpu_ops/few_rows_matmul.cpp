// Matmuls for the few rows of a decode step (see fused_ops.py).
//
// out = x @ (w * scales[:, None]).T for x (M, K) in float32, bfloat16 or float16 and w (N, K)
// either int8 with scales (N,) float32 (int8_matmul) or of x's own type, float16 or bfloat16
// (dense_matmul, no scales). Weights are widened to float32 in registers and the sums kept in
// float32; x is read as it is stored (no rounding of float32 activations), and each output is
// rounded once to x's type. A row's products do not depend on the rows beside it: each
// output's terms are summed in the same order by the same operations in every tile shape
// (test_few_rows_matmul.py checks it on builds for other CPUs too).
//
// For a few rows the product reads each weight once and does little with it, so its time is
// the weights' bytes over the memory bandwidth: the loops ask for the weights a fixed distance
// ahead of where they read (the CPU's own prefetcher, on the short rows of a projection, keeps
// too little in flight: on a 2-core AMX CPU, 12 GB/s over 108 MB of weights of the 24-29 two
// threads read in a plain loop, 17-21 with these requests).

#include "common.h"
#include "kernels.h"
#include "matmul_lanes.h"

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

namespace radixlm_matmul {

// A tile of several rows of x: kRowsPerTile rows against kWeightsPerTile weight rows, one
// accumulator register for each pair, and the widened weights and an x vector beside them.
// AVX-512 has 32 registers: 4 x 4 (16 accumulators). AVX2 has 16: 4 x 4 spills there, and
// 3 weight rows x 4 of x (12 accumulators) was the fastest of 4x4, 4x3, 3x4, 2x6, 4x2, 6x2,
// 3x5 and 3x3 (2-core Zen 3; benchmarks/RESULTS.md).
#if defined(CPU_CAPABILITY_AVX512)
constexpr int kWeightsPerTile = 4;
#else
constexpr int kWeightsPerTile = 3;
#endif
constexpr int kRowsPerTile = 4;

// The first `count` (< kWidth) values from p, widened to float32, and zeros after them: the
// columns past the last whole vector go through the same multiply-adds as the others. (A
// scalar loop for them rounded by the tile's shape in GCC 12's builds tuned for Zen.)
template <typename T>
inline Lanes padded(const T* p, int64_t count) {
  Lanes out = {};
  for (int64_t i = 0; i < count; ++i) out[i] = static_cast<float>(p[i]);
  return out;
}

// Makes the compiler keep v in a register from here on. In a whole tile GCC would rather
// fold the x loads into the multiply-adds, loading each x vector once per weight row: 15
// loads for a step's 12 multiply-adds on AVX2, where a core loads 2 vectors a cycle. With x
// loaded once (7 loads), 16 rows are faster in every weight type (2-core Zen 3;
// benchmarks/RESULTS.md). Fewer rows than a tile's are limited by memory, not loads, and
// keep the compiler's choice (faster at 2 rows).
inline void in_register(Lanes& v) {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  __asm__("" : "+v"(v));
#endif
}

// A tile of the product: rows [0, MB) of x against weight rows [0, R) (rows of K, each
// scaled by scales[r] unless scales is null) into out[m * out_stride + r]. With `prefetch`,
// the weights kPrefetchBytes past the tile's own (the next tiles' rows) are requested as it
// reads.
template <int R, int MB, typename T, typename W>
inline void tile(const T* x, int64_t x_stride, const W* w, const float* scales, int64_t K,
                 T* out, int64_t out_stride, bool prefetch) {
  Lanes acc[MB][R] = {};
  int64_t k = 0;
  for (; k + kWidth <= K; k += kWidth) {
    if (prefetch) {  // the tile reads R * kWidth weights a step: ask for as many ahead
      const char* ahead = reinterpret_cast<const char*>(w + k * R) + kPrefetchBytes;
      constexpr int64_t step_bytes = R * kWidth * static_cast<int64_t>(sizeof(W));
      for (int64_t j = 0; j < step_bytes; j += 64) __builtin_prefetch(ahead + j, 0, 3);
    }
    Lanes wide[R];
    for (int r = 0; r < R; ++r) wide[r] = load_weights(w + r * K + k);
    for (int m = 0; m < MB; ++m) {
      Lanes xv = load_activations(x + m * x_stride + k);
      if constexpr (MB == kRowsPerTile) in_register(xv);
      for (int r = 0; r < R; ++r) acc[m][r] = multiply_add(xv, wide[r], acc[m][r]);
    }
  }
  if (k < K) {  // the last K % kWidth columns, padded with zeros to a whole vector
    Lanes wide[R];
    for (int r = 0; r < R; ++r) wide[r] = padded(w + r * K + k, K - k);
    for (int m = 0; m < MB; ++m) {
      const Lanes xv = padded(x + m * x_stride + k, K - k);
      for (int r = 0; r < R; ++r) acc[m][r] = multiply_add(xv, wide[r], acc[m][r]);
    }
  }
  for (int m = 0; m < MB; ++m) {
    for (int r = 0; r < R; ++r) {
      float sum = 0.f;
      for (int64_t i = 0; i < kWidth; ++i) sum += acc[m][r][i];
      out[m * out_stride + r] = static_cast<T>(scales == nullptr ? sum : sum * scales[r]);
    }
  }
}

// The last `rows` (< MB) rows of x against weight rows [0, R), as one tile.
template <int R, int MB, typename T, typename W>
inline void tile_rest(int64_t rows, const T* x, int64_t K, const W* w, const float* scales,
                      T* out, int64_t N, bool prefetch) {
  if constexpr (MB > 1) {
    if (rows == MB - 1) {
      tile<R, MB - 1>(x, K, w, scales, K, out, N, prefetch);
    } else {
      tile_rest<R, MB - 1>(rows, x, K, w, scales, out, N, prefetch);
    }
  }
}

// Rows [0, M) of x against weight rows [0, R), x's rows kRowsPerTile at a time (the widened
// weights are reused across them; the weights stay in L1 between the groups).
template <int R, typename T, typename W>
inline void tile_rows(const T* x, int64_t M, int64_t K, const W* w, const float* scales,
                      T* out, int64_t N) {
  if (M == 1) {
    tile<R, 1>(x, K, w, scales, K, out, N, true);
    return;
  }
  int64_t m = 0;
  for (; m + kRowsPerTile <= M; m += kRowsPerTile) {
    tile<R, kRowsPerTile>(x + m * K, K, w, scales, K, out + m * N, N, m == 0);
  }
  tile_rest<R, kRowsPerTile>(M - m, x + m * K, K, w, scales, out + m * N, N, m == 0);
}

// One row of x: 8 weight rows a tile (8 streams of weights against one of x); more rows:
// 4 weight rows by 4 of x (16 accumulators).
template <typename T, typename W>
void matmul(const T* x, int64_t M, int64_t K, const W* w, const float* scales, T* out,
            int64_t N) {
  const int64_t R = M == 1 ? 8 : kWeightsPerTile;
  const int64_t tiles = N / R;
  const int64_t grain = std::max<int64_t>(1, kParallelWork / std::max<int64_t>(R * K * M, 1));
  at::parallel_for(0, tiles, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n = t * R;
      if (M == 1) {
        tile_rows<8>(x, M, K, w + n * K, scaled(scales, n), out + n, N);
      } else {
        tile_rows<kWeightsPerTile>(x, M, K, w + n * K, scaled(scales, n), out + n, N);
      }
    }
  });
  for (int64_t n = tiles * R; n < N; ++n) {  // rows past the last whole tile
    tile_rows<1>(x, M, K, w + n * K, scaled(scales, n), out + n, N);
  }
}

void check_args(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "CPU tensors expected");
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous(), "weight must be a contiguous (N, K)");
  TORCH_CHECK(x.dim() == 2 && x.size(1) == weight.size(1), "x must be (M, K) for weight (N, K)");
}

}  // namespace radixlm_matmul

at::Tensor int8_matmul(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales) {
  radixlm_matmul::check_args(x, weight);
  TORCH_CHECK(weight.scalar_type() == at::kChar, "weight must be int8");
  TORCH_CHECK(scales.device().is_cpu() && scales.scalar_type() == at::kFloat &&
                  scales.dim() == 1 && scales.size(0) == weight.size(0),
              "scales must be (N,) float32");
  const at::Tensor a = x.contiguous();
  const at::Tensor s = scales.contiguous();
  const int64_t M = a.size(0), K = a.size(1), N = weight.size(0);
  at::Tensor out = at::empty({M, N}, a.options());
  if (M == 0 || N == 0) return out;
  DISPATCH_STORAGE_TYPES(a.scalar_type(), "int8_matmul", [&] {
    radixlm_matmul::matmul(a.data_ptr<scalar_t>(), M, K, weight.data_ptr<int8_t>(),
                           s.data_ptr<float>(), out.data_ptr<scalar_t>(), N);
  });
  return out;
}

at::Tensor dense_matmul(const at::Tensor& x, const at::Tensor& weight) {
  radixlm_matmul::check_args(x, weight);
  const at::ScalarType weight_type = weight.scalar_type();
  TORCH_CHECK(weight_type == x.scalar_type() || weight_type == at::kHalf ||
                  weight_type == at::kBFloat16,
              "weight must be of x's dtype, float16 or bfloat16");
  const at::Tensor a = x.contiguous();
  const int64_t M = a.size(0), K = a.size(1), N = weight.size(0);
  at::Tensor out = at::empty({M, N}, a.options());
  if (M == 0 || N == 0) return out;
  const float* no_scales = nullptr;
  DISPATCH_STORAGE_TYPES(a.scalar_type(), "dense_matmul", [&] {
    const scalar_t* rows = a.data_ptr<scalar_t>();
    scalar_t* products = out.data_ptr<scalar_t>();
    if (weight_type == at::kHalf) {
      radixlm_matmul::matmul(rows, M, K, weight.data_ptr<at::Half>(), no_scales, products, N);
    } else if (weight_type == at::kBFloat16) {
      radixlm_matmul::matmul(rows, M, K, weight.data_ptr<at::BFloat16>(), no_scales, products,
                             N);
    } else {
      radixlm_matmul::matmul(rows, M, K, weight.data_ptr<scalar_t>(), no_scales, products, N);
    }
  });
  return out;
}
