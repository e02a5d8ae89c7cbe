// Greedy sampling's argmax over float32 logits, vectorised (see fused_ops.py).
//
// torch's CPU argmax walks a row one value at a time, several times slower than this kernel
// (benchmarks/RESULTS.md), and a greedy decode step pays it once. Here each vector lane
// keeps the largest value it
// has seen and where (a strictly larger value replaces it, so a lane keeps the first of its
// ties), and the lanes are then merged: the largest value, at the smallest index among the
// lanes holding it. The answer is torch.argmax's exactly: the first index of the largest
// value, a NaN counting as larger than everything (the first NaN, found by a plain scan of a
// row that holds one). Indices ride in float32 lanes, exact below 2^24; longer rows take the
// plain scan.

#include "common.h"
#include "kernels.h"

namespace radixlm_argmax {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kLanes = Vec::size();
constexpr int64_t kExactIndices = int64_t{1} << 24;

// The first index of a NaN in row[from, V), or -1.
int64_t first_nan(const float* row, int64_t from, int64_t V) {
  for (int64_t j = from; j < V; ++j) {
    if (std::isnan(row[j])) return j;
  }
  return -1;
}

// torch.argmax of one row of V >= 1 values, one value at a time.
int64_t scan(const float* row, int64_t V) {
  int64_t at = 0;
  for (int64_t j = 0; j < V; ++j) {
    if (std::isnan(row[j])) return j;
    if (row[j] > row[at]) at = j;
  }
  return at;
}

int64_t argmax_row(const float* row, int64_t V) {
  if (V < kLanes || V >= kExactIndices) return scan(row, V);
  Vec top = Vec::loadu(row), where = Vec::arange(0.f, 1.f), index = where;
  Vec nans = top.isnan();
  const Vec step(static_cast<float>(kLanes));
  int64_t j = kLanes;
  for (; j + kLanes <= V; j += kLanes) {
    index = index + step;
    const Vec v = Vec::loadu(row + j);
    const Vec larger = v > top;
    top = Vec::blendv(top, v, larger);
    where = Vec::blendv(where, index, larger);
    nans = nans | v.isnan();
  }
  if (nans.zero_mask() != (1 << kLanes) - 1) return first_nan(row, 0, V);
  float tops[kLanes], wheres[kLanes];
  top.store(tops);
  where.store(wheres);
  float best = tops[0];
  int64_t at = static_cast<int64_t>(wheres[0]);
  for (int64_t lane = 1; lane < kLanes; ++lane) {
    const int64_t lane_at = static_cast<int64_t>(wheres[lane]);
    if (tops[lane] > best || (tops[lane] == best && lane_at < at)) {
      best = tops[lane], at = lane_at;
    }
  }
  for (; j < V; ++j) {  // the tail: later indices, so only a larger value moves `at`
    if (std::isnan(row[j])) return j;
    if (row[j] > best) best = row[j], at = j;
  }
  return at;
}

}  // namespace radixlm_argmax

// argmax_rows(x (B, V) float32, unit stride in V, V >= 1) -> (B,) int64: what
// x.argmax(dim=-1) gives, rows split between the threads.
at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2,
              "x must be a 2-D float32 CPU tensor");
  TORCH_CHECK(x.size(1) >= 1 && x.stride(1) == 1, "x needs V >= 1 and unit stride in V");
  const int64_t B = x.size(0), V = x.size(1), stride = x.stride(0);
  at::Tensor out = at::empty({B}, x.options().dtype(at::kLong));
  const float* p = x.data_ptr<float>();
  int64_t* o = out.data_ptr<int64_t>();
  // A row of 49,152 values is little work (benchmarks/RESULTS.md): a thread a few rows at
  // least.
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / V);
  at::parallel_for(0, B, grain, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) o[b] = radixlm_argmax::argmax_row(p + b * stride, V);
  });
  return out;
}
