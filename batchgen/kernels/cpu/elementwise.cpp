// Fused elementwise ops of a Llama-family layer for bfloat16 on the CPU: RMSNorm (with the residual add before it),
// SiLU-and-multiply, and RoPE. Each replaces a chain of 4-10 PyTorch ops (one pass over memory each, and a float32
// temporary per step) by one pass. Every step rounds to bfloat16 where the PyTorch code it replaces does
// (batchgen/models/llama.py, rotary.py, following transformers): RoPE, the residual add and SiLU-and-multiply then
// give the same bits as that code (SiLU's exp is another within ~1 ulp, which no bfloat16 input's rounded result
// shows), and RMSNorm differs from it only where its float32 sum, taken in another order, rounds across a bfloat16
// boundary.
//
// Rows are split over threads (at::parallel_for); a row's arithmetic never depends on the other rows.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "bf16_round.h"
#include "vec16.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <tuple>
#include <type_traits>

namespace {

using c10::BFloat16;

// Rows in one thread's share: about 16K elements, so that a decode step's few rows stay on one thread.
inline int64_t grain(int64_t cols) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(cols, 1)); }

// Calls f(X{}, O{}) with X, O the C++ types of `in` and `out` (each bfloat16 or float32).
template <typename F>
void dispatch_value_types(at::ScalarType in, at::ScalarType out, F&& f) {
  const bool in_bf16 = in == at::kBFloat16, out_bf16 = out == at::kBFloat16;
  if (in_bf16 && out_bf16) f(BFloat16{}, BFloat16{});
  if (in_bf16 && !out_bf16) f(BFloat16{}, float{});
  if (!in_bf16 && out_bf16) f(float{}, BFloat16{});
  if (!in_bf16 && !out_bf16) f(float{}, float{});
}

// Checks `t` is a bfloat16 (or, with allow_float32, float32) CPU tensor [rows, cols] with a contiguous last
// dimension (cols < 0: any width).
void check_rows(const at::Tensor& t, const char* name, int64_t cols, bool allow_float32) {
  TORCH_CHECK(t.dim() == 2, "batchgen::", name, " must be 2-D [rows, cols], got shape ", t.sizes());
  TORCH_CHECK((cols < 0 || t.size(1) == cols) && t.stride(1) == 1, "batchgen::", name, " must be [rows, ", cols,
              "] with a contiguous last dimension, got ", t.sizes(), " strides ", t.strides());
  const bool dtype_ok = t.scalar_type() == at::kBFloat16 || (allow_float32 && t.scalar_type() == at::kFloat);
  TORCH_CHECK(dtype_ok && t.device().is_cpu(), "batchgen::", name, " must be a bfloat16",
              allow_float32 ? " or float32" : "", " CPU tensor, got ", t.scalar_type(), " on ", t.device());
}

at::ScalarType output_type(const std::optional<at::ScalarType>& out_dtype, const char* op) {
  const at::ScalarType out = out_dtype.value_or(at::kBFloat16);
  TORCH_CHECK(out == at::kBFloat16 || out == at::kFloat, "batchgen::", op,
              ": out_dtype must be bfloat16 or float32, got ", out);
  return out;
}

// One row of RMSNorm: o = weight * bf16(s * rsqrt(mean(s^2) + eps)), rounded to bfloat16.
template <typename S, typename O>
void norm_row(const S* s, const BFloat16* w, int64_t cols, float eps, O* o) {
  const int64_t full = cols / kNativeLanes * kNativeLanes;
  vnf squares = {};
  for (int64_t c = 0; c < full; c += kNativeLanes) {
    const vnf v = load_value(s + c);
    squares += v * v;
  }
  float tail = 0.f;
  for (int64_t c = full; c < cols; ++c) tail += value(s[c]) * value(s[c]);
  const float scale = 1.f / std::sqrt((hsumn(squares) + tail) / static_cast<float>(cols) + eps);
  for (int64_t c = 0; c < full; c += kNativeLanes) store_value(o + c, loadn(w + c) * round_bf16(load_value(s + c) * scale));
  for (int64_t c = full; c < cols; ++c) store_value(o + c, to_float(w[c]) * round_bf16(value(s[c]) * scale));
}

