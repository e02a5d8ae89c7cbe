// Causal attention of an extend batch's new tokens, bfloat16, on AVX-512 BF16 dot products
// (see fused_ops.py), each sequence over its keys where they lie in the KV pool.
//
// softmax(q . k * scale) . v for a sequence's n queries that are the last n of its S
// positions: query i sees keys 0 .. S - n + i. Its keys and values are first laid out per
// KV head so that one 512-bit load serves a dot-product instruction (vdpbf16ps: 16 float32
// sums of bfloat16 pairs): keys in blocks of 16 with each key's dims in pairs, values in key
// pairs with 16 columns a vector. A task is 32 query rows of one head, walked four rows at a
// time over blocks of 256 keys that end at the last key the rows may see (the blocks above
// the diagonal are never computed), with softmax online (a running maximum and sum per row,
// float32). As in torch's flash attention, scores and sums are float32 and the
// probabilities are rounded to bfloat16 for their product with the values; outputs are
// rounded once.
//
// One call a layer takes the whole batch: every sequence's keys and values are packed (read
// through its row of the slot table: no padded grid, no mask) in one parallel loop, and its
// tasks join one shared loop. Packing by vector gathers and widenings in that one loop took
// half the time of packing value by value in two loops. A sequence's outputs do not depend
// on the others in its batch: the same packed blocks, the same sums in the same order. Many
// short prompts run several times faster than the padded SDPA call (and its gather) they
// took before (benchmarks/RESULTS.md).
//
// torch's own CPU kernel computes every key of a block of up to 512 whatever the causal mask,
// at about a third of the rate of a plain bfloat16 matrix product: on a 2-core AVX-512 BF16
// CPU without AMX (Zen 4) this kernel took about a third of its time for a 512-token prompt.
// Blocks of 256 keys rather than 64 (fewer running-maximum updates and rescales a row) are
// a tenth faster for long prompts and alike for short ones (benchmarks/RESULTS.md).
//
// The call's checks, its sequences, its task loop and a task's walk over its rows are
// shared with the float32 kernel (prefill_attention_float32.cpp; prefill_attention.h), and
// paged_prefill_attention, here, hands it float32 calls.

#include "common.h"
#include "kernels.h"
#include "prefill_attention.h"

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define RADIXLM_PREFILL_ATTENTION 1
#endif

namespace radixlm_prefill {

constexpr int64_t kKeyBlock = 256;  // keys scored before each softmax update

// q (T, H, D), k (P, H_kv, D), v (P, H_kv, D_v): CPU tensors of one dtype, bfloat16 or
// float32, with unit stride in their last dim; the heads and dims they give.
Shape check_heads(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "q, k and v must be 3-D");
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(),
              "CPU tensors expected");
  const at::ScalarType type = q.scalar_type();
  TORCH_CHECK((type == at::kBFloat16 || type == at::kFloat) && k.scalar_type() == type &&
                  v.scalar_type() == type, "q, k and v must be all bfloat16 or all float32");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1,
              "q, k and v need unit stride in their last dim");
  Shape s{};
  s.heads = q.size(1), s.dim = q.size(2), s.kv_heads = k.size(1), s.v_dim = v.size(2);
  TORCH_CHECK(k.size(2) == s.dim && v.size(1) == s.kv_heads && s.kv_heads > 0 &&
                  s.heads % s.kv_heads == 0,
              "q, k and v shapes do not match");
  TORCH_CHECK(s.dim % 2 == 0 && s.v_dim % 16 == 0 && s.v_dim <= max_value_dim(type),
              "D must be even and D_v a multiple of 16 up to ", max_value_dim(at::kBFloat16),
              " (bfloat16) or ", max_value_dim(at::kFloat), " (float32)");
  return s;
}

#ifdef RADIXLM_PREFILL_ATTENTION

constexpr int64_t kKeyGroup = 16;   // keys of one packed block (one vector of scores)
constexpr int64_t kColumns = 16;    // value columns of one vector

inline __m512bh as_pairs(__m512i v) { return (__m512bh)v; }

inline __m512bh broadcast_pair(const uint16_t* p) {
  int32_t pair;
  std::memcpy(&pair, p, sizeof(pair));
  return as_pairs(_mm512_set1_epi32(pair));
}

