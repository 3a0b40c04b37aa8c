// y = x W^T + b for bfloat16 x and W, out in float32 or rounded to bfloat16, with every output's reduction order
// fixed whatever the other rows: the linear layers of a bfloat16 model under --deterministic, on CPUs where
// PyTorch's brgemm (oneDNN's batch-reduce GEMM ukernel) runs bfloat16: tdpbf16ps on AMX tiles, vdpbf16ps with
// AVX512-BF16.
//
// oneDNN's full GEMM picks its kernel and blocking by the row count, so a row's bits change with the rows beside it;
// a brgemm call of m rows x n columns x K walks K in one fixed order for each output, whatever m (the same property
// the attention kernel's brgemm path rests on, attention_brgemm.h). So: W is packed once into blocks of n columns
// in the VNNI layout brgemm takes for B ([K/2][n][2]: the pairs (k 2p, k 2p + 1) of a column side by side), and a
// call computes up to kRowBlock rows of x against one block (or a part of one, for_each_tile), the
// whole of K at once. Tiles of many rows, and of one group of few rows, run on vdpbf16ps directly where that gives
// brgemm's bits (dot_tiles.h), requesting weights ahead of their use as they go.
// brgemm_linear_silu_and_mul runs a SwiGLU MLP's gate/up projection with its activation in the same pass.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/native/CPUBlas.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "bf16_round.h"
#include "brgemm_bf16.h"
#include "dot_tiles.h"
#include "row_tiles.h"
#include "silu.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

// brgemm's result for tile t of x [M, K] against packed blocks w of `cols` columns, into acc (ld cols), while the
// block at `next` (`next_bytes`) is requested, by dot_tile where it gives brgemm's bits here.
inline void tile_product(const Tile& t, const c10::BFloat16* x, int64_t K, const c10::BFloat16* w, int64_t cols,
                         float* acc, const c10::BFloat16* next, int64_t next_bytes) {
  const c10::BFloat16* block = w + t.block * cols * K;
  if (dot_tile_takes(t.rows) && t.width % 16 == 0 && cols <= 64 && dot_tiles_match_brgemm()) {
    dot_tile(t.rows, x + t.m0 * K, K, block, cols, t.offset, t.width, acc, cols,
             reinterpret_cast<const char*>(next), next_bytes);
  } else {
    at::native::cpublas::brgemm(t.rows, t.width, K, K, cols, cols, false, x + t.m0 * K, block + t.offset * 2, acc);
  }
}

// The checks both ops make of x [rows, K] and the packed weight [blocks, K / 2, columns, 2].
void check_operands(const at::Tensor& x, const at::Tensor& packed, const char* op) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16, op,
              ": x and packed must be bfloat16, got ", x.scalar_type(), " and ", packed.scalar_type());
  TORCH_CHECK(x.dim() == 2 && packed.dim() == 4 && packed.size(3) == 2 && packed.size(1) * 2 == x.size(1), op,
              ": x [rows, K] and packed [blocks, K / 2, columns, 2] must agree on K, got ", x.sizes(), " and ",
              packed.sizes());
  TORCH_CHECK(x.size(1) > 0, op, ": x has no columns");
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu() && x.is_contiguous() && packed.is_contiguous(), op,
              ": x and packed must be contiguous CPU tensors");
}

at::Tensor brgemm_linear(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                         const c10::optional<at::Tensor>& bias, bool round_to_bf16) {
  check_operands(x, packed, "batchgen::brgemm_linear");
  const int64_t M = x.size(0), K = x.size(1), blocks = packed.size(0), cols = packed.size(2), N = out_features;
  TORCH_CHECK(N > (blocks - 1) * cols && N <= blocks * cols, "batchgen::brgemm_linear: ", blocks, " blocks of ",
              cols, " columns cannot hold out_features ", N);
  const float* b = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->dim() == 1 && bias->size(0) == N && bias->is_contiguous(),
                "batchgen::brgemm_linear: bias must be float32 [out_features], got ", bias->scalar_type(), " ",
                bias->sizes());
    b = bias->const_data_ptr<float>();
  }
  at::Tensor out = at::empty({M, N}, x.options().dtype(round_to_bf16 ? at::kBFloat16 : at::kFloat));
  const auto* xp = reinterpret_cast<const c10::BFloat16*>(x.const_data_ptr());
  const auto* wp = reinterpret_cast<const c10::BFloat16*>(packed.const_data_ptr());
  auto* out_bf16 = reinterpret_cast<c10::BFloat16*>(out.mutable_data_ptr());
  auto* out_f32 = reinterpret_cast<float*>(out.mutable_data_ptr());
  for_each_tile(M, N, blocks, cols, kRowBlock * cols, [&](const Tile& t, float* acc) {
    const int64_t n0 = t.block * cols + t.offset;
    tile_product(t, xp, K, wp, cols, acc, wp + (t.block + 1) * cols * K, t.block + 1 < blocks ? cols * K * 2 : 0);
    const float* tile_bias = b != nullptr ? b + n0 : nullptr;
    if (round_to_bf16) {
      store_block(acc, cols, tile_bias, out_bf16 + t.m0 * N + n0, N, t.rows, t.width);
    } else {
      store_block(acc, cols, tile_bias, out_f32 + t.m0 * N + n0, N, t.rows, t.width);
    }
  });
  return out;
}

