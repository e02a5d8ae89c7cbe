// Fused CPU kernels for the small operations of a decode step (see fused_ops.py).
//
// Each replaces a chain of torch operations whose cost on a CPU is their dispatch, not their
// arithmetic. Arithmetic is float32 whatever the storage type (float32, bfloat16, float16),
// in ATen's SIMD vectors (the build defines CPU_CAPABILITY for the building CPU); results and
// intermediates are rounded to the storage type where torch's chains round them, so bfloat16
// outputs equal torch's but where a float32 sum is ordered differently.

#include "common.h"
#include "kernels.h"

namespace {

using radixlm_vec::dot;
using radixlm_vec::kLanes;
using radixlm_vec::load;
using radixlm_vec::Vec;

// Row kernels give each thread at least torch's grain of elements.
constexpr int64_t kElementGrain = 32768;  // torch's at::internal::GRAIN_SIZE

// The row loops below step by kStep values: one vector of a 16-bit type, two of float32,
// so that a 16-bit row is read and written in whole vectors.
constexpr int64_t kStep = 2 * kLanes;

// kStep values as two float32 vectors.
struct VecPair {
  Vec lo, hi;
};

inline VecPair operator+(const VecPair& a, const VecPair& b) { return {a.lo + b.lo, a.hi + b.hi}; }
inline VecPair operator*(const VecPair& a, const VecPair& b) { return {a.lo * b.lo, a.hi * b.hi}; }
inline VecPair operator*(const VecPair& a, const Vec& b) { return {a.lo * b, a.hi * b}; }

// kStep values from p, widened to float32.
template <typename T>
inline VecPair load_step(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return {Vec::loadu(p), Vec::loadu(p + kLanes)};
  } else {
    static_assert(at::vec::Vectorized<T>::size() == kStep, "a 16-bit vector holds kStep values");
    auto [lo, hi] = at::vec::convert_to_float<T>(at::vec::Vectorized<T>::loadu(p));
    return {lo, hi};
  }
}

// kStep values to p, rounded to T.
template <typename T>
inline void store_step(T* p, const VecPair& v) {
  if constexpr (std::is_same_v<T, float>) {
    v.lo.store(p);
    v.hi.store(p + kLanes);
  } else {
    at::vec::convert_from_float<T>(v.lo, v.hi).store(p);
  }
}

// v rounded to T and widened back (in registers): where torch's chain of operations stores
// an intermediate.
template <typename T>
inline VecPair round_step(const VecPair& v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
    auto [lo, hi] = at::vec::convert_to_float<T>(at::vec::convert_from_float<T>(v.lo, v.hi));
    return {lo, hi};
  }
}

template <typename T>
inline float round_to(float v) {
  return static_cast<float>(static_cast<T>(v));
}

// y = x / sqrt(mean(x^2) + eps) * w over one row of d (w stored as T or as float32).
template <typename T, typename W>
void norm_row(const T* x, const W* w, T* y, int64_t d, float eps) {
  const float scale = 1.f / std::sqrt(dot(x, x, d) / static_cast<float>(d) + eps);
  const Vec scale_vec(scale);
  int64_t i = 0;
  for (; i + kStep <= d; i += kStep) {
    store_step(y + i, load_step(x + i) * scale_vec * load_step(w + i));
  }
  for (; i < d; ++i) y[i] = static_cast<T>(load(x, i) * scale * load(w, i));
}

// Rows [begin, end) of (rows, d) x: s = x + residual (rounded, if residual is given), y = norm(s).
template <typename T, typename W>
void norm_rows(const T* x, const T* residual, const W* w, T* s, T* y, int64_t begin,
               int64_t end, int64_t d, float eps) {
  for (int64_t r = begin; r < end; ++r) {
    const T* row = x + r * d;
    if (residual != nullptr) {
      const T* res = residual + r * d;
      T* sum = s + r * d;
      int64_t i = 0;
      for (; i + kStep <= d; i += kStep) {
        store_step(sum + i, load_step(row + i) + load_step(res + i));
      }
      for (; i < d; ++i) sum[i] = static_cast<T>(load(row, i) + load(res, i));
      row = sum;
    }
    norm_row(row, w, y + r * d, d, eps);
  }
}

// out[i] = a[i] * c[i] + b[i] * s[i] over n, the product a * c rounded to T first (as
// apply_rotary's `x * cos` is, before its addcmul).
template <typename T>
inline void rotate_part(const T* a, const T* b, const T* c, const T* s, T* out, int64_t n) {
  int64_t i = 0;
  for (; i + kStep <= n; i += kStep) {
    const VecPair scaled = round_step<T>(load_step(a + i) * load_step(c + i));
    store_step(out + i, scaled + load_step(b + i) * load_step(s + i));
  }
  for (; i < n; ++i) {
    out[i] = static_cast<T>(round_to<T>(load(a, i) * load(c, i)) + load(b, i) * load(s, i));
  }
}

