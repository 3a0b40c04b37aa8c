// y = x W^T + b in float32 for x [M, K] (float32, or the weight's dtype) and W kept in bfloat16 or float16: the
// linear layers of a half-precision model on CPUs where those dtypes' GEMMs run in float32 (no BF16 units: AVX2
// alone, or AVX-512 without BF16), for every row count. W is read in its own dtype, half the bytes of a float32
// copy, and widened to float32; products and sums are float32.
//
// Every output is one chain of fused multiply-adds over k = 0 .. K - 1 from zero, then the bias: the sum PyTorch's
// float32 brgemm (oneDNN's batch-reduce GEMM ukernel) forms, one FMA per k into one accumulator per output. So an
// output's bits depend on neither the other rows of the call nor the route that computed it:
// - rounds of more than kStreamRows rows: each tile of up to 128 rows x one block of W (row_tiles.h) widens its
//   block to float32 in a buffer that stays in L2 and runs brgemm on it;
// - rounds of up to kStreamRows rows are bound by reading W, and brgemm on a widened copy reads it twice: stream
//   tiles walk W once per group of up to kGroupRows rows in the same chain of FMAs, in registers, requesting the lines
//   they will read a fixed distance ahead (on AVX2 a group of 3 rows or more walks each unit's columns in two
//   halves, the second from cache). brgemm is checked at run time to form that chain (routes_agree); where it does
//   not, every round takes stream tiles.
// W is packed as W^T in blocks of kColumnBlock columns, [blocks][K][kColumnBlock] (half_linear.py), the last block
// padded with zero columns.

#include <ATen/Context.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/native/CPUBlas.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "row_tiles.h"
#include "vec16.h"

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <exception>
#include <utility>
#include <vector>

