// Matmuls of float32 rows against a weight laid out in column blocks (column_layouts.py):
// blocks (N / 16, K, 16), blocks[b][k][j] = w[16 b + j][k], bfloat16 or float16
// (blocked_matmul: out = x @ w.T), or int8 with scales (N,) float32 (blocked_int8_matmul:
// out = x @ (w * scales[:, None]).T, each sum scaled once, at the end). float32 out.
//
// few_rows_matmul.cpp's tiles take dot products along a weight's rows: each step widens a
// vector of every weight row of the tile and multiplies it by a vector of each x row, and
// the lanes are summed at the end. Over 16 rows a weight is widened once per tile of 4 x
// rows, 4 times, and the widening (2 instructions a vector for bfloat16 on AVX2) shares
// the vector ports with the multiply-adds. Here a step widens 16 consecutive columns of one
// k (a block's row, contiguous) once and multiplies them by x[m][k] of up to 6 rows,
// broadcast from memory: 2 widened vectors for 12 multiply-adds on AVX2. Hot in cache on a
// 2-core Zen 3, one thread, 16 rows against a 576 x 576 bfloat16 weight: 89 GFLOP/s against
// 70 for the row tiles (the vector units' peak is about 102). Each output is summed in the
// order of k (in spans, kSumSpan) whatever the number of rows: a row's products do not
// depend on the rows beside it. The lanes and their loads are few_rows_matmul.cpp's
// (matmul_lanes.h).

#include "common.h"
#include "kernels.h"
#include "matmul_lanes.h"