// keys (rows slots[0 .. S) of the pool's (P, H_kv, D)) -> per KV head, per group of 16
// keys, per dim pair: 16 keys' pairs (32 values), zeros past S. A group's vector of one dim
// pair is gathered from its 16 rows (two gathers of 8 byte offsets: a pool's offsets may not
// fit 32 bits); keys past S are masked off and read nothing.
void pack_keys(const uint16_t* k, const int64_t* slots, int64_t stride_s, int64_t stride_h,
               const Shape& s, uint16_t* out, int64_t begin, int64_t end) {
  const int64_t pairs = s.dim / 2;
  const char* base = reinterpret_cast<const char*>(k);
  for (int64_t task = begin; task < end; ++task) {
    const int64_t h = task / s.key_groups, g = task % s.key_groups;
    auto* block = reinterpret_cast<uint32_t*>(out) + task * pairs * kKeyGroup;
    const int64_t first = g * kKeyGroup;
    const int64_t valid = std::min(kKeyGroup, s.total - first);
    alignas(64) int64_t offsets[kKeyGroup];
    for (int64_t j = 0; j < kKeyGroup; ++j) {
      offsets[j] = j < valid ? (slots[first + j] * stride_s + h * stride_h) * 2 : 0;
    }
    const __m512i low = _mm512_load_si512(offsets), high = _mm512_load_si512(offsets + 8);
    const auto mask = static_cast<uint32_t>((1u << valid) - 1);
    const __mmask8 low_mask = mask & 0xff, high_mask = mask >> 8;
    const __m256i zero = _mm256_setzero_si256();
    for (int64_t p = 0; p < pairs; ++p) {
      const char* pair = base + 4 * p;
      const __m256i a = _mm512_mask_i64gather_epi32(zero, low_mask, low, pair, 1);
      const __m256i b = _mm512_mask_i64gather_epi32(zero, high_mask, high, pair, 1);
      _mm512_storeu_si512(block + p * kKeyGroup,
                          _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1));
    }
  }
}

// values (rows slots[0 .. S) of (P, H_kv, D_v)) -> per KV head, per key pair, per 16
// columns: the pair's values of each column side by side (32 values), zeros past S. The two
// rows' 16 columns are widened to 32-bit lanes, the second shifted to the upper half.
void pack_values(const uint16_t* v, const int64_t* slots, int64_t stride_s, int64_t stride_h,
                 const Shape& s, uint16_t* out, int64_t begin, int64_t end) {
  for (int64_t task = begin; task < end; ++task) {
    const int64_t h = task / s.key_pairs, t = task % s.key_pairs;
    auto* block = reinterpret_cast<uint32_t*>(out) + task * s.v_dim;
    const uint16_t* rows[2];
    for (int64_t e = 0; e < 2; ++e) {
      const int64_t key = 2 * t + e;
      rows[e] = key < s.total ? v + slots[key] * stride_s + h * stride_h : nullptr;
    }
    for (int64_t c = 0; c < s.v_dim; c += kColumns) {
      __m512i lanes[2];
      for (int64_t e = 0; e < 2; ++e) {
        lanes[e] = rows[e] == nullptr
                       ? _mm512_setzero_si512()
                       : _mm512_cvtepu16_epi32(
                             _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows[e] + c)));
      }
      _mm512_storeu_si512(block + c, _mm512_or_si512(lanes[0], _mm512_slli_epi32(lanes[1], 16)));
    }
  }
}

// scores[r][0 .. 16 G) = scale * q_r . keys of G packed groups (from kb), for the kRows
// rows: each row's dim pair is broadcast once for the G groups and each group's vector once
// for the rows.
template <int G>
inline void score_groups(const uint16_t* const* q, const uint16_t* kb, int64_t pairs,
                         float scale, float (*scores)[kKeyBlock], int64_t column) {
  __m512 acc[kRows][G];
  for (int r = 0; r < kRows; ++r) {
    for (int g = 0; g < G; ++g) acc[r][g] = _mm512_setzero_ps();
  }
  for (int64_t p = 0; p < pairs; ++p) {
    __m512bh qp[kRows];
    for (int r = 0; r < kRows; ++r) qp[r] = broadcast_pair(q[r] + 2 * p);
    for (int g = 0; g < G; ++g) {
      const __m512bh kv = as_pairs(_mm512_loadu_si512(kb + (g * pairs + p) * 2 * kKeyGroup));
      for (int r = 0; r < kRows; ++r) acc[r][g] = _mm512_dpbf16_ps(acc[r][g], qp[r], kv);
    }
  }
  const __m512 f = _mm512_set1_ps(scale);
  for (int r = 0; r < kRows; ++r) {
    for (int g = 0; g < G; ++g) {
      _mm512_store_ps(scores[r] + column + g * kKeyGroup, _mm512_mul_ps(acc[r][g], f));
    }
  }
}

