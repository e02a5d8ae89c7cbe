// LoRA adapters' terms added to a projection's output on CPUs, every adapter of a pass in one
// call (see models/lora/lora_layers.py, which holds the operands).
//
// A pass's rows come in groups, one an adapter slot: group g is rows[starts[g] .. starts[g+1])
// of slot slots[g]. A projection of N outputs is cut into S shards (columns bounds[i] ..
// bounds[i+1]: q | k | v, gate | up, or one), each with its own A and B per slot:
//
//   a      (slots, S * R, K)  shard i's A in rows i * R .. i * R + ranks[s][i]
//   b_t    (slots, R, N)      B transposed: b_t[s][j][c] is column c's B entry j
//   scales (slots, S)         float32; 0 where the slot's adapter leaves the shard alone
//   ranks  (slots, S)         int64; the rows of A (columns of B) the shard uses, <= R
//
// and for each row of group g and each column c of shard i (scale != 0):
//
//   y[row][c] += scales[s][i] * sum_{j < rank} (sum_k x[row][k] a[s][i * R + j][k]) b_t[s][j][c]
//
// in float32 (a and b_t float32 or x's own type, widened in registers), y rounded once to its
// type. The zero padding past an adapter's rank is never read, so the bytes read are the
// adapters' own: a pass's cost is its rows' products plus each adapter's weights read once
// (for a few rows an adapter, the reads dominate). A row's terms depend on its own x, slot
// and weights only, summed in the same order whatever the group or the thread, so they do
// not depend on the rows beside it (tests/kernels/cpu_ops/test_lora_matmul.py).

#include <omp.h>

#include "common.h"
#include "kernels.h"