namespace radixlm_matmul {

#ifndef RADIXLM_BLOCK_COLUMNS
#error "build through fused_ops.py, which defines RADIXLM_BLOCK_COLUMNS"
#endif
constexpr int64_t kBlockColumns = RADIXLM_BLOCK_COLUMNS;
constexpr int kBlockVectors = kBlockColumns / kWidth;  // 2 on AVX2, 1 on AVX-512
static_assert(kBlockColumns % kWidth == 0, "a block's row must be whole vectors");

// x rows a tile multiplies (each x[m][k] broadcast once a step) and blocks it reads: AVX2
// has 16 registers, 6 rows x 1 block (12 accumulators, 2 weight vectors, the broadcast);
// AVX-512 32, 6 rows x 2 blocks. Fewer than 3 rows take twice the blocks, so that a step
// still has 4 or more independent sums to hide the multiply-add's latency behind.
constexpr int kTileRows = 6;
#if defined(CPU_CAPABILITY_AVX512)
constexpr int kTileBlocks = 2;
#else
constexpr int kTileBlocks = 1;
#endif

// Each output is summed in spans of kSumSpan k, the spans' sums added in turn: the rounding
// error of a K-term sum grows with its length, and one sum along K erred 4 times as much as
// the row tiles' 8 lanes of K / 8 terms each (K = 576, float64 as the reference).
constexpr int64_t kSumSpan = 64;

typedef float UnalignedLanes __attribute__((vector_size(sizeof(float) * kWidth), aligned(4)));
typedef uint32_t UnalignedPairs
    __attribute__((vector_size(sizeof(float) * kWidth), aligned(2)));

// Whether a block's bfloat16 row is widened as pairs: a row of 16 bfloat16 is one vector of
// 8 32-bit lanes on AVX2, lane i holding columns 2i (low half) and 2i + 1 (high half).
// Shifted left by 16 a lane is column 2i as a float32; with its low half masked off, column
// 2i + 1: 2 instructions for the row's 2 vectors, neither a shuffle, where widening each
// half takes 2 (zero-extend, shift) and the zero-extends compete with the multiply-adds for
// a port. The sums then hold the even columns (vector 0) and the odd ones (vector 1), put
// back in order when stored: a few percent faster on a 2-core Zen 3 from memory, a few
// slower in cache (benchmarks/RESULTS.md). (float16 widens with one conversion a vector.)
template <typename W>
constexpr bool kPairedRows = std::is_same_v<W, at::BFloat16> && kBlockVectors == 2;

// A block's row at k (kBlockColumns weights from p), widened into kBlockVectors vectors.
template <typename W>
inline void load_block_row(const W* p, Lanes* wide) {
  if constexpr (kPairedRows<W>) {
    const UnalignedPairs pairs = *reinterpret_cast<const UnalignedPairs*>(p);
    wide[0] = (Lanes)(pairs << 16);
    wide[1] = (Lanes)(pairs & 0xFFFF0000u);
  } else {
    for (int v = 0; v < kBlockVectors; ++v) wide[v] = load_weights(p + v * kWidth);
  }
}

// A block's kBlockColumns sums (as load_block_row orders them) into out, in column order,
// each times its column's scale unless scales is null.
template <typename W>
inline void store_block_row(const Lanes* sums, const float* scales, float* out) {
  if constexpr (kPairedRows<W>) {  // (bfloat16, never scaled)
    for (int i = 0; i < kWidth; ++i) {
      out[2 * i] = sums[0][i];
      out[2 * i + 1] = sums[1][i];
    }
  } else {
    for (int v = 0; v < kBlockVectors; ++v) {
      Lanes column_sums = sums[v];
      if (scales != nullptr) {
        column_sums *= *reinterpret_cast<const UnalignedLanes*>(scales + v * kWidth);
      }
      *reinterpret_cast<UnalignedLanes*>(out + v * kWidth) = column_sums;
    }
  }
}

// Rows [0, MB) of x against blocks [0, NB) (each K x kBlockColumns, block_stride apart)
// into out[m * out_stride + column], column c scaled by scales[c] unless scales is null.
// With `prefetch`, each block's weights kPrefetchBytes ahead are requested as it reads (the
// first tile of a block reads it from memory).
template <int MB, int NB, typename W>
inline void block_tile(const float* x, int64_t x_stride, const W* blocks, int64_t block_stride,
                       const float* scales, int64_t K, float* out, int64_t out_stride,
                       bool prefetch) {
  constexpr int V = NB * kBlockVectors;
  constexpr int64_t line =  // k a cache line of a block holds
      std::max<int64_t>(1, 64 / static_cast<int64_t>(sizeof(W) * kBlockColumns));
  Lanes total[MB][V] = {};
  for (int64_t start = 0; start < K; start += kSumSpan) {
    const int64_t stop = std::min(K, start + kSumSpan);
    Lanes acc[MB][V] = {};
    for (int64_t k = start; k < stop; ++k) {
      if (prefetch && k % line == 0) {
        for (int b = 0; b < NB; ++b) {
          const W* ahead = blocks + b * block_stride + k * kBlockColumns;
          __builtin_prefetch(reinterpret_cast<const char*>(ahead) + kPrefetchBytes, 0, 3);
        }
      }
      Lanes wide[V];
      for (int b = 0; b < NB; ++b) {
        load_block_row<W>(blocks + b * block_stride + k * kBlockColumns, wide + b * kBlockVectors);
      }
      for (int m = 0; m < MB; ++m) {
        const float xs = x[m * x_stride + k];
        for (int v = 0; v < V; ++v) acc[m][v] += xs * wide[v];
      }
    }
    for (int m = 0; m < MB; ++m) {
      for (int v = 0; v < V; ++v) total[m][v] += acc[m][v];
    }
  }
  for (int m = 0; m < MB; ++m) {
    for (int b = 0; b < NB; ++b) {
      store_block_row<W>(total[m] + b * kBlockVectors, scaled(scales, b * kBlockColumns),
                         out + m * out_stride + b * kBlockColumns);
    }
  }
}

// The last `rows` (< MB) rows of x against blocks [0, NB), as one tile.
template <int MB, int NB, typename W>
inline void block_tile_rest(int64_t rows, const float* x, int64_t K, const W* blocks,
                            int64_t block_stride, const float* scales, float* out, int64_t N,
                            bool prefetch) {
  if constexpr (MB > 1) {
    if (rows == MB - 1) {
      block_tile<MB - 1, NB>(x, K, blocks, block_stride, scales, K, out, N, prefetch);
    } else {
      block_tile_rest<MB - 1, NB>(rows, x, K, blocks, block_stride, scales, out, N, prefetch);
    }
  }
}

// Rows [0, M) of x against blocks [0, NB): tiles of kTileRows rows, the blocks' weights
// staying in cache between them.
template <int NB, typename W>
inline void block_rows(const float* x, int64_t M, int64_t K, const W* blocks,
                       const float* scales, float* out, int64_t N) {
  const int64_t block_stride = K * kBlockColumns;
  int64_t m = 0;
  for (; m + kTileRows <= M; m += kTileRows) {
    block_tile<kTileRows, NB>(x + m * K, K, blocks, block_stride, scales, K, out + m * N, N,
                              m == 0);
  }
  block_tile_rest<kTileRows, NB>(M - m, x + m * K, K, blocks, block_stride, scales,
                                 out + m * N, N, m == 0);
}

// Rows [0, M) of x against every block, the blocks split between the threads.
template <typename W>
void blocked_matmul_rows(const float* x, int64_t M, int64_t K, const W* blocks,
                         const float* scales, float* out, int64_t N) {
  const int64_t block_count = N / kBlockColumns;
  constexpr int wide_blocks = 2 * kTileBlocks;
  const int NB = M < 3 ? wide_blocks : kTileBlocks;
  const int64_t groups = block_count / NB;
  const int64_t group_work = NB * kBlockColumns * K * M;
  const int64_t grain = std::max<int64_t>(1, kParallelWork / std::max<int64_t>(group_work, 1));
  const int64_t block_stride = K * kBlockColumns;
  at::parallel_for(0, groups, grain, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const W* group = blocks + g * NB * block_stride;
      const float* group_scales = scaled(scales, g * NB * kBlockColumns);
      float* group_out = out + g * NB * kBlockColumns;
      if (NB == wide_blocks) {
        block_rows<wide_blocks>(x, M, K, group, group_scales, group_out, N);
      } else {
        block_rows<kTileBlocks>(x, M, K, group, group_scales, group_out, N);
      }
    }
  });
  for (int64_t b = groups * NB; b < block_count; ++b) {  // blocks past the last whole group
    block_rows<1>(x, M, K, blocks + b * block_stride, scaled(scales, b * kBlockColumns),
                  out + b * kBlockColumns, N);
  }
}

