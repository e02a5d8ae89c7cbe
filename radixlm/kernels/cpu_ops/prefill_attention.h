// What the bfloat16 and float32 prefill attention kernels share (prefill_attention.cpp and
// prefill_attention_float32.cpp): a call's shape and sequences, the task loop over the whole
// call and a task's walk over its rows, and the float32 kernel's entry point, which
// paged_prefill_attention calls.

#pragma once

#include "common.h"

namespace radixlm_prefill {

constexpr int64_t kRows = 4;        // query rows walked together (their sums in registers)
constexpr int64_t kTaskRows = 32;   // query rows of a task

// A call's shape: a sequence's n new queries, the last of its S = total keys, the heads and
// dims; its packed sizes per KV head, S padded to whole groups of keys (bfloat16: groups of
// 16, and their pairs; float32: groups of a vector's width).
struct Shape {
  int64_t n, total, heads, kv_heads, dim, v_dim;
  int64_t key_groups, key_pairs;
};

// The widest D_v each kernel takes (its rows' sums of values are kept on the stack): the
// build passes fused_ops.PREFILL_MAX_VALUE_DIM's values.
#if !defined(RADIXLM_PREFILL_MAX_VALUE_DIM_FLOAT32) || !defined(RADIXLM_PREFILL_MAX_VALUE_DIM_BFLOAT16)
#error "build through fused_ops.py, which defines RADIXLM_PREFILL_MAX_VALUE_DIM_*"
#endif
constexpr int64_t max_value_dim(at::ScalarType type) {
  return type == at::kFloat ? RADIXLM_PREFILL_MAX_VALUE_DIM_FLOAT32
                            : RADIXLM_PREFILL_MAX_VALUE_DIM_BFLOAT16;
}

// One sequence of a call: its shape (n new queries, the last of its S = total keys; its
// packed sizes), its first query row, its row of the slot table (key j lies at row slots[j]
// of the pool) and where its packed keys and values start in the call's buffers.
struct Sequence {
  Shape shape;
  int64_t q_start;
  const int64_t* slots;
  int64_t packed_k = 0, packed_v = 0;
};

// (sequence, task within it) of a task of the whole call, from each sequence's first task
// (`starts`, B + 1 entries, the last the count of all).
inline std::pair<int64_t, int64_t> locate(const std::vector<int64_t>& starts, int64_t task) {
  const int64_t b = std::upper_bound(starts.begin(), starts.end(), task) - starts.begin() - 1;
  return {b, task - starts[b]};
}

// run(sequence, task within it) for every task of the whole call (`starts` as for locate),
// in one parallel loop of `grain` tasks a piece.
template <class Run>
void for_each_task(const std::vector<int64_t>& starts, int64_t grain, const Run& run) {
  at::parallel_for(0, starts.back(), grain, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const auto [b, local] = locate(starts, task);
      run(b, local);
    }
  });
}

// The groups of kRows query rows of attend task `local` of sequence sq (task = row block x
// head, its block taken in alternating early and late order, so each thread's share of a
// sequence's tasks holds as many keys as another's: a late block sees more of them):
// visit(h, q_rows, out_rows, last_key, rows) for each, its rows' pointers into q (T, H, D)
// with the given strides and into out (T, H, D_v) and the last key each row sees; a short
// group repeats its last row.
template <typename T, class Visit>
void for_each_row_group(const Sequence& sq, int64_t local, const T* q, int64_t q_stride_t,
                        int64_t q_stride_h, T* out, const Visit& visit) {
  const Shape& s = sq.shape;
  const int64_t row_blocks = (s.n + kTaskRows - 1) / kTaskRows;
  const int64_t order = local / s.heads, h = local % s.heads;
  const int64_t block = order % 2 == 0 ? order / 2 : row_blocks - 1 - order / 2;
  const int64_t first = block * kTaskRows, last = std::min(s.n, first + kTaskRows);
  const int64_t offset = s.total - s.n;  // query i's position
  for (int64_t i = first; i < last; i += kRows) {
    const int64_t rows = std::min(kRows, last - i);
    const T* q_rows[kRows];
    T* out_rows[kRows];
    int64_t last_key[kRows];
    for (int64_t r = 0; r < kRows; ++r) {
      const int64_t row = i + std::min(r, rows - 1);
      q_rows[r] = q + (sq.q_start + row) * q_stride_t + h * q_stride_h;
      out_rows[r] = out + ((sq.q_start + row) * s.heads + h) * s.v_dim;
      last_key[r] = offset + row;
    }
    visit(h, q_rows, out_rows, last_key, rows);
  }
}

}  // namespace radixlm_prefill

namespace radixlm_prefill_float32 {

// Packs every sequence's keys, then attends each one's queries (prefill_attention_float32.cpp).
at::Tensor attend_sequences(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            std::vector<radixlm_prefill::Sequence>& seqs, double scale);

}  // namespace radixlm_prefill_float32