// out = weight * bf16(s * rsqrt(mean(s^2) + eps)) with s = x, or s = bf16(residual + x) written to `summed`.
// x: bfloat16 or float32 (rounded on load); residual and summed: bfloat16 (summed is x itself without a
// residual); out: out_dtype (default bfloat16).
std::tuple<at::Tensor, at::Tensor> rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps,
                                            const std::optional<at::Tensor>& residual,
                                            std::optional<at::ScalarType> out_dtype) {
  check_rows(x, "rms_norm: x", -1, true);
  const int64_t rows = x.size(0), cols = x.size(1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == cols && weight.is_contiguous() &&
                  weight.scalar_type() == at::kBFloat16,
              "batchgen::rms_norm: weight must be contiguous bfloat16 [", cols, "], got ", weight.scalar_type(), " ",
              weight.sizes());
  at::Tensor summed = x;
  if (residual) {
    check_rows(*residual, "rms_norm: residual", cols, false);
    TORCH_CHECK(residual->size(0) == rows, "batchgen::rms_norm: residual has ", residual->size(0), " rows, x ", rows);
    summed = at::empty({rows, cols}, residual->options());
  }
  at::Tensor out = at::empty({rows, cols}, x.options().dtype(output_type(out_dtype, "rms_norm")));
  const int64_t full = cols / kNativeLanes * kNativeLanes;
  const float feps = static_cast<float>(eps);
  const BFloat16* w = weight.const_data_ptr<BFloat16>();
  dispatch_value_types(x.scalar_type(), out.scalar_type(), [&](auto x_type, auto out_type) {
    using X = decltype(x_type);
    using O = decltype(out_type);
    at::parallel_for(0, rows, grain(cols), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const X* xr = x.const_data_ptr<X>() + r * x.stride(0);
        O* o = out.mutable_data_ptr<O>() + r * out.stride(0);
        if (!residual) {
          norm_row(xr, w, cols, feps, o);
          continue;
        }
        const BFloat16* rr = residual->const_data_ptr<BFloat16>() + r * residual->stride(0);
        BFloat16* sr = summed.mutable_data_ptr<BFloat16>() + r * summed.stride(0);
        for (int64_t c = 0; c < full; c += kNativeLanes) storen(sr + c, loadn(rr + c) + load_value(xr + c));
        for (int64_t c = full; c < cols; ++c) sr[c] = static_cast<BFloat16>(to_float(rr[c]) + value(xr[c]));
        norm_row(static_cast<const BFloat16*>(sr), w, cols, feps, o);
      }
    });
  });
  return {out, summed};
}

// silu(x) = x / (1 + exp(-x)) from e = exp(-|x|) <= 1, which cannot overflow: x / (1 + e) for x >= 0 and
// x * e / (1 + e) for x < 0. exp_nonpositive is 0 below -87, where PyTorch's x / (1 + exp(-x)) is still a tiny
// float down to -88.72 (exp(-x) overflows below): there e = exp(x / 2)^2, a subnormal, as PyTorch's quotient is.
inline vnf silu(vnf x) {
  const vni negative = x < 0.f;
  vnf e = exp_nonpositive(negative ? x : -x);
  const vni deep = x < -87.f;
#if defined(__AVX512F__)
  const bool any_deep = _mm512_movepi32_mask(reinterpret_cast<__m512i>(deep)) != 0;
#elif defined(__AVX__)
  const bool any_deep = _mm256_movemask_ps(reinterpret_cast<__m256>(deep)) != 0;
#else
  bool any_deep = false;
  for (int64_t l = 0; l < kNativeLanes; ++l) any_deep = any_deep || deep[l] != 0;
#endif
  if (any_deep) {
    const vnf half = exp_nonpositive(x * 0.5f);
    e = deep ? (x < -88.72283935546875f ? vnf{} : half * half) : e;
  }
  return (negative ? x * e : x) / (1.f + e);
}

