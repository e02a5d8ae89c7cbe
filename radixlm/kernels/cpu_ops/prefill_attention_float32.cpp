// Causal attention of an extend batch's new tokens in float32 (the serving dtype of CPUs
// without native bfloat16, `dtype=auto` there; see fused_ops.py), each sequence over its
// keys where they lie in the KV pool. The bfloat16 kernel's plan (prefill_attention.cpp)
// on float32 multiply-adds:
//
// softmax(q . k * scale) . v for a sequence's n queries that are the last n of its S
// positions: query i sees keys 0 .. S - n + i. Its keys are first laid out per KV head in
// groups of one vector's width of keys (kWidth: 8 on AVX2, 16 on AVX-512), dim by dim, so
// that one load serves a multiply-add into kWidth scores; values are read where they lie
// (a key's row of D_v floats). A task is 32 query rows of one head, in groups of four rows
// whose sums stay in registers. Its keys are taken in blocks of kBlockKeys up to the last
// key any of its rows may see (the blocks above the diagonal are never computed), and each
// group that sees a block attends it in turn, while the block's keys and values are in
// cache, with softmax online (a running maximum and sum per row). Scores, probabilities and
// sums are float32 throughout; a score is summed over the dims in order, a probability-
// weighted value over the keys in order, and the blocks start at multiples of kBlockKeys
// whatever the rows beside a row.
//
// On a 2-core AVX2 CPU (Zen 3), a layer took half the time of torch's gather and causal
// SDPA or less, for one long prompt and for many short ones (against their padded SDPA);
// whole passes were faster too. The earlier walk took each group over all its keys in turn,
// reading each key and value from L2 (or beyond) once per group; this one is faster, the
// more so the longer the sequence or its cached prefix (figures in benchmarks/RESULTS.md).

#include "common.h"
#include "prefill_attention.h"

