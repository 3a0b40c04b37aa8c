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
#include "rope.h"
#include "silu.h"
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
  for (int64_t c = 0; c < full; c += kNativeLanes) {
    store_value(o + c, loadn(w + c) * round_bf16(load_value(s + c) * scale));
  }
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

}  // namespace

TORCH_LIBRARY_FRAGMENT(batchgen, m) {
  m.def(
      "rms_norm(Tensor x, Tensor weight, float eps, Tensor? residual, ScalarType? out_dtype=None) -> (Tensor, "
      "Tensor)");
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