// out = bf16(bf16(silu(gate)) * up) for gate_up = [gate | up], as F.silu(gate) * up in bfloat16; gate_up
// bfloat16 or float32 (rounded on load), out in out_dtype (default bfloat16).
at::Tensor silu_and_mul(const at::Tensor& gate_up, std::optional<at::ScalarType> out_dtype) {
  check_rows(gate_up, "silu_and_mul: gate_up", -1, true);
  const int64_t rows = gate_up.size(0), width = gate_up.size(1);
  TORCH_CHECK(width % 2 == 0, "batchgen::silu_and_mul: gate_up must hold gate and up halves, got a last dimension of ",
              width);
  const int64_t cols = width / 2, full = cols / kNativeLanes * kNativeLanes;
  at::Tensor out = at::empty({rows, cols}, gate_up.options().dtype(output_type(out_dtype, "silu_and_mul")));
  dispatch_value_types(gate_up.scalar_type(), out.scalar_type(), [&](auto in_type, auto out_type) {
    using X = decltype(in_type);
    using O = decltype(out_type);
    at::parallel_for(0, rows, grain(width), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const X* g = gate_up.const_data_ptr<X>() + r * gate_up.stride(0);
        const X* u = g + cols;
        O* o = out.mutable_data_ptr<O>() + r * out.stride(0);
        for (int64_t c = 0; c < full; c += kNativeLanes) {
          store_value(o + c, round_bf16(silu(load_value(g + c))) * load_value(u + c));
        }
        for (int64_t c = full; c < cols; ++c) {
          vnf lane = {};
          lane[0] = value(g[c]);
          store_value(o + c, round_bf16(silu(lane)[0]) * value(u[c]));
        }
      }
    });
  });
  return out;
}

// One head of RoPE in the rotate-half layout: out = bf16(bf16(x * c) + bf16(rotate_half(x) * s)), c and s the
// table rows rounded to bfloat16, as transformers computes q * cos + rotate_half(q) * sin in bfloat16. x is
// bfloat16 or float32 (rounded on load); out is bfloat16.
template <typename X>
inline void rotate_head(const X* x, const float* cos, const float* sin, int64_t head_dim, BFloat16* out) {
  const int64_t half = head_dim / 2;
  if (half % kNativeLanes == 0) {
    for (int64_t c = 0; c < half; c += kNativeLanes) {
      const vnf lo = load_value(x + c), hi = load_value(x + half + c);
      const vnf cos_lo = round_bf16(loadn(cos + c)), cos_hi = round_bf16(loadn(cos + half + c));
      const vnf sin_lo = round_bf16(loadn(sin + c)), sin_hi = round_bf16(loadn(sin + half + c));
      storen(out + c, round_bf16(lo * cos_lo) + round_bf16(-hi * sin_lo));
      storen(out + half + c, round_bf16(hi * cos_hi) + round_bf16(lo * sin_hi));
    }
    return;
  }
  for (int64_t d = 0; d < head_dim; ++d) {
    const float rotated = d < half ? -value(x[d + half]) : value(x[d - half]);
    out[d] = static_cast<BFloat16>(round_bf16(value(x[d]) * round_bf16(cos[d])) +
                                   round_bf16(rotated * round_bf16(sin[d])));
  }
}

void check_heads(const at::Tensor& t, const char* name, int64_t tokens, int64_t head_dim) {
  TORCH_CHECK(t.dim() == 3 && t.size(0) == tokens && t.size(2) == head_dim && t.stride(2) == 1, "batchgen::rotary_embedding: ",
              name, " must be [", tokens, ", heads, ", head_dim, "] with a contiguous last dimension, got ", t.sizes());
  TORCH_CHECK((t.scalar_type() == at::kBFloat16 || t.scalar_type() == at::kFloat) && t.device().is_cpu(),
              "batchgen::rotary_embedding: ", name, " must be a bfloat16 or float32 CPU tensor, got ", t.scalar_type(),
              " on ", t.device());
}