// SwiGLU's activation over the gate/up projection: bf16(bf16(silu(g)) * u) for g and u the bfloat16-rounded
// outputs of x's gate and up halves, the bits of brgemm_linear (rounded) then silu_and_mul (elementwise.cpp) in one
// pass: each task computes a row block's gate and up column blocks j and j + blocks / 2 (the packed gate rows come
// first, and each half is a whole number of blocks) and writes their product, so the [rows, 2 x intermediate]
// projection never reaches memory.
at::Tensor brgemm_linear_silu_and_mul(const at::Tensor& x, const at::Tensor& packed, int64_t intermediate) {
  constexpr const char* op = "batchgen::brgemm_linear_silu_and_mul";
  check_operands(x, packed, op);
  const int64_t M = x.size(0), K = x.size(1), blocks = packed.size(0), cols = packed.size(2);
  TORCH_CHECK(intermediate > 0 && intermediate % cols == 0 && blocks * cols == 2 * intermediate &&
                  cols % kNativeLanes == 0,
              op, ": ", blocks, " blocks of ", cols, " columns must hold gate and up halves of intermediate ",
              intermediate, ", each a whole number of blocks (of a multiple of ", kNativeLanes, " columns)");
  at::Tensor out = at::empty({M, intermediate}, x.options());
  const auto* xp = reinterpret_cast<const c10::BFloat16*>(x.const_data_ptr());
  const auto* wp = reinterpret_cast<const c10::BFloat16*>(packed.const_data_ptr());
  auto* op_out = reinterpret_cast<c10::BFloat16*>(out.mutable_data_ptr());
  const int64_t half = blocks / 2;
  for_each_tile(M, intermediate, half, cols, 2 * kRowBlock * cols, [&](const Tile& t, float* gate) {
    float* up = gate + kRowBlock * cols;
    // The up block is what the gate's pass requests, the next gate block what the up block's does.
    const int64_t block_bytes = cols * K * 2;
    tile_product(t, xp, K, wp, cols, gate, wp + (t.block + half) * cols * K, block_bytes);
    const Tile up_tile{t.m0, t.rows, t.block + half, t.offset, t.width};
    tile_product(up_tile, xp, K, wp, cols, up, wp + (t.block + 1) * cols * K, t.block + 1 < half ? block_bytes : 0);
    for (int64_t i = 0; i < t.rows; ++i) {
      c10::BFloat16* o = op_out + (t.m0 + i) * intermediate + t.block * cols + t.offset;
      for (int64_t c = 0; c < t.width; c += kNativeLanes) {
        const vnf g = round_bf16(loadn(gate + i * cols + c)), u = round_bf16(loadn(up + i * cols + c));
        storen(o + c, round_bf16(silu(g)) * u);
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(batchgen, m) {
  m.def(
      "brgemm_linear(Tensor x, Tensor packed, int out_features, Tensor? bias, bool round_to_bf16) -> Tensor");
  m.def("brgemm_linear_silu_and_mul(Tensor x, Tensor packed, int intermediate) -> Tensor");
  // Whether brgemm runs bfloat16 here: brgemm_linear and the attention kernel's brgemm path need it.
  m.def("brgemm_bf16_runs() -> bool", &brgemm_bf16_runs);
}

TORCH_LIBRARY_IMPL(batchgen, CPU, m) {
  m.impl("brgemm_linear", &brgemm_linear);
  m.impl("brgemm_linear_silu_and_mul", &brgemm_linear_silu_and_mul);
}