namespace radixlm_lora {

using radixlm_vec::kLanes;
using radixlm_vec::Vec;

constexpr int64_t kStep = 2 * kLanes;  // the expand's columns a vector step
constexpr int64_t kMinParallelWork = 1 << 16;  // rows x K x R below which one thread runs

// Columns c0 .. c1 of shard `shard`.
struct ColumnStep {
  int64_t shard, c0, c1;
};

struct Groups {
  const int64_t* rows;
  const int64_t* starts;
  const int64_t* slots;
  int64_t count;
};

// A group's A rows j .. j + columns of shard i: the shrink's unit of work.
struct ShrinkTask {
  int64_t group, column, columns;  // column: xa's first, i * R + j
};

constexpr int kBlockRows = 4;  // rows of a group taken together (xa holds 3 spare rows)

// out[m * out_stride + q] = dot(x_rows[m], a_rows[q]) for the m < n rows of x (widened to
// float32 as they are read) and Q rows of A (K apart), kBlockRows x Q accumulators in
// registers: each (row, A row) sum runs the same operations in the same order whatever block
// it is in. x_rows holds kBlockRows valid pointers (repeats past n).
template <int Q, typename T, typename W>
inline void dots(const T* const (&x_rows)[kBlockRows], int64_t n, const W* a_rows, int64_t K,
                 float* out, int64_t out_stride) {
  Vec acc[kBlockRows][Q];
  for (int m = 0; m < kBlockRows; ++m) {
    for (int q = 0; q < Q; ++q) acc[m][q] = Vec(0.f);
  }
  int64_t k = 0;
  for (; k + kLanes <= K; k += kLanes) {
    Vec a[Q];
    for (int q = 0; q < Q; ++q) a[q] = radixlm_vec::load_vec(a_rows + q * K + k);
    for (int m = 0; m < kBlockRows; ++m) {
      const Vec x = radixlm_vec::load_vec(x_rows[m] + k);
      for (int q = 0; q < Q; ++q) acc[m][q] = at::vec::fmadd(x, a[q], acc[m][q]);
    }
  }
  for (int m = 0; m < n; ++m) {
    for (int q = 0; q < Q; ++q) {
      float sum = radixlm_vec::sum_lanes(acc[m][q]);
      for (int64_t t = k; t < K; ++t) {
        sum += radixlm_vec::load(x_rows[m], t) * radixlm_vec::load(a_rows + q * K, t);
      }
      out[m * out_stride + q] = sum;
    }
  }
}

// The kBlockRows rows of a block from p, rows[p .. last) (repeating the last past it).
template <typename T>
inline void block_rows(T* data, int64_t stride, const int64_t* rows, int64_t p, int64_t last,
                       T* (&out)[kBlockRows]) {
  for (int64_t m = 0; m < kBlockRows; ++m) out[m] = data + rows[std::min(p + m, last - 1)] * stride;
}

// The shrink's tasks: a group's A rows j .. j + 4 of a shard (or one row, where fewer are
// left), for every (i, j) its slot uses.
std::vector<ShrinkTask> shrink_tasks(const Groups& groups, int64_t S, int64_t R,
                                     const float* scales, const int64_t* ranks) {
  std::vector<ShrinkTask> tasks;
  for (int64_t g = 0; g < groups.count; ++g) {
    const int64_t s = groups.slots[g];
    for (int64_t i = 0; i < S; ++i) {
      if (scales[s * S + i] == 0.f) continue;
      const int64_t r = ranks[s * S + i];
      int64_t j = 0;
      for (; j + 4 <= r; j += 4) tasks.push_back({g, i * R + j, 4});
      for (; j < r; ++j) tasks.push_back({g, i * R + j, 1});
    }
  }
  return tasks;
}

// xa[p][task's columns] for every row p of each task's group, tasks [begin, end).
template <typename T, typename W>
void shrink(const T* x, int64_t x_stride, int64_t K, const Groups& groups, const W* a,
            int64_t width, const std::vector<ShrinkTask>& tasks, int64_t begin, int64_t end,
            float* xa) {
  for (int64_t t = begin; t < end; ++t) {
    const ShrinkTask task = tasks[t];
    const W* a_rows = a + (groups.slots[task.group] * width + task.column) * K;
    const int64_t last = groups.starts[task.group + 1];
    for (int64_t p = groups.starts[task.group]; p < last; p += kBlockRows) {
      const int64_t n = std::min<int64_t>(kBlockRows, last - p);
      const T* x_rows[kBlockRows];
      block_rows(x, x_stride, groups.rows, p, last, x_rows);
      float* out = xa + p * width + task.column;
      if (task.columns == 4) {
        dots<4>(x_rows, n, a_rows, K, out, width);
      } else {
        dots<1>(x_rows, n, a_rows, K, out, width);
      }
    }
  }
}

// y[0 .. 2 kLanes) + scale * (lo | hi), rounded to T, stored back.
template <typename T>
inline void add_scaled(T* y, const Vec& lo, const Vec& hi, const Vec& scale) {
  if constexpr (std::is_same_v<T, float>) {
    (Vec::loadu(y) + lo * scale).store(y);
    (Vec::loadu(y + kLanes) + hi * scale).store(y + kLanes);
  } else {
    Vec y_lo, y_hi;
    at::vec::load_to_float(y, y_lo, y_hi);
    at::vec::convert_from_float<T>(y_lo + lo * scale, y_hi + hi * scale).store(y);
  }
}

// y[rows[m]][c0 .. c1) += scale * xa[m][0 .. r) b_t[0 .. r)[c0 .. c1) for the m < n rows of a
// block (xa: kBlockRows rows, xa_stride apart): whole steps of 2 kLanes columns in vectors,
// each B vector loaded once for the block, the rest one column at a time. Which way a column
// goes depends on N and the shard bounds only, so a row's sums do not depend on its block.
template <typename T, typename W>
inline void expand_block(const float* xa, int64_t xa_stride, int64_t n, const W* b_t,
                         int64_t N, int64_t r, float scale, int64_t c0, int64_t c1,
                         T* const (&y_rows)[kBlockRows]) {
  const Vec scale_vec(scale);
  int64_t c = c0;
  for (; c + kStep <= c1; c += kStep) {
    Vec lo[kBlockRows], hi[kBlockRows];
    for (int m = 0; m < kBlockRows; ++m) lo[m] = hi[m] = Vec(0.f);
    for (int64_t j = 0; j < r; ++j) {
      const Vec b_lo = radixlm_vec::load_vec(b_t + j * N + c);
      const Vec b_hi = radixlm_vec::load_vec(b_t + j * N + c + kLanes);
      for (int m = 0; m < kBlockRows; ++m) {
        const Vec x(xa[m * xa_stride + j]);
        lo[m] = at::vec::fmadd(x, b_lo, lo[m]);
        hi[m] = at::vec::fmadd(x, b_hi, hi[m]);
      }
    }
    for (int m = 0; m < n; ++m) add_scaled(y_rows[m] + c, lo[m], hi[m], scale_vec);
  }
  for (; c < c1; ++c) {
    for (int m = 0; m < n; ++m) {
      float sum = 0.f;
      for (int64_t j = 0; j < r; ++j) {
        sum = std::fma(xa[m * xa_stride + j], radixlm_vec::load(b_t + j * N, c), sum);
      }
      y_rows[m][c] = static_cast<T>(static_cast<float>(y_rows[m][c]) + sum * scale);
    }
  }
}

// The expand's steps: each shard's columns in runs of kStep from its first (the last run
// shorter), so that which columns go in vectors depends on the bounds alone.
std::vector<ColumnStep> column_steps(const int64_t* bounds, int64_t S) {
  std::vector<ColumnStep> steps;
  for (int64_t i = 0; i < S; ++i) {
    for (int64_t c = bounds[i]; c < bounds[i + 1]; c += kStep) {
      steps.push_back({i, c, std::min(c + kStep, bounds[i + 1])});
    }
  }
  return steps;
}

// y's columns of steps [begin, end) += every group's terms: adapter by adapter, each B row
// streamed over those columns.
template <typename T, typename W>
void expand(T* y, int64_t N, const Groups& groups, const W* b_t, int64_t R, int64_t S,
            const float* scales, const int64_t* ranks, const float* xa,
            const std::vector<ColumnStep>& steps, int64_t begin, int64_t end) {
  std::vector<ColumnStep> runs;  // the columns of each shard among the steps
  for (int64_t t = begin; t < end; ++t) {
    if (!runs.empty() && runs.back().shard == steps[t].shard) {
      runs.back().c1 = steps[t].c1;
    } else {
      runs.push_back(steps[t]);
    }
  }
  for (int64_t g = 0; g < groups.count; ++g) {
    const int64_t s = groups.slots[g];
    const int64_t last = groups.starts[g + 1];
    for (int64_t p = groups.starts[g]; p < last; p += kBlockRows) {
      const int64_t n = std::min<int64_t>(kBlockRows, last - p);
      T* y_rows[kBlockRows];
      block_rows(y, N, groups.rows, p, last, y_rows);
      for (const ColumnStep& run : runs) {
        const float scale = scales[s * S + run.shard];
        const int64_t r = ranks[s * S + run.shard];
        if (scale == 0.f || r == 0) continue;
        expand_block(xa + p * S * R + run.shard * R, S * R, n, b_t + s * R * N, N, r, scale,
                     run.c0, run.c1, y_rows);
      }
    }
  }
}

// Part `part` of `parts` of [0, count), in contiguous shares.
inline std::pair<int64_t, int64_t> share(int64_t count, int64_t part, int64_t parts) {
  return {count * part / parts, count * (part + 1) / parts};
}

template <typename T, typename W>
void add_terms(const at::Tensor& x, at::Tensor& y, const Groups& groups, const at::Tensor& a,
               const at::Tensor& b_t, const float* scales, const int64_t* ranks,
               const int64_t* bounds, int64_t S) {
  const int64_t K = x.size(1), N = y.size(1), R = b_t.size(1);
  const int64_t P = groups.starts[groups.count];
  // (kBlockRows - 1 spare rows after the last: blocks read whole, store their own rows)
  std::vector<float> xa((P + kBlockRows - 1) * S * R, 0.f);
  const std::vector<ShrinkTask> tasks = shrink_tasks(groups, S, R, scales, ranks);
  const std::vector<ColumnStep> steps = column_steps(bounds, S);
  const T* x_data = x.data_ptr<T>();
  T* y_data = y.data_ptr<T>();
  const W* a_data = a.data_ptr<W>();
  const W* b_data = b_t.data_ptr<W>();
  const auto run = [&](int64_t part, int64_t parts, auto&& barrier) {
    const auto [t0, t1] = share(static_cast<int64_t>(tasks.size()), part, parts);
    shrink(x_data, x.stride(0), K, groups, a_data, S * R, tasks, t0, t1, xa.data());
    barrier();  // (every row's xa before any expand)
    const auto [s0, s1] = share(static_cast<int64_t>(steps.size()), part, parts);
    expand(y_data, N, groups, b_data, R, S, scales, ranks, xa.data(), steps, s0, s1);
  };
  // One parallel region a call (where OpenMP threads sleep between regions, each region
  // wakes them), none for a pass too small to share.
  const int64_t threads = at::in_parallel_region() || P * K * R < kMinParallelWork
                              ? 1
                              : at::get_num_threads();
  if (threads == 1) {
    run(0, 1, [] {});
    return;
  }
#pragma omp parallel num_threads(threads)
  {
    run(omp_get_thread_num(), omp_get_num_threads(), [] {
#pragma omp barrier
    });
  }
}

void check_operands(const at::Tensor& x, const at::Tensor& y, const at::Tensor& rows,
                    const at::Tensor& starts, const at::Tensor& slots, const at::Tensor& a,
                    const at::Tensor& b_t, const at::Tensor& scales, const at::Tensor& ranks,
                    const at::Tensor& bounds) {
  for (const at::Tensor* t : {&x, &y, &rows, &starts, &slots, &a, &b_t, &scales, &ranks, &bounds}) {
    TORCH_CHECK(t->device().is_cpu(), "lora_add: CPU tensors expected");
  }
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "lora_add: x must be (T, K), rows contiguous");
  TORCH_CHECK(y.dim() == 2 && y.is_contiguous() && y.size(0) == x.size(0) &&
                  y.scalar_type() == x.scalar_type(),
              "lora_add: y must be a contiguous (T, N) of x's type");
  TORCH_CHECK(a.dim() == 3 && a.is_contiguous() && a.size(2) == x.size(1),
              "lora_add: a must be a contiguous (slots, S * R, K)");
  TORCH_CHECK(b_t.dim() == 3 && b_t.is_contiguous() && b_t.size(0) == a.size(0) &&
                  b_t.size(2) == y.size(1) && b_t.scalar_type() == a.scalar_type(),
              "lora_add: b_t must be a contiguous (slots, R, N) of a's type");
  TORCH_CHECK(a.scalar_type() == at::kFloat || a.scalar_type() == x.scalar_type(),
              "lora_add: a and b_t must be float32 or x's type");
  const int64_t S = bounds.numel() - 1, R = b_t.size(1), num_slots = a.size(0);
  TORCH_CHECK(S >= 1 && a.size(1) == S * R, "lora_add: a must have S * R rows for S shards");
  for (const at::Tensor* t : {&rows, &starts, &slots, &ranks, &bounds}) {
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous(),
                "lora_add: contiguous int64 rows, starts, slots, ranks and bounds expected");
  }
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() &&
                  scales.numel() == num_slots * S && ranks.numel() == num_slots * S,
              "lora_add: scales (float32) and ranks must be (slots, S)");
  const int64_t* b = bounds.data_ptr<int64_t>();
  TORCH_CHECK(b[0] == 0 && b[S] == y.size(1), "lora_add: bounds must run from 0 to N");
  for (int64_t i = 0; i < S; ++i) TORCH_CHECK(b[i] <= b[i + 1], "lora_add: bounds must rise");
  const int64_t* r = ranks.data_ptr<int64_t>();
  for (int64_t i = 0; i < ranks.numel(); ++i) {
    TORCH_CHECK(r[i] >= 0 && r[i] <= R, "lora_add: ranks must lie in [0, R]");
  }
  const int64_t groups = slots.numel();
  TORCH_CHECK(starts.numel() == groups + 1, "lora_add: starts must have one more than slots");
  const int64_t* st = starts.data_ptr<int64_t>();
  TORCH_CHECK(st[0] == 0 && st[groups] == rows.numel(), "lora_add: starts must cover rows");
  for (int64_t g = 0; g < groups; ++g) {
    TORCH_CHECK(st[g] <= st[g + 1], "lora_add: starts must rise");
    const int64_t s = slots.data_ptr<int64_t>()[g];
    TORCH_CHECK(s >= 0 && s < num_slots, "lora_add: slot out of range");
  }
  const int64_t* rw = rows.data_ptr<int64_t>();
  for (int64_t p = 0; p < rows.numel(); ++p) {
    TORCH_CHECK(rw[p] >= 0 && rw[p] < x.size(0), "lora_add: row out of range");
  }
}

}  // namespace radixlm_lora