// acc[r][16 c0 .. 16 (c0 + C)) += probs[r][0, 2 count) . the values of count key pairs (from
// vb, rows of column_blocks vectors).
template <int C>
inline void weigh_values(const uint16_t (*probs)[kKeyBlock], const uint16_t* vb, int64_t count,
                         int64_t column_blocks, int64_t c0,
                         float (*acc)[max_value_dim(at::kBFloat16)]) {
  __m512 a[kRows][C];
  for (int r = 0; r < kRows; ++r) {
    for (int c = 0; c < C; ++c) a[r][c] = _mm512_load_ps(acc[r] + (c0 + c) * kColumns);
  }
  for (int64_t t = 0; t < count; ++t) {
    __m512bh pp[kRows];
    for (int r = 0; r < kRows; ++r) pp[r] = broadcast_pair(probs[r] + 2 * t);
    const uint16_t* row = vb + (t * column_blocks + c0) * 2 * kColumns;
    for (int c = 0; c < C; ++c) {
      const __m512bh vv = as_pairs(_mm512_loadu_si512(row + c * 2 * kColumns));
      for (int r = 0; r < kRows; ++r) a[r][c] = _mm512_dpbf16_ps(a[r][c], pp[r], vv);
    }
  }
  for (int r = 0; r < kRows; ++r) {
    for (int c = 0; c < C; ++c) _mm512_store_ps(acc[r] + (c0 + c) * kColumns, a[r][c]);
  }
}