namespace radixlm_prefill_float32 {

using radixlm_prefill::Sequence;
using radixlm_prefill::Shape;
using Vec = at::vec::Vectorized<float>;
constexpr int64_t kWidth = Vec::size();  // keys of a packed group, columns of a value vector
typedef float Lanes __attribute__((vector_size(sizeof(float) * kWidth)));

using radixlm_prefill::kRows;      // query rows walked together (their sums in registers)
using radixlm_prefill::kTaskRows;  // query rows of a task
constexpr int64_t kMaxValueDim = radixlm_prefill::max_value_dim(at::kFloat);
// Groups of keys scored at once and value vectors weighed at once: with the four rows'
// accumulators, the loaded vectors and a broadcast, AVX2's 16 registers hold 4 x 3 (16
// used); AVX-512 has 32.
#if defined(CPU_CAPABILITY_AVX512)
constexpr int kAtOnce = 6;
#else
constexpr int kAtOnce = 3;
#endif
// Keys a task's row groups attend before the next block: a block's packed keys and values
// (48 KiB at D = 64, where one head's for 2,048 tokens take 1 MiB) are read by each group in
// turn. Blocks of 48, 96, 128 and 192 keys measured alike on Zen 3, 24 slower.
constexpr int64_t kBlockKeys = 96;
static_assert(kBlockKeys % (kAtOnce * kWidth) == 0, "a block is whole passes of groups");
static_assert(kTaskRows % kRows == 0, "a task is whole groups of rows");

inline Lanes load(const float* p) {
  Lanes v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void store(float* p, const Lanes& v) { std::memcpy(p, &v, sizeof(v)); }

// keys (rows slots[0 .. S) of the pool's (P, H_kv, D)) -> per KV head, per group of kWidth
// keys, per dim: the group's kWidth values of that dim, zeros past S.
void pack_keys(const float* k, const int64_t* slots, int64_t stride_s, int64_t stride_h,
               const Shape& s, float* out, int64_t task) {
  const int64_t h = task / s.key_groups, g = task % s.key_groups;
  float* block = out + task * s.dim * kWidth;
  for (int64_t j = 0; j < kWidth; ++j) {
    const int64_t key = g * kWidth + j;
    const float* row = key < s.total ? k + slots[key] * stride_s + h * stride_h : nullptr;
    for (int64_t d = 0; d < s.dim; ++d) block[d * kWidth + j] = row == nullptr ? 0.f : row[d];
  }
}

// scores[r][column .. column + G kWidth) = scale * q_r . the keys of G packed groups (from
// kb) for the kRows rows: each group's vector of a dim loaded once for the rows.
template <int G>
inline void score_groups(const float* const* q, const float* kb, int64_t dim, float scale,
                         float (*scores)[kBlockKeys], int64_t column) {
  Lanes acc[kRows][G] = {};
  for (int64_t d = 0; d < dim; ++d) {
    Lanes keys[G];
    for (int g = 0; g < G; ++g) keys[g] = load(kb + (g * dim + d) * kWidth);
    for (int r = 0; r < kRows; ++r) {
      const float qd = q[r][d];
      for (int g = 0; g < G; ++g) acc[r][g] += keys[g] * qd;
    }
  }
  for (int r = 0; r < kRows; ++r) {
    for (int g = 0; g < G; ++g) store(scores[r] + column + g * kWidth, acc[r][g] * scale);
  }
}

// acc[r][kWidth c0 .. kWidth (c0 + C)) += probs[r][0 .. count) . those columns of the
// values of count keys (rows[t]: key t's values).
template <int C>
inline void weigh_values(const float (*probs)[kBlockKeys], const float* const* rows,
                         int64_t count, int64_t c0, float (*acc)[kMaxValueDim]) {
  Lanes a[kRows][C];
  for (int r = 0; r < kRows; ++r) {
    for (int c = 0; c < C; ++c) a[r][c] = load(acc[r] + (c0 + c) * kWidth);
  }
  for (int64_t t = 0; t < count; ++t) {
    Lanes values[C];
    for (int c = 0; c < C; ++c) values[c] = load(rows[t] + (c0 + c) * kWidth);
    for (int r = 0; r < kRows; ++r) {
      const float p = probs[r][t];
      for (int c = 0; c < C; ++c) a[r][c] += values[c] * p;
    }
  }
  for (int r = 0; r < kRows; ++r) {
    for (int c = 0; c < C; ++c) store(acc[r] + (c0 + c) * kWidth, a[r][c]);
  }
}

inline float lanes_max(const Vec& v) {
  alignas(64) float lanes[kWidth];
  v.store(lanes);
  return *std::max_element(lanes, lanes + kWidth);
}

inline float lanes_sum(const Vec& v) {
  alignas(64) float lanes[kWidth];
  v.store(lanes);
  float sum = 0.f;
  for (int64_t i = 0; i < kWidth; ++i) sum += lanes[i];
  return sum;
}

// The online softmax of kRows query rows over the keys folded in so far: each row's largest
// score, its sum of exp(score - largest) and its values weighed by those (not yet divided).
struct RowsState {
  float top[kRows], total[kRows];
  alignas(64) float acc[kRows][kMaxValueDim];

  void reset(int64_t v_dim) {
    for (int64_t r = 0; r < kRows; ++r) {
      top[r] = -std::numeric_limits<float>::infinity(), total[r] = 0.f;
      std::fill(acc[r], acc[r] + v_dim, 0.f);
    }
  }
};

// Folds keys start .. start + count (packed in keys; key start + t's values at value_rows[t])
// into the state of the kRows rows q (row r sees keys 0 .. last_key[r]). start is a multiple
// of kBlockKeys, so a row's sums do not depend on the rows beside it.
inline void attend_block(const float* const* q, const int64_t* last_key, int64_t start,
                         int64_t count, const float* keys, const float* const* value_rows,
                         const Shape& s, float scale, RowsState& st) {
  const float minus_inf = -std::numeric_limits<float>::infinity();
  alignas(64) float scores[kRows][kBlockKeys];  // scores, then their probabilities
  const int64_t groups = (count + kWidth - 1) / kWidth;
  const float* kb = keys + (start / kWidth) * s.dim * kWidth;
  for (int64_t g0 = 0; g0 < groups; g0 += kAtOnce) {
    const float* from = kb + g0 * s.dim * kWidth;
    const int64_t column = g0 * kWidth;
    switch (std::min<int64_t>(kAtOnce, groups - g0)) {
#if defined(CPU_CAPABILITY_AVX512)
      case 6: score_groups<6>(q, from, s.dim, scale, scores, column); break;
      case 5: score_groups<5>(q, from, s.dim, scale, scores, column); break;
      case 4: score_groups<4>(q, from, s.dim, scale, scores, column); break;
#endif
      case 3: score_groups<3>(q, from, s.dim, scale, scores, column); break;
      case 2: score_groups<2>(q, from, s.dim, scale, scores, column); break;
      default: score_groups<1>(q, from, s.dim, scale, scores, column); break;
    }
  }
  const int64_t width = groups * kWidth;
  for (int64_t r = 0; r < kRows; ++r) {  // online softmax: new maximum, rescaled sums
    float* row = scores[r];
    const int64_t visible = std::clamp<int64_t>(last_key[r] + 1 - start, 0, width);
    std::fill(row + visible, row + width, minus_inf);
    Vec top_vec(minus_inf);
    for (int64_t j = 0; j < width; j += kWidth) {
      top_vec = at::vec::maximum(top_vec, Vec::loadu(row + j));
    }
    const float new_top = std::max(st.top[r], lanes_max(top_vec));
    const float rescale = st.top[r] == minus_inf ? 0.f : std::exp(st.top[r] - new_top);
    Vec sum(0.f);
    for (int64_t j = 0; j < width; j += kWidth) {
      const Vec e = (Vec::loadu(row + j) - Vec(new_top)).exp_u20();
      sum = sum + e;
      e.store(row + j);
    }
    st.total[r] = st.total[r] * rescale + lanes_sum(sum);
    st.top[r] = new_top;
    if (rescale != 1.f) {
      for (int64_t c = 0; c < s.v_dim; c += kWidth) {
        (Vec::loadu(st.acc[r] + c) * Vec(rescale)).store(st.acc[r] + c);
      }
    }
  }
  const int64_t column_vectors = s.v_dim / kWidth;
  for (int64_t c0 = 0; c0 < column_vectors; c0 += kAtOnce) {
    switch (std::min<int64_t>(kAtOnce, column_vectors - c0)) {
#if defined(CPU_CAPABILITY_AVX512)
      case 6: weigh_values<6>(scores, value_rows, count, c0, st.acc); break;
      case 5: weigh_values<5>(scores, value_rows, count, c0, st.acc); break;
      case 4: weigh_values<4>(scores, value_rows, count, c0, st.acc); break;
#endif
      case 3: weigh_values<3>(scores, value_rows, count, c0, st.acc); break;
      case 2: weigh_values<2>(scores, value_rows, count, c0, st.acc); break;
      default: weigh_values<1>(scores, value_rows, count, c0, st.acc); break;
    }
  }
}

// kRows query rows of a task (pointers; a short group repeats its last row): where they
// are, where their outputs go, the last key each sees (ascending) and how many are real.
struct RowGroup {
  const float* q[kRows];
  float* out[kRows];
  int64_t last_key[kRows];
  int64_t rows;
};

// A task's groups of rows (one head's), block of keys by block: each block's keys and values
// are read by every group that sees them while they are near the core, where walking one
// group over all its keys in turn read them from L2 once per group. Key j's values at
// value_of(j).
template <class ValueRow>
void attend_groups(const RowGroup* groups, int64_t count, const float* keys,
                   const ValueRow& value_of, const Shape& s, float scale) {
  RowsState states[kTaskRows / kRows];
  int64_t end = 0;  // keys any of the rows sees
  for (int64_t g = 0; g < count; ++g) {
    states[g].reset(s.v_dim);
    end = std::max(end, groups[g].last_key[kRows - 1] + 1);
  }
  const float* value_rows[kBlockKeys];
  for (int64_t start = 0; start < end; start += kBlockKeys) {
    const int64_t block = std::min(kBlockKeys, end - start);
    for (int64_t t = 0; t < block; ++t) value_rows[t] = value_of(start + t);
    for (int64_t g = 0; g < count; ++g) {
      const int64_t seen = groups[g].last_key[kRows - 1] + 1 - start;
      if (seen <= 0) continue;
      attend_block(groups[g].q, groups[g].last_key, start, std::min(block, seen), keys,
                   value_rows, s, scale, states[g]);
    }
  }
  for (int64_t g = 0; g < count; ++g) {
    for (int64_t r = 0; r < groups[g].rows; ++r) {
      const Vec inverse(1.f / states[g].total[r]);
      for (int64_t c = 0; c < s.v_dim; c += kWidth) {
        (Vec::loadu(states[g].acc[r] + c) * inverse).store(groups[g].out[r] + c);
      }
    }
  }
}

// Packs every sequence's keys, then attends each one's queries: two parallel loops for the
// whole call, whatever its number of sequences. q (T, H, D) rows, k and v rows (any count,
// H_kv heads) as `seqs` say; out (T, H, D_v).
at::Tensor attend_sequences(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            std::vector<Sequence>& seqs, double scale) {
  const Shape& dims = seqs.front().shape;  // heads and dims, the same for every sequence
  std::vector<int64_t> pack_tasks{0}, attend_tasks{0};
  int64_t key_elements = 0;
  for (Sequence& sq : seqs) {
    Shape& s = sq.shape;
    s.key_groups = (s.total + kWidth - 1) / kWidth;
    sq.packed_k = key_elements;
    key_elements += s.kv_heads * s.key_groups * kWidth * s.dim;
    pack_tasks.push_back(pack_tasks.back() + s.kv_heads * s.key_groups);
    attend_tasks.push_back(attend_tasks.back() + (s.n + kTaskRows - 1) / kTaskRows * s.heads);
  }
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  const float* qp = q.data_ptr<float>();
  at::Tensor keys = at::empty({key_elements}, k.options());
  float* packed_k = keys.data_ptr<float>();
  radixlm_prefill::for_each_task(pack_tasks, 8, [&](int64_t b, int64_t local) {
    const Sequence& sq = seqs[b];
    pack_keys(kp, sq.slots, k.stride(0), k.stride(1), sq.shape, packed_k + sq.packed_k, local);
  });
  at::Tensor out = at::empty({q.size(0), dims.heads, dims.v_dim}, q.options());
  float* op = out.data_ptr<float>();
  const int64_t group = dims.heads / dims.kv_heads;
  radixlm_prefill::for_each_task(attend_tasks, 1, [&](int64_t b, int64_t local) {
    const Sequence& sq = seqs[b];
    const Shape& s = sq.shape;
    RowGroup groups[kTaskRows / kRows];
    int64_t count = 0, h = 0;
    radixlm_prefill::for_each_row_group(
        sq, local, qp, q.stride(0), q.stride(1), op,
        [&](int64_t head, const float* const* q_rows, float* const* out_rows,
            const int64_t* last_key, int64_t rows) {
          RowGroup& g = groups[count++];
          std::copy(q_rows, q_rows + kRows, g.q);
          std::copy(out_rows, out_rows + kRows, g.out);
          std::copy(last_key, last_key + kRows, g.last_key);
          g.rows = rows, h = head;
        });
    const int64_t hk = h / group;
    const float* head_keys = packed_k + sq.packed_k + hk * s.key_groups * kWidth * s.dim;
    const float* head_values = vp + hk * v.stride(1);
    const auto value_of = [&](int64_t key) { return head_values + sq.slots[key] * v.stride(0); };
    attend_groups(groups, count, head_keys, value_of, s, static_cast<float>(scale));
  });
  return out;
}

}  // namespace radixlm_prefill_float32