// x's rows a chunk of kChunkBytes at a time, each chunk against every block: a block's
// tiles read the chunk's rows again, and a chunk stays in the core's L2 where all of x
// (a prompt's) would be read from L3 once per block. On a 2-core Zen 3 (512 KiB L2 a core)
// chunks of 128 or 256 KiB were alike and a sixth faster than one chunk (benchmarks/RESULTS.md).
constexpr int64_t kChunkBytes = 128 * 1024;

template <typename W>
void blocked_matmul(const float* x, int64_t M, int64_t K, const W* blocks, const float* scales,
                    float* out, int64_t N) {
  const int64_t fit = kChunkBytes / (K * static_cast<int64_t>(sizeof(float)));
  const int64_t chunk = std::max<int64_t>(kTileRows, fit / kTileRows * kTileRows);
  for (int64_t m = 0; m < M; m += chunk) {
    blocked_matmul_rows(x + m * K, std::min(chunk, M - m), K, blocks, scales, out + m * N, N);
  }
}

// The operands' checks both bindings share; returns the output's column count.
inline int64_t check_blocked_args(const at::Tensor& x, const at::Tensor& blocks) {
  TORCH_CHECK(x.device().is_cpu() && blocks.device().is_cpu(), "CPU tensors expected");
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2, "x must be (M, K) float32");
  TORCH_CHECK(blocks.dim() == 3 && blocks.is_contiguous() &&
                  blocks.size(2) == kBlockColumns && blocks.size(1) == x.size(1),
              "blocks must be a contiguous (N / 16, K, 16) for x (M, K)");
  return blocks.size(0) * kBlockColumns;
}

// out (M, N) float32 for x (M, K): multiply(rows, M, K, out) fills it unless it is empty
// (K = 0: zeros).
template <typename Multiply>
at::Tensor blocked_product(const at::Tensor& x, int64_t N, Multiply&& multiply) {
  const at::Tensor a = x.contiguous();
  const int64_t M = a.size(0), K = a.size(1);
  at::Tensor out = at::empty({M, N}, a.options());
  if (M == 0 || N == 0) return out;
  if (K == 0) return out.zero_();
  multiply(a.data_ptr<float>(), M, K, out.data_ptr<float>());
  return out;
}

}  // namespace radixlm_matmul

at::Tensor blocked_matmul(const at::Tensor& x, const at::Tensor& blocks) {
  const int64_t N = radixlm_matmul::check_blocked_args(x, blocks);
  const at::ScalarType weight_type = blocks.scalar_type();
  TORCH_CHECK(weight_type == at::kBFloat16 || weight_type == at::kHalf,
              "blocks must be bfloat16 or float16 (int8 ones: blocked_int8_matmul)");
  return radixlm_matmul::blocked_product(x, N, [&](const float* rows, int64_t M, int64_t K,
                                                   float* out) {
    if (weight_type == at::kHalf) {
      radixlm_matmul::blocked_matmul(rows, M, K, blocks.data_ptr<at::Half>(), nullptr, out, N);
    } else {
      radixlm_matmul::blocked_matmul(rows, M, K, blocks.data_ptr<at::BFloat16>(), nullptr, out,
                                     N);
    }
  });
}

at::Tensor blocked_int8_matmul(const at::Tensor& x, const at::Tensor& blocks,
                               const at::Tensor& scales) {
  const int64_t N = radixlm_matmul::check_blocked_args(x, blocks);
  TORCH_CHECK(blocks.scalar_type() == at::kChar, "blocks must be int8");
  TORCH_CHECK(scales.device().is_cpu() && scales.scalar_type() == at::kFloat &&
                  scales.dim() == 1 && scales.size(0) == N,
              "scales must be (N,) float32");
  const at::Tensor s = scales.contiguous();
  return radixlm_matmul::blocked_product(x, N, [&](const float* rows, int64_t M, int64_t K,
                                                   float* out) {
    radixlm_matmul::blocked_matmul(rows, M, K, blocks.data_ptr<int8_t>(), s.data_ptr<float>(),
                                   out, N);
  });
}