// q [tokens, heads, head_dim] and k [tokens, kv_heads, head_dim], both bfloat16 or both float32 (rounded on
// load), rotated into new contiguous bfloat16 tensors.
// The checks rotary_embedding and rotary_embedding_kv share: positions, q, k and the tables.
void check_rope_inputs(const at::Tensor& positions, const at::Tensor& q, const at::Tensor& k,
                       const at::Tensor& cos_table, const at::Tensor& sin_table) {
  TORCH_CHECK(q.dim() == 3, "batchgen::rotary_embedding: q must be 3-D [tokens, heads, head_dim], got shape ",
              q.sizes());
  const int64_t tokens = positions.numel(), head_dim = q.size(2);
  TORCH_CHECK(positions.dim() == 1 && positions.scalar_type() == at::kLong && positions.is_contiguous(),
              "batchgen::rotary_embedding: positions must be contiguous int64 [tokens], got ", positions.scalar_type(),
              " ", positions.sizes());
  TORCH_CHECK(head_dim > 0 && head_dim % 2 == 0, "batchgen::rotary_embedding: head_dim must be even, got ", head_dim);
  check_heads(q, "q", tokens, head_dim);
  check_heads(k, "k", tokens, head_dim);
  TORCH_CHECK(q.scalar_type() == k.scalar_type(), "batchgen::rotary_embedding: q and k must have one dtype, got ",
              q.scalar_type(), " and ", k.scalar_type());
  for (const at::Tensor* t : {&cos_table, &sin_table}) {
    TORCH_CHECK(t->dim() == 2 && t->size(1) == head_dim && t->is_contiguous() && t->scalar_type() == at::kFloat,
                "batchgen::rotary_embedding: cos/sin tables must be contiguous float32 [positions, ", head_dim,
                "], got ", t->scalar_type(), " ", t->sizes());
  }
  TORCH_CHECK(sin_table.size(0) == cos_table.size(0), "batchgen::rotary_embedding: the cos and sin tables must have ",
              "the same rows, got ", cos_table.size(0), " and ", sin_table.size(0));
  const int64_t* pos = positions.const_data_ptr<int64_t>();
  const int64_t table_rows = cos_table.size(0);
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(pos[t] >= 0 && pos[t] < table_rows, "batchgen::rotary_embedding: position ", pos[t],
                " is outside the tables' ", table_rows, " rows");
  }
}

std::tuple<at::Tensor, at::Tensor> rotary_embedding(const at::Tensor& positions, const at::Tensor& q,
                                                    const at::Tensor& k, const at::Tensor& cos_table,
                                                    const at::Tensor& sin_table) {
  check_rope_inputs(positions, q, k, cos_table, sin_table);
  const int64_t tokens = positions.numel(), head_dim = q.size(2);
  const int64_t* pos = positions.const_data_ptr<int64_t>();
  const auto out_options = q.options().dtype(at::kBFloat16);
  at::Tensor q_out = at::empty(q.sizes(), out_options), k_out = at::empty(k.sizes(), out_options);
  const int64_t q_heads = q.size(1), k_heads = k.size(1);
  dispatch_value_types(q.scalar_type(), at::kBFloat16, [&](auto in_type, auto) {
    using X = decltype(in_type);
    at::parallel_for(0, tokens, grain((q_heads + k_heads) * head_dim), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const float* cos = cos_table.const_data_ptr<float>() + pos[t] * head_dim;
        const float* sin = sin_table.const_data_ptr<float>() + pos[t] * head_dim;
        for (int64_t h = 0; h < q_heads; ++h) {
          rotate_head(q.const_data_ptr<X>() + t * q.stride(0) + h * q.stride(1), cos, sin, head_dim,
                      q_out.mutable_data_ptr<BFloat16>() + (t * q_heads + h) * head_dim);
        }
        for (int64_t h = 0; h < k_heads; ++h) {
          rotate_head(k.const_data_ptr<X>() + t * k.stride(0) + h * k.stride(1), cos, sin, head_dim,
                      k_out.mutable_data_ptr<BFloat16>() + (t * k_heads + h) * head_dim);
        }
      }
    });
  });
  return {q_out, k_out};
}

