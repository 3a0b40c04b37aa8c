// SiLU on the machine's own vector width, shared by SiLU-and-multiply (elementwise.cpp) and the gate/up GEMM that
// applies it to its own output (brgemm_linear.cpp), so that both give the same bits.
#pragma once

#include "vec16.h"

namespace {

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

}  // namespace