// Rows [begin, end) of (T, H) heads of d: y = x * cos + (x2, x1) * signed_sin.
template <typename T>
void rotate_rows(const T* x, const T* cos, const T* sin, T* y, int64_t begin, int64_t end,
                 int64_t heads, int64_t d, int64_t token_stride, int64_t head_stride) {
  const int64_t half = d / 2;
  for (int64_t row = begin; row < end; ++row) {
    const int64_t t = row / heads, h = row % heads;
    const T* in = x + t * token_stride + h * head_stride;
    const T* c = cos + t * d;
    const T* s = sin + t * d;
    T* out = y + row * d;
    rotate_part(in, in + half, c, s, out, half);
    rotate_part(in + half, in, c + half, s + half, out + half, half);
  }
}

// exp(v) for silu in storage type T: ATen's faster exp (exp_u20, the one torch's flash
// attention uses) for bfloat16, whose silu, rounded, then equals F.silu's for every finite
// bfloat16 (checked exhaustively by the tests; faster on the default model's 512-token
// gate_up: benchmarks/RESULTS.md); the exact exp (torch's) for the other types.
template <typename T>
inline Vec silu_exp(const Vec& v) {
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    return v.exp_u20();
  } else {
    return v.exp();
  }
}

// Rows [begin, end) of (T, 2 I) gate|up: y = silu(gate) * up.
template <typename T>
void silu_mul_rows(const T* x, T* y, int64_t begin, int64_t end, int64_t width,
                   int64_t row_stride) {
  const Vec one(1.f);
  for (int64_t r = begin; r < end; ++r) {
    const T* gate = x + r * row_stride;
    const T* up = gate + width;
    T* out = y + r * width;
    int64_t i = 0;
    for (; i + kStep <= width; i += kStep) {  // silu(gate) rounded to T, as F.silu's is
      const VecPair g = load_step(gate + i);
      const VecPair silu{g.lo / (one + silu_exp<T>(g.lo.neg())),
                         g.hi / (one + silu_exp<T>(g.hi.neg()))};
      store_step(out + i, round_step<T>(silu) * load_step(up + i));
    }
    for (; i < width; ++i) {
      const float g = load(gate, i);
      out[i] = static_cast<T>(round_to<T>(g / (1.f + std::exp(-g))) * load(up, i));
    }
  }
}

void check_norm_args(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "CPU tensors expected");
  TORCH_CHECK(x.scalar_type() == weight.scalar_type() || weight.scalar_type() == at::kFloat,
              "weight must be x's dtype or float32");
  TORCH_CHECK(weight.dim() == 1 && x.dim() >= 1 && x.size(-1) == weight.size(0),
              "weight must be (d,) for x (..., d)");
}

// How many times a norm's or RoPE's output (the row grain's unit) one of silu_mul's costs.
constexpr int64_t kSiluCost = 4;

// Rows of row_size outputs a thread takes at least: torch's grain of elements.
int64_t row_grain(int64_t row_size) {
  return std::max<int64_t>(1, kElementGrain / std::max<int64_t>(row_size, 1));
}

std::tuple<at::Tensor, at::Tensor> norm(const at::Tensor& x, const at::Tensor* residual,
                                        const at::Tensor& weight, double eps) {
  check_norm_args(x, weight);
  const int64_t d = x.size(-1);
  const at::Tensor a = x.contiguous();
  const at::Tensor b = residual != nullptr ? residual->contiguous() : at::Tensor();
  const at::Tensor w = weight.contiguous();
  at::Tensor sum = residual != nullptr ? at::empty_like(a) : at::Tensor();
  at::Tensor out = at::empty_like(a);
  const int64_t rows = d == 0 ? 0 : a.numel() / d;
  DISPATCH_STORAGE_TYPES(x.scalar_type(), "rms_norm", [&] {
    const scalar_t* bp = residual != nullptr ? b.data_ptr<scalar_t>() : nullptr;
    scalar_t* sp = residual != nullptr ? sum.data_ptr<scalar_t>() : nullptr;
    const bool wide = w.scalar_type() == at::kFloat;
    at::parallel_for(0, rows, row_grain(d), [&](int64_t begin, int64_t end) {
      if (wide) {
        norm_rows(a.data_ptr<scalar_t>(), bp, w.data_ptr<float>(), sp,
                  out.data_ptr<scalar_t>(), begin, end, d, static_cast<float>(eps));
      } else {
        norm_rows(a.data_ptr<scalar_t>(), bp, w.data_ptr<scalar_t>(), sp,
                  out.data_ptr<scalar_t>(), begin, end, d, static_cast<float>(eps));
      }
    });
  });
  return {out, sum};
}

}  // namespace

// rms_norm(x (..., d), weight (d,)) -> (..., d): F.rms_norm's result (one rounding). The
// weight is x's dtype or float32 (then x / rms(x) * weight is taken in float32 and rounded
// once, as Gemma's norm in float32 then cast back).
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  return std::get<0>(norm(x, nullptr, weight, eps));
}