// lora_add: y += the LoRA terms of x's rows by adapter slot, in place (see the top of file).
void lora_add(const at::Tensor& x, at::Tensor y, const at::Tensor& rows, const at::Tensor& starts,
              const at::Tensor& slots, const at::Tensor& a, const at::Tensor& b_t,
              const at::Tensor& scales, const at::Tensor& ranks, const at::Tensor& bounds) {
  radixlm_lora::check_operands(x, y, rows, starts, slots, a, b_t, scales, ranks, bounds);
  const radixlm_lora::Groups groups{rows.data_ptr<int64_t>(), starts.data_ptr<int64_t>(),
                                    slots.data_ptr<int64_t>(), slots.numel()};
  const int64_t S = bounds.numel() - 1;
  const bool wide = a.scalar_type() == at::kFloat;
  DISPATCH_STORAGE_TYPES(x.scalar_type(), "lora_add", [&] {
    if (wide) {
      radixlm_lora::add_terms<scalar_t, float>(x, y, groups, a, b_t, scales.data_ptr<float>(),
                                               ranks.data_ptr<int64_t>(),
                                               bounds.data_ptr<int64_t>(), S);
    } else {
      radixlm_lora::add_terms<scalar_t, scalar_t>(x, y, groups, a, b_t,
                                                  scales.data_ptr<float>(),
                                                  ranks.data_ptr<int64_t>(),
                                                  bounds.data_ptr<int64_t>(), S);
    }
  });
}
