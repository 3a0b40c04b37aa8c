// y = x W^T + b for a few rows of x against weights kept in bfloat16 or float16, for CPUs where those
// dtypes' GEMMs run in float32 (no BF16 units: AVX2 alone, or AVX-512 without BF16). There a half-precision
// model's linear layers run as float32 GEMMs on float32 copies of the weights (batchgen/models/packed_linear.py);
// a decode round of a few rows is bound by reading those weights, and reading the half-precision ones instead
// halves the bytes. Each weight value is
// widened to float32 in registers; products and sums are float32, as in the float32 GEMM, only in another order.
//
// Layout: a thread takes blocks of 24 output columns (rows of W); over a block, each tile of up to 4 rows of x
// walks the inner dimension once in tiles of NB columns, holding MB x NB accumulators of the machine's vector
// width in registers (1 x 8, 2 x 6, 3 x 4 or 4 x 3). Every output is one accumulator's lanes, summed in
// hsumn's fixed tree, then the inner dimension's tail in order, then the bias, whatever the tile: a row's result
// never depends on how many rows are in the call or where it sits among them.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "vec16.h"

#include <algorithm>
#include <cstdint>

namespace {

// Columns (rows of W) per tile for a tile of 1, 2, 3 or 4 rows of x: at least 8 accumulators, so that the FMAs of
// one step do not wait on each other (an FMA's latency is 4-5 cycles), and at most 12 (16 registers with AVX2).
constexpr int kMaxRows = 4;
constexpr int kColumnsFor[kMaxRows + 1] = {0, 8, 6, 4, 3};
// A thread's unit of work: columns whose weights (24 x in x 2 bytes) stay in L1/L2 while every tile of rows of x
// passes over them; a multiple of each tile's width.
constexpr int64_t kColumnBlock = 24;

// A prefetch of p + ahead elements; the address is computed as an integer, since past the last tile it points beyond
// the weights (a prefetch never faults).
template <typename W>
inline void prefetch_ahead(const W* p, int64_t ahead) {
  __builtin_prefetch(reinterpret_cast<const void*>(reinterpret_cast<uintptr_t>(p) + ahead * sizeof(W)));
}

template <int MB, int NB, typename X, typename W>
inline void linear_tile(const X* x, int64_t ldx, const W* w, int64_t K, const float* bias, float* out,
                        int64_t ldo) {
  const int64_t full = K / kNativeLanes * kNativeLanes;
  vnf acc[MB][NB] = {};
  for (int64_t k = 0; k < full; k += kNativeLanes) {
    // Hold whichever of the step's x rows and weight rows are fewer in registers, and stream the others, so that
    // accumulators and held vectors fit the 16 registers of AVX2 (4 x 3 holds the weights, the others x).
    if constexpr (MB <= NB) {
      vnf xv[MB];
      for (int i = 0; i < MB; ++i) xv[i] = loadn(x + i * ldx + k);
      for (int j = 0; j < NB; ++j) {
        // The same step of the next tile: without it the weights stream well below the memory's read bandwidth
        // (docs/performance.md).
        prefetch_ahead(w + j * K + k, NB * K);
        const vnf wv = loadn(w + j * K + k);
        for (int i = 0; i < MB; ++i) acc[i][j] += xv[i] * wv;
      }
    } else {
      vnf wv[NB];
      for (int j = 0; j < NB; ++j) {
        prefetch_ahead(w + j * K + k, NB * K);
        wv[j] = loadn(w + j * K + k);
      }
      for (int i = 0; i < MB; ++i) {
        const vnf xv = loadn(x + i * ldx + k);
        for (int j = 0; j < NB; ++j) acc[i][j] += xv * wv[j];
      }
    }
  }
  for (int i = 0; i < MB; ++i) {
    for (int j = 0; j < NB; ++j) {
      float s = hsumn(acc[i][j]);
      for (int64_t k = full; k < K; ++k) s += to_float(x[i * ldx + k]) * to_float(w[j * K + k]);
      out[i * ldo + j] = bias != nullptr ? s + bias[j] : s;
    }
  }
}

// Columns [n0, n1) of MB rows of x, in tiles of kColumnsFor[MB] columns and a narrower last one.
template <int MB, typename X, typename W>
inline void linear_rows(const X* x, int64_t K, const W* w, const float* bias, float* out, int64_t N, int64_t n0,
                        int64_t n1) {
  constexpr int NB = kColumnsFor[MB];
  int64_t n = n0;
  for (; n + NB <= n1; n += NB) linear_tile<MB, NB>(x, K, w + n * K, K, bias ? bias + n : nullptr, out + n, N);
  const float* b = bias ? bias + n : nullptr;
  switch (n1 - n) {  // the narrower last tile
    case 7: linear_tile<MB, 7>(x, K, w + n * K, K, b, out + n, N); break;
    case 6: linear_tile<MB, 6>(x, K, w + n * K, K, b, out + n, N); break;
    case 5: linear_tile<MB, 5>(x, K, w + n * K, K, b, out + n, N); break;
    case 4: linear_tile<MB, 4>(x, K, w + n * K, K, b, out + n, N); break;
    case 3: linear_tile<MB, 3>(x, K, w + n * K, K, b, out + n, N); break;
    case 2: linear_tile<MB, 2>(x, K, w + n * K, K, b, out + n, N); break;
    case 1: linear_tile<MB, 1>(x, K, w + n * K, K, b, out + n, N); break;
    default: break;
  }
}

template <typename X, typename W>
void half_weight_linear_impl(const X* x, int64_t M, int64_t K, const W* w, int64_t N, const float* bias, float* out) {
  const int64_t blocks = (N + kColumnBlock - 1) / kColumnBlock;
  // ~64 KiB of weights per task: enough work to be worth a thread, small enough to split a 576 x 576 layer.
  const int64_t grain = std::max<int64_t>(1, 32768 / (kColumnBlock * std::max<int64_t>(1, K)));
  at::parallel_for(0, blocks, grain, [&](int64_t begin, int64_t end) {
    const int64_t n0 = begin * kColumnBlock, n1 = std::min(N, end * kColumnBlock);
    for (int64_t c0 = n0; c0 < n1; c0 += kColumnBlock) {
      const int64_t c1 = std::min(n1, c0 + kColumnBlock);
      for (int64_t m0 = 0; m0 < M; m0 += kMaxRows) {
        const X* xt = x + m0 * K;
        float* ot = out + m0 * N;
        switch (std::min<int64_t>(kMaxRows, M - m0)) {
          case 4: linear_rows<4>(xt, K, w, bias, ot, N, c0, c1); break;
          case 3: linear_rows<3>(xt, K, w, bias, ot, N, c0, c1); break;
          case 2: linear_rows<2>(xt, K, w, bias, ot, N, c0, c1); break;
          default: linear_rows<1>(xt, K, w, bias, ot, N, c0, c1); break;
        }
      }
    }
  });
}

template <typename W>
void dispatch_x(const at::Tensor& x, const W* w, int64_t N, const float* bias, float* out) {
  const int64_t M = x.size(0), K = x.size(1);
  if (x.scalar_type() == at::kFloat) {
    half_weight_linear_impl(x.const_data_ptr<float>(), M, K, w, N, bias, out);
  } else {
    half_weight_linear_impl(reinterpret_cast<const W*>(x.const_data_ptr()), M, K, w, N, bias, out);
  }
}

at::Tensor half_weight_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  const auto wt = weight.scalar_type();
  TORCH_CHECK(wt == at::kBFloat16 || wt == at::kHalf, "batchgen::half_weight_linear: weight must be bfloat16 or ",
              "float16, got ", wt);
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == wt, "batchgen::half_weight_linear: x must be ",
              "float32 or the weight's dtype (", wt, "), got ", x.scalar_type());
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1),
              "batchgen::half_weight_linear: x [rows, in] and weight [out, in] must agree on in, got ", x.sizes(),
              " and ", weight.sizes());
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu() && x.is_contiguous() && weight.is_contiguous(),
              "batchgen::half_weight_linear: x and weight must be contiguous CPU tensors");
  const int64_t N = weight.size(0);
  const float* b = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->dim() == 1 && bias->size(0) == N && bias->is_contiguous(),
                "batchgen::half_weight_linear: bias must be float32 [out], got ", bias->scalar_type(), " ",
                bias->sizes());
    b = bias->const_data_ptr<float>();
  }
  at::Tensor out = at::empty({x.size(0), N}, x.options().dtype(at::kFloat));
  float* o = out.mutable_data_ptr<float>();
  if (wt == at::kBFloat16) {
    dispatch_x(x, reinterpret_cast<const c10::BFloat16*>(weight.const_data_ptr()), N, b, o);
  } else {
    dispatch_x(x, reinterpret_cast<const c10::Half*>(weight.const_data_ptr()), N, b, o);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(batchgen, m) { m.def("half_weight_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor"); }

TORCH_LIBRARY_IMPL(batchgen, CPU, m) { m.impl("half_weight_linear", &half_weight_linear); }