// add_rms_norm(x, residual, weight) -> (rms_norm(s), s), s = x + residual rounded to the
// storage type as torch's `x + residual` rounds it; x and residual (..., d) alike.
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.sizes() == residual.sizes() && x.scalar_type() == residual.scalar_type(),
              "x and residual differ in shape or dtype");
  return norm(x, &residual, weight, eps);
}

// rotary(x (T, H, D), cos (T, 1, D), signed_sin (T, 1, D)) -> (T, H, D): the "rotate half"
// RoPE of rotary_embedding.apply_rotary, x * cos + (x2, x1) * signed_sin (x may be a view
// with unit stride in D).
at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& signed_sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.size(2) % 2 == 0,
              "x must be (T, H, D) with even D and unit stride in D");
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == cos.scalar_type() &&
                  x.scalar_type() == signed_sin.scalar_type(), "x, cos and sin dtypes differ");
  const int64_t tokens = x.size(0), heads = x.size(1), d = x.size(2);
  TORCH_CHECK(cos.numel() == tokens * d && signed_sin.numel() == tokens * d,
              "cos and sin must be (T, 1, D)");
  const at::Tensor c = cos.contiguous();
  const at::Tensor s = signed_sin.contiguous();
  at::Tensor out = at::empty({tokens, heads, d}, x.options());
  DISPATCH_STORAGE_TYPES(x.scalar_type(), "rotary", [&] {
    at::parallel_for(0, tokens * heads, row_grain(d), [&](int64_t begin, int64_t end) {
      rotate_rows(x.data_ptr<scalar_t>(), c.data_ptr<scalar_t>(), s.data_ptr<scalar_t>(),
                  out.data_ptr<scalar_t>(), begin, end, heads, d, x.stride(0), x.stride(1));
    });
  });
  return out;
}

// silu_mul(gate_up (T, 2 I)) -> (T, I): silu(gate_up[:, :I]) * gate_up[:, I:]. An output
// costs about kSiluCost times a norm's or RoPE's (an exponential and a division), so
// threads share rows from a quarter of the grain on (16 rows of the default model's 1536
// take about half as long on two threads as on one: benchmarks/RESULTS.md).
at::Tensor silu_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0 && gate_up.stride(1) == 1,
              "gate_up must be (T, 2 I) with unit stride in its last dim");
  TORCH_CHECK(gate_up.device().is_cpu(), "a CPU tensor expected");
  const int64_t rows = gate_up.size(0), width = gate_up.size(1) / 2;
  at::Tensor out = at::empty({rows, width}, gate_up.options());
  DISPATCH_STORAGE_TYPES(gate_up.scalar_type(), "silu", [&] {
    at::parallel_for(0, rows, row_grain(kSiluCost * width), [&](int64_t begin, int64_t end) {
      silu_mul_rows(gate_up.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), begin, end, width,
                    gate_up.stride(0));
    });
  });
  return out;
}

// scatter_rows(buffer (N, ...), slots (T,) int64, rows (T, ...)): buffer[slots[t]] = rows[t],
// as buffer.index_copy_(0, slots, rows) (a KV pool's store); buffer contiguous, each row of
// rows contiguous (rows may be a view with any stride between rows), slots in [0, N).
void scatter_rows(at::Tensor& buffer, const at::Tensor& slots, const at::Tensor& rows) {
  TORCH_CHECK(buffer.device().is_cpu() && rows.device().is_cpu() && slots.device().is_cpu(),
              "CPU tensors expected");
  TORCH_CHECK(buffer.scalar_type() == rows.scalar_type(), "buffer and rows dtypes differ");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1, "slots must be (T,) int64");
  TORCH_CHECK(buffer.is_contiguous() && buffer.dim() >= 1, "buffer must be contiguous");
  TORCH_CHECK(rows.dim() == buffer.dim() && rows.size(0) == slots.size(0) &&
                  rows.sizes().slice(1) == buffer.sizes().slice(1),
              "rows must be (T, ...) with buffer's row shape");
  const int64_t count = rows.size(0);
  if (count == 0) return;
  const at::Tensor source = rows[0].is_contiguous() ? rows : rows.contiguous();
  const at::Tensor index = slots.contiguous();
  const int64_t* slot_p = index.data_ptr<int64_t>();
  const int64_t pool = buffer.size(0);
  for (int64_t t = 0; t < count; ++t) {
    TORCH_CHECK(slot_p[t] >= 0 && slot_p[t] < pool, "slot out of the buffer");
  }
  const int64_t row_bytes = buffer.numel() / std::max<int64_t>(pool, 1) * buffer.element_size();
  const int64_t source_stride = source.stride(0) * source.element_size();
  const char* from = static_cast<const char*>(source.data_ptr());
  char* to = static_cast<char*>(buffer.data_ptr());
  const int64_t grain = std::max<int64_t>(1, kElementGrain * 4 / std::max<int64_t>(row_bytes, 1));
  at::parallel_for(0, count, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      std::memcpy(to + slot_p[t] * row_bytes, from + t * source_stride, row_bytes);
    }
  });
}