// Four query rows (pointers; a short group repeats its last row) of one head over their keys
// (row r sees keys 0 .. last_key[r], ascending in r).
void attend_rows(const uint16_t* const* q, const int64_t* last_key, const uint16_t* keys,
                 const uint16_t* values, const Shape& s, float scale, uint16_t* const* out,
                 int64_t rows) {
  using Vec = at::vec::Vectorized<float>;
  const int64_t pairs = s.dim / 2, column_blocks = s.v_dim / kColumns;
  const float minus_inf = -std::numeric_limits<float>::infinity();
  float top[kRows], total[kRows];
  alignas(64) float scores[kRows][kKeyBlock];
  alignas(64) uint16_t probs[kRows][kKeyBlock];
  alignas(64) float acc[kRows][max_value_dim(at::kBFloat16)];
  for (int64_t r = 0; r < kRows; ++r) {
    top[r] = minus_inf, total[r] = 0.f;
    std::fill(acc[r], acc[r] + s.v_dim, 0.f);
  }
  const int64_t end = last_key[kRows - 1] + 1;  // keys any of the rows sees
  for (int64_t start = 0; start < end; start += kKeyBlock) {
    const int64_t count = std::min(kKeyBlock, end - start);
    const int64_t groups = (count + kKeyGroup - 1) / kKeyGroup;
    const uint16_t* kb = keys + (start / kKeyGroup) * pairs * 2 * kKeyGroup;
    for (int64_t g0 = 0; g0 < groups; g0 += 4) {  // four groups (64 keys) a call at most
      const uint16_t* from = kb + g0 * pairs * 2 * kKeyGroup;
      const int64_t column = g0 * kKeyGroup;
      switch (std::min<int64_t>(4, groups - g0)) {
        case 4: score_groups<4>(q, from, pairs, scale, scores, column); break;
        case 3: score_groups<3>(q, from, pairs, scale, scores, column); break;
        case 2: score_groups<2>(q, from, pairs, scale, scores, column); break;
        default: score_groups<1>(q, from, pairs, scale, scores, column); break;
      }
    }
    const int64_t width = groups * kKeyGroup;
    for (int64_t r = 0; r < kRows; ++r) {  // online softmax: new maximum, rescaled sums
      float* row = scores[r];
      const int64_t visible = std::clamp<int64_t>(last_key[r] + 1 - start, 0, width);
      std::fill(row + visible, row + width, minus_inf);
      Vec top_vec(minus_inf);
      for (int64_t j = 0; j < width; j += Vec::size()) {
        top_vec = at::vec::maximum(top_vec, Vec::loadu(row + j));
      }
      const float new_top = std::max(top[r], _mm512_reduce_max_ps(static_cast<__m512>(top_vec)));
      const float rescale = top[r] == minus_inf ? 0.f : std::exp(top[r] - new_top);
      Vec sum(0.f);
      for (int64_t j = 0; j < width; j += Vec::size()) {
        const Vec e = (Vec::loadu(row + j) - Vec(new_top)).exp_u20();
        sum = sum + e;
        const __m256bh rounded = _mm512_cvtneps_pbh(static_cast<__m512>(e));
        std::memcpy(probs[r] + j, &rounded, sizeof(rounded));
      }
      total[r] = total[r] * rescale + _mm512_reduce_add_ps(static_cast<__m512>(sum));
      top[r] = new_top;
      if (rescale != 1.f) {
        for (int64_t c = 0; c < s.v_dim; c += Vec::size()) {
          (Vec::loadu(acc[r] + c) * Vec(rescale)).store(acc[r] + c);
        }
      }
    }
    // acc += probs . values over the block's key pairs that hold keys (none past S)
    const int64_t block_pairs = std::min(width, s.total - start + 1) / 2;
    const uint16_t* vb = values + (start / 2) * column_blocks * 2 * kColumns;
    for (int64_t c0 = 0; c0 < column_blocks; c0 += 4) {
      switch (std::min<int64_t>(4, column_blocks - c0)) {
        case 4: weigh_values<4>(probs, vb, block_pairs, column_blocks, c0, acc); break;
        case 3: weigh_values<3>(probs, vb, block_pairs, column_blocks, c0, acc); break;
        case 2: weigh_values<2>(probs, vb, block_pairs, column_blocks, c0, acc); break;
        default: weigh_values<1>(probs, vb, block_pairs, column_blocks, c0, acc); break;
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 inverse = _mm512_set1_ps(1.f / total[r]);
    for (int64_t cb = 0; cb < column_blocks; ++cb) {
      const __m512 o = _mm512_mul_ps(_mm512_load_ps(acc[r] + cb * kColumns), inverse);
      const __m256bh rounded = _mm512_cvtneps_pbh(o);
      std::memcpy(out[r] + cb * kColumns, &rounded, sizeof(rounded));
    }
  }
}

// Packs every sequence's keys and values, then attends each one's queries: two parallel
// loops for the whole call, whatever its number of sequences. q (T, H, D) rows, k and v
// rows (any count, H_kv heads) as `seqs` say; out (T, H, D_v).
at::Tensor attend_sequences(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            std::vector<Sequence>& seqs, double scale) {
  const Shape& dims = seqs.front().shape;  // heads and dims, the same for every sequence
  std::vector<int64_t> pack_tasks{0}, attend_tasks{0};
  int64_t key_elements = 0, value_elements = 0;
  for (Sequence& sq : seqs) {
    Shape& s = sq.shape;
    s.key_groups = (s.total + kKeyGroup - 1) / kKeyGroup;
    s.key_pairs = s.key_groups * kKeyGroup / 2;
    sq.packed_k = key_elements, sq.packed_v = value_elements;
    key_elements += s.kv_heads * s.key_groups * kKeyGroup * s.dim;
    value_elements += s.kv_heads * s.key_pairs * 2 * s.v_dim;
    pack_tasks.push_back(pack_tasks.back() + s.kv_heads * s.key_groups);
    attend_tasks.push_back(attend_tasks.back() + (s.n + kTaskRows - 1) / kTaskRows * s.heads);
  }
  const auto* kp = reinterpret_cast<const uint16_t*>(k.data_ptr<at::BFloat16>());
  const auto* vp = reinterpret_cast<const uint16_t*>(v.data_ptr<at::BFloat16>());
  const auto* qp = reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>());
  at::Tensor keys = at::empty({key_elements}, k.options());
  at::Tensor values = at::empty({value_elements}, v.options());
  auto* packed_k = reinterpret_cast<uint16_t*>(keys.data_ptr<at::BFloat16>());
  auto* packed_v = reinterpret_cast<uint16_t*>(values.data_ptr<at::BFloat16>());
  // A task packs one KV head's group of 16 keys and its 8 pairs of values.
  constexpr int64_t kGroupPairs = kKeyGroup / 2;
  for_each_task(pack_tasks, 8, [&](int64_t b, int64_t local) {
    const Sequence& sq = seqs[b];
    pack_keys(kp, sq.slots, k.stride(0), k.stride(1), sq.shape, packed_k + sq.packed_k, local,
              local + 1);
    pack_values(vp, sq.slots, v.stride(0), v.stride(1), sq.shape, packed_v + sq.packed_v,
                local * kGroupPairs, (local + 1) * kGroupPairs);
  });
  at::Tensor out = at::empty({q.size(0), dims.heads, dims.v_dim}, q.options());
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const int64_t group = dims.heads / dims.kv_heads;
  for_each_task(attend_tasks, 1, [&](int64_t b, int64_t local) {
    const Sequence& sq = seqs[b];
    const Shape& s = sq.shape;
    for_each_row_group(sq, local, qp, q.stride(0), q.stride(1), op,
                       [&](int64_t h, const uint16_t* const* q_rows, uint16_t* const* out_rows,
                           const int64_t* last_key, int64_t rows) {
      const int64_t hk = h / group;
      const uint16_t* head_keys = packed_k + sq.packed_k + hk * s.key_groups * kKeyGroup * s.dim;
      const uint16_t* head_values = packed_v + sq.packed_v + hk * s.key_pairs * 2 * s.v_dim;
      attend_rows(q_rows, last_key, head_keys, head_values, s, static_cast<float>(scale),
                  out_rows, rows);
    });
  });
  return out;
}

#endif  // RADIXLM_PREFILL_ATTENTION

}  // namespace radixlm_prefill

