// What the C++ code calling PyTorch's brgemm (oneDNN's batch-reduce GEMM ukernel) in bfloat16 shares
// (attention_brgemm.h, brgemm_linear.cpp): whether it runs on this CPU, and handing the tile configuration back.
#pragma once

#include <ATen/native/CPUBlas.h>
#include <c10/util/BFloat16.h>

#include <exception>
#include <vector>

namespace {

// Whether brgemm runs bfloat16 on this CPU (tdpbf16ps on AMX tiles, vdpbf16ps with AVX512-BF16), tried once with
// a tiny call: PyTorch raises a c10::Error without AVX-512 or without the ukernel, and oneDNN a dnnl::error (a
// std::exception) on AVX-512 without BF16, where it cannot generate the kernel. (PyTorch's own
// cpublas::could_pack asks for AMX, which the unpacked calls here do not need.)
inline bool brgemm_bf16_runs() {
  static const bool runs = [] {
    const std::vector<c10::BFloat16> a(2, c10::BFloat16(1.0f)), w(32, c10::BFloat16(1.0f));
    std::vector<float> c(16);
    try {
      at::native::cpublas::brgemm(1, 16, 2, 2, 16, 16, false, a.data(), w.data(), c.data());
      at::native::cpublas::brgemm_release();
    } catch (const std::exception&) {
      return false;
    }
    return c[0] == 2.0f;
  }();
  return runs;
}

// Hands an AMX tile configuration back when a thread's brgemm calls end, an exception included (a no-op elsewhere).
struct ReleaseOnExit {
  ~ReleaseOnExit() { at::native::cpublas::brgemm_release(); }
};

}  // namespace