namespace {

constexpr int64_t kColumnBlock = 64;
// kStreamRows: the most rows a round runs on stream tiles, about where brgemm on a widened block starts to win
// (docs/performance.md: machine F for AVX-512, machine E for AVX2).
#if defined(__AVX512F__)
constexpr int64_t kStreamRows = 8;
constexpr int kGroupRows = 4;            // 4 rows x 4 vectors: 16 accumulators of 32 registers
constexpr int64_t kStreamColumns = 64;   // a whole block: each k's 128 bytes of W are two adjacent lines
constexpr int kNarrowRows = kGroupRows + 1;  // no group is narrowed
#else
constexpr int64_t kStreamRows = 12;
constexpr int kGroupRows = 6;            // 6 rows x 2 vectors: 12 accumulators of AVX2's 16 registers
constexpr int64_t kStreamColumns = 32;   // 1-2 rows x 4 vectors
// Groups of 3 rows or more pass over a unit's columns in two halves: per k each widened W vector then feeds 3-6
// FMAs rather than 1-2. On Zen 1 (machine E in docs/performance.md, the one AVX2 CPU measured) widening costs
// about what an FMA does.
constexpr int kNarrowRows = 3;
#endif
constexpr int kStreamVectors = kStreamColumns / kNativeLanes;
constexpr int64_t kStreamAhead = 8192;  // bytes ahead of its reads that a stream tile requests W's lines

// Rows [0, R) of x (float32, K a row) against V vectors of columns of a block of W at w (kColumnBlock a row of the
// packed layout): out[r * ld_out + c] = the FMA chain over k, unbiased.
template <int R, int V, typename W>
void stream_group(const float* x, int64_t K, const W* w, float* out, int64_t ld_out) {
  std::array<std::array<vnf, V>, R> acc{};
  for (int64_t k = 0; k < K; ++k) {
    const W* wk = w + k * kColumnBlock;
    // As an integer: near the end it points past the weights, where a prefetch does nothing.
    const uintptr_t ahead = reinterpret_cast<uintptr_t>(wk) + kStreamAhead;
    for (uintptr_t line = 0; line < V * kNativeLanes * sizeof(W); line += 64) {
      __builtin_prefetch(reinterpret_cast<const void*>(ahead + line));
    }
    std::array<vnf, V> wv;
    for (int c = 0; c < V; ++c) wv[c] = loadn(wk + c * kNativeLanes);
    for (int r = 0; r < R; ++r) {
      const vnf xr = splatn(x[r * K + k]);
      for (int c = 0; c < V; ++c) acc[r][c] = fmaddn(xr, wv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r) std::memcpy(out + r * ld_out, acc[r].data(), sizeof(acc[r]));
}

// Rows [0, R) against the kStreamColumns columns at w: one pass, or two of half the columns for R >= kNarrowRows.
template <int R, typename W>
void stream_unit(const float* x, int64_t K, const W* w, float* out, int64_t ld_out) {
  constexpr int passes = R >= kNarrowRows ? 2 : 1, vectors = kStreamVectors / passes;
  for (int p = 0; p < passes; ++p) {
    const int64_t c = p * vectors * kNativeLanes;
    stream_group<R, vectors>(x, K, w + c, out + c, ld_out);
  }
}

template <typename W, size_t... R>
constexpr auto stream_units(std::index_sequence<R...>) {
  return std::array<void (*)(const float*, int64_t, const W*, float*, int64_t), sizeof...(R)>{
      &stream_unit<static_cast<int>(R) + 1, W>...};
}

// Columns [offset, offset + width) of packed block w ([K][kColumnBlock]) widened to float32 at wide + offset, the
// same layout, width rounded up to whole vectors (the padding columns are zeros).
template <typename W>
void widen(const W* w, int64_t K, int64_t offset, int64_t width, float* wide) {
  const int64_t end = std::min(kColumnBlock, (offset + width + kNativeLanes - 1) / kNativeLanes * kNativeLanes);
  for (int64_t k = 0; k < K; ++k) {
    for (int64_t c = offset; c < end; c += kNativeLanes) {
      const vnf v = loadn(w + k * kColumnBlock + c);
      std::memcpy(wide + k * kColumnBlock + c, &v, sizeof(v));
    }
  }
}

// Rounds of a few rows: a thread takes whole runs of kStreamColumns columns and passes every group of rows over each.
template <typename W>
void stream_rows(const float* x, int64_t M, int64_t K, const W* w, int64_t N, const float* bias, float* out) {
  static constexpr auto units = stream_units<W>(std::make_index_sequence<kGroupRows>{});
  constexpr int64_t per_block = kColumnBlock / kStreamColumns;
  at::parallel_for(0, (N + kStreamColumns - 1) / kStreamColumns, 1, [&](int64_t begin, int64_t end) {
    std::array<float, kGroupRows * kStreamColumns> acc;
    for (int64_t u = begin; u < end; ++u) {
      const int64_t n0 = u * kStreamColumns, width = std::min(kStreamColumns, N - n0);
      const W* wu = w + (u / per_block) * K * kColumnBlock + (u % per_block) * kStreamColumns;
      for (int64_t m0 = 0; m0 < M; m0 += kGroupRows) {
        const int64_t rows = std::min<int64_t>(kGroupRows, M - m0);
        units[rows - 1](x + m0 * K, K, wu, acc.data(), kStreamColumns);
        store_block(acc.data(), kStreamColumns, bias != nullptr ? bias + n0 : nullptr, out + m0 * N + n0, N, rows,
                    width);
      }
    }
  });
}

// Rounds of many rows: brgemm per tile on its block widened to float32, its sums straight into out, the bias added
// there. Without add_C, brgemm writes exactly rows x width at ldc and never reads C (out is uninitialised).
template <typename W>
void brgemm_rows(const float* x, int64_t M, int64_t K, const W* w, int64_t N, const float* bias, float* out) {
  const int64_t blocks = (N + kColumnBlock - 1) / kColumnBlock;
  for_each_tile(M, N, blocks, kColumnBlock, K * kColumnBlock, [&](const Tile& t, float* wide) {
    const int64_t n0 = t.block * kColumnBlock + t.offset;
    float* tile_out = out + t.m0 * N + n0;
    widen(w + t.block * K * kColumnBlock, K, t.offset, t.width, wide);
    at::native::cpublas::brgemm(t.rows, t.width, K, K, kColumnBlock, N, false, x + t.m0 * K, wide + t.offset,
                                tile_out);
    if (bias != nullptr) store_block(tile_out, N, bias + n0, tile_out, N, t.rows, t.width);
  });
}

// Whether brgemm's float32 sums are the FMA chain here, so that the two routes agree: PyTorch's float32 brgemm is
// oneDNN's ukernel only with oneDNN enabled (a switch read on every call) and AVX2 or better, and falls back to its
// sgemm otherwise, whose blocking of K gives other bits; and the chain needs the CPU's fused multiply-add. Tried once
// on fixed pseudo-random values (a linear congruential sequence): a tile of 128 rows over K = 1,037 (past any
// blocking of K, and not a multiple of a vector), into rows wider than the block as brgemm_rows writes out (the
// columns past the block must stay untouched), against stream_rows; false where brgemm cannot run.
bool routes_agree() {
#if !defined(__FMA__) && !defined(__AVX512F__)
  return false;
#else
  static const bool match = [] {
    constexpr int64_t M = 128, K = 1037, N = kColumnBlock, ld = 2 * N;
    uint32_t state = 12345;
    const auto next = [&state] {
      state = state * 1664525u + 1013904223u;
      return static_cast<float>(static_cast<int32_t>(state)) * 0x1p-31f;
    };
    std::vector<float> x(M * K), wide(K * N), want(M * ld), got(M * N);
    std::vector<c10::BFloat16> w(K * N);
    for (float& v : x) v = next();
    for (c10::BFloat16& v : w) v = c10::BFloat16(next());
    widen(w.data(), K, 0, N, wide.data());
    try {
      at::native::cpublas::brgemm(M, N, K, K, N, ld, false, x.data(), wide.data(), want.data());
    } catch (const std::exception&) {
      return false;
    }
    stream_rows(x.data(), M, K, w.data(), N, nullptr, got.data());
    for (int64_t m = 0; m < M; ++m) {
      const float* row = want.data() + m * ld;
      if (std::memcmp(row, got.data() + m * N, N * sizeof(float)) != 0 ||
          std::any_of(row + N, row + ld, [](float v) { return v != 0.0f; })) {
        return false;
      }
    }
    return true;
  }();
  return match && at::globalContext().userEnabledMkldnn();
#endif
}

// Rounds of more than kStreamRows rows take brgemm where it forms the same chain; elsewhere every round takes the
// stream tiles, slower for many rows but still each row's own.
template <typename W>
void half_linear_impl(const float* x, int64_t M, int64_t K, const W* w, int64_t N, const float* bias, float* out) {
  if (M <= kStreamRows || !routes_agree()) {
    stream_rows(x, M, K, w, N, bias, out);
  } else {
    brgemm_rows(x, M, K, w, N, bias, out);
  }
}

at::Tensor half_weight_linear(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                              const c10::optional<at::Tensor>& bias) {
  constexpr const char* op = "batchgen::half_weight_linear: ";
  const auto wt = packed.scalar_type();
  TORCH_CHECK(wt == at::kBFloat16 || wt == at::kHalf, op, "packed must be bfloat16 or float16, got ", wt);
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == wt, op, "x must be float32 or the weight's dtype (",
              wt, "), got ", x.scalar_type());
  TORCH_CHECK(x.dim() == 2 && packed.dim() == 3 && packed.size(2) == kColumnBlock && packed.size(1) == x.size(1), op,
              "x [rows, K] and packed [blocks, K, ", kColumnBlock, "] must agree on K, got ", x.sizes(), " and ",
              packed.sizes());
  const int64_t M = x.size(0), K = x.size(1), N = out_features;
  const int64_t blocks = packed.size(0);
  TORCH_CHECK(N >= 0 && N > (blocks - 1) * kColumnBlock && N <= blocks * kColumnBlock, op, blocks, " blocks of ",
              kColumnBlock, " columns cannot hold out_features ", N);
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu() && x.is_contiguous() && packed.is_contiguous(), op,
              "x and packed must be contiguous CPU tensors");
  const float* b = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->dim() == 1 && bias->size(0) == N && bias->is_contiguous(),
                op, "bias must be float32 [out_features], got ", bias->scalar_type(), " ", bias->sizes());
    b = bias->const_data_ptr<float>();
  }
  at::Tensor out = at::empty({M, N}, x.options().dtype(at::kFloat));
  float* o = out.mutable_data_ptr<float>();
  if (K == 0 || M == 0) {  // empty sums: the bias alone
    for (int64_t i = 0; i < M * N; ++i) o[i] = b != nullptr ? b[i % N] : 0.0f;
    return out;
  }
  const at::Tensor x32 = x.to(at::kFloat).contiguous();
  const float* xp = x32.const_data_ptr<float>();
  if (wt == at::kBFloat16) {
    half_linear_impl(xp, M, K, reinterpret_cast<const c10::BFloat16*>(packed.const_data_ptr()), N, b, o);
  } else {
    half_linear_impl(xp, M, K, reinterpret_cast<const c10::Half*>(packed.const_data_ptr()), N, b, o);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(batchgen, m) {
  m.def("half_weight_linear(Tensor x, Tensor packed, int out_features, Tensor? bias) -> Tensor");
  // Whether a round's route changes no bits here (stream tiles give brgemm's): batch invariance rests on it.
  m.def("half_linear_routes_agree() -> bool", &routes_agree);
}

TORCH_LIBRARY_IMPL(batchgen, CPU, m) { m.impl("half_weight_linear", &half_weight_linear); }
