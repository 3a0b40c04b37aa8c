// bfloat16 rounding for the fused elementwise ops (elementwise.cpp, rope.h), how they split rows over threads,
// and the loads and stores of "the float32 carrier": values that are bfloat16 in meaning, held in float32 between
// a GEMM and these ops.
#pragma once

#include "vec16.h"

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

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

// x rounded to bfloat16 and back: the value a bfloat16 PyTorch op hands to the next one. Rounded to nearest even,
// NaN kept a quiet NaN, as c10::BFloat16 rounds; kept in the float32 lanes (narrowing to 16 bits and widening
// again costs shuffles where AVX2 has no narrowing move).
inline vnf round_bf16(vnf x) {
  const vnu bits = reinterpret_cast<vnu>(x);
  const vnu rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) & 0xffff0000u;
  return reinterpret_cast<vnf>(x == x ? rounded : vnu{} + 0x7fc00000u);
}

// float32 lanes rounded to bfloat16: round_bf16's upper halves.
inline vnh to_bf16(vnf x) { return __builtin_convertvector(reinterpret_cast<vnu>(round_bf16(x)) >> 16, vnh); }

inline void storen(BFloat16* p, vnf x) {
  const vnh h = to_bf16(x);
  std::memcpy(p, &h, sizeof(h));
}

inline float round_bf16(float x) { return static_cast<float>(static_cast<BFloat16>(x)); }

// Where a GEMM runs in float32 for a bfloat16 model (batchgen/models/packed_linear.py), its output reaches these
// ops unrounded and their outputs feed the next GEMM as float32 ("the float32 carrier"): each op rounds such an
// input to bfloat16 on load and such an output on store, so the values are those of the all-bfloat16 chain and
// the casts around the GEMMs are gone. load_value/store_value take bfloat16 (as is) or float32 (rounded).
inline vnf load_value(const BFloat16* p) { return loadn(p); }
inline vnf load_value(const float* p) { return round_bf16(loadn(p)); }
inline float value(BFloat16 x) { return to_float(x); }
inline float value(float x) { return round_bf16(x); }
inline void store_value(BFloat16* p, vnf x) { storen(p, x); }
inline void store_value(float* p, vnf x) {
  const vnf rounded = round_bf16(x);
  std::memcpy(p, &rounded, sizeof(rounded));
}
inline void store_value(BFloat16* p, float x) { *p = static_cast<BFloat16>(x); }
inline void store_value(float* p, float x) { *p = round_bf16(x); }

}  // namespace