// Whether this build has the bfloat16 kernel (the building CPU has AVX-512 BF16); the
// float32 one (prefill_attention_float32.cpp) is in every build.
bool prefill_attention_available() {
#ifdef RADIXLM_PREFILL_ATTENTION
  return true;
#else
  return false;
#endif
}

// paged_prefill_attention(q (T, H, D), k_buffer (P, H_kv, D), v_buffer (P, H_kv, D_v),
// slots (B, W) int64, seq_lens (B,) int64, extend_lens (B,) int64, scale) -> (T, H, D_v):
// for each sequence b, whose n_b = extend_lens[b] queries are the next n_b rows of q and
// the last n_b of its S_b = seq_lens[b] keys, the keys and values at pool rows
// slots[b, 0 .. S_b), whatever the other sequences are. The new keys and values
// must be in the pool already; T = the sum of extend_lens; entries at j >= S_b are not read.
// All bfloat16 (builds with AVX-512 BF16) or all float32.
at::Tensor paged_prefill_attention(const at::Tensor& q, const at::Tensor& k_buffer,
                                   const at::Tensor& v_buffer, const at::Tensor& slots,
                                   const at::Tensor& seq_lens, const at::Tensor& extend_lens,
                                   double scale) {
  using namespace radixlm_prefill;
  const Shape heads = check_heads(q, k_buffer, v_buffer);
#ifndef RADIXLM_PREFILL_ATTENTION
  TORCH_CHECK(q.scalar_type() == at::kFloat,
              "paged_prefill_attention: bfloat16 needs a CPU with AVX-512 BF16");
#endif
  TORCH_CHECK(slots.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong &&
                  extend_lens.scalar_type() == at::kLong,
              "slots, seq_lens and extend_lens must be int64");
  TORCH_CHECK(slots.dim() == 2 && seq_lens.numel() == slots.size(0) &&
                  extend_lens.numel() == slots.size(0) && slots.size(0) >= 1,
              "slots must be (B, W), seq_lens and extend_lens (B,), B >= 1");
  const at::Tensor table = slots.contiguous();
  const at::Tensor totals = seq_lens.contiguous(), news = extend_lens.contiguous();
  const int64_t* table_p = table.data_ptr<int64_t>();
  const int64_t* total_p = totals.data_ptr<int64_t>();
  const int64_t* new_p = news.data_ptr<int64_t>();
  const int64_t width = table.size(1), rows = k_buffer.size(0);
  TORCH_CHECK(v_buffer.size(0) == rows, "k_buffer and v_buffer must have the same rows");
  std::vector<Sequence> seqs;
  int64_t q_start = 0;
  for (int64_t b = 0; b < table.size(0); ++b) {
    Shape s = heads;
    s.n = new_p[b], s.total = total_p[b];
    TORCH_CHECK(s.n >= 1 && s.n <= s.total && s.total <= width,
                "need 1 <= extend_lens[b] <= seq_lens[b] <= W");
    const int64_t* row = table_p + b * width;
    for (int64_t j = 0; j < s.total; ++j) {
      TORCH_CHECK(row[j] >= 0 && row[j] < rows, "a slot is outside the pool");
    }
    seqs.push_back(Sequence{s, q_start, row});
    q_start += s.n;
  }
  TORCH_CHECK(q_start == q.size(0), "q must have sum(extend_lens) rows");
  if (q.scalar_type() == at::kFloat) {
    return radixlm_prefill_float32::attend_sequences(q, k_buffer, v_buffer, seqs, scale);
  }
#ifdef RADIXLM_PREFILL_ATTENTION
  return attend_sequences(q, k_buffer, v_buffer, seqs, scale);
#else
  return at::Tensor();  // not reached: checked above
#endif
}