// RoPE with the KV store folded in: q rotated into a new bfloat16 tensor (returned), k rotated and v (rounded to
// bfloat16) written straight into one layer of the head-major pool, k_cache/v_cache [kv_heads, slots, head_dim],
// at slots loc [tokens]: what rotary_embedding followed by TokenToKVPool.set_kv does, without k's temporary and the
// two index copies.
at::Tensor rotary_embedding_kv(const at::Tensor& positions, const at::Tensor& q, const at::Tensor& k,
                               const at::Tensor& v, const at::Tensor& cos_table, const at::Tensor& sin_table,
                               const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& loc) {
  constexpr const char* op = "batchgen::rotary_embedding_kv: ";
  check_rope_inputs(positions, q, k, cos_table, sin_table);
  const int64_t tokens = positions.numel(), head_dim = q.size(2), kv_heads = k.size(1);
  check_heads(v, "v", tokens, head_dim);
  TORCH_CHECK(v.scalar_type() == k.scalar_type() && v.size(1) == kv_heads, op, "v must be like k, got ",
              v.scalar_type(), " ", v.sizes());
  for (const at::Tensor* t : {&k_cache, &v_cache}) {
    TORCH_CHECK(t->dim() == 3 && t->size(0) == kv_heads && t->size(2) == head_dim && t->stride(2) == 1 &&
                    t->scalar_type() == at::kBFloat16 && t->device().is_cpu(),
                op, "k_cache and v_cache must be bfloat16 CPU [", kv_heads, ", slots, ", head_dim,
                "] with a contiguous last dimension, got ", t->scalar_type(), " ", t->sizes());
  }
  TORCH_CHECK(v_cache.sizes() == k_cache.sizes() && v_cache.strides() == k_cache.strides(), op,
              "k_cache and v_cache must have one shape and strides");
  TORCH_CHECK(loc.dim() == 1 && loc.numel() == tokens && loc.scalar_type() == at::kLong && loc.is_contiguous(), op,
              "loc must be contiguous int64 [", tokens, "], got ", loc.scalar_type(), " ", loc.sizes());
  const int64_t* slots = loc.const_data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(slots[t] >= 0 && slots[t] < k_cache.size(1), op, "slot ", slots[t], " is outside the pool's ",
                k_cache.size(1), " slots");
  }
  const int64_t* pos = positions.const_data_ptr<int64_t>();
  at::Tensor q_out = at::empty(q.sizes(), q.options().dtype(at::kBFloat16));
  const int64_t q_heads = q.size(1), head_stride = k_cache.stride(0), slot_stride = k_cache.stride(1);
  BFloat16* k_pool = k_cache.mutable_data_ptr<BFloat16>();
  BFloat16* v_pool = v_cache.mutable_data_ptr<BFloat16>();
  dispatch_value_types(q.scalar_type(), at::kBFloat16, [&](auto in_type, auto) {
    using X = decltype(in_type);
    at::parallel_for(0, tokens, grain((q_heads + 2 * kv_heads) * head_dim), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const float* cos = cos_table.const_data_ptr<float>() + pos[t] * head_dim;
        const float* sin = sin_table.const_data_ptr<float>() + pos[t] * head_dim;
        for (int64_t h = 0; h < q_heads; ++h) {
          rotate_head(q.const_data_ptr<X>() + t * q.stride(0) + h * q.stride(1), cos, sin, head_dim,
                      q_out.mutable_data_ptr<BFloat16>() + (t * q_heads + h) * head_dim);
        }
        for (int64_t h = 0; h < kv_heads; ++h) {
          const int64_t dst = h * head_stride + slots[t] * slot_stride;
          rotate_head(k.const_data_ptr<X>() + t * k.stride(0) + h * k.stride(1), cos, sin, head_dim, k_pool + dst);
          const X* src = v.const_data_ptr<X>() + t * v.stride(0) + h * v.stride(1);
          if constexpr (std::is_same_v<X, BFloat16>) {
            std::memcpy(v_pool + dst, src, head_dim * sizeof(BFloat16));
          } else {
            for (int64_t d = 0; d < head_dim; ++d) v_pool[dst + d] = static_cast<BFloat16>(src[d]);
          }
        }
      }
    });
  });
  return q_out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(batchgen, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps, Tensor? residual, ScalarType? out_dtype=None) -> (Tensor, Tensor)");
  m.def("silu_and_mul(Tensor gate_up, ScalarType? out_dtype=None) -> Tensor");
  m.def(
      "rotary_embedding(Tensor positions, Tensor q, Tensor k, Tensor cos_table, Tensor sin_table) -> (Tensor, "
      "Tensor)");
  m.def(
      "rotary_embedding_kv(Tensor positions, Tensor q, Tensor k, Tensor v, Tensor cos_table, Tensor sin_table, "
      "Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor loc) -> Tensor");
}

TORCH_LIBRARY_IMPL(batchgen, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("rotary_embedding", &rotary_embedding);
  m.impl("rotary_embedding_kv", &rotary_embedding_kv);
}
