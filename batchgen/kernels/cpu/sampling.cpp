// Sampling on the CPU, a row per thread, the machine's vector width at a time.
// - argmax_rows: greedy sampling's argmax over the vocabulary, with torch.argmax's answer: the first index of the
//   largest value, or of the first NaN when a row has one (NaN counts as the largest). PyTorch's CPU argmax
//   compares one element at a time (about 1 ms for 64 rows of a 32,000-token vocabulary on the CI machine).
// - exponential_race: the token whose weight over its exponential noise is largest (batchgen/sampling/random.py
//   defines the noise; this computes it only where a token could still win).
// - log_softmax_at: log_softmax's value at a few ids of each row (a sampled token's logprob, a top list's), without
//   writing the [rows, vocab] log_softmax that only those are read of.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "vec16.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

namespace {

// The largest of x[0 .. n) (NaNs aside) and whether any is NaN: one pass, in the vector's lanes then across them.
struct RowMax {
  float max;
  bool has_nan;
};

RowMax row_max(const float* x, int64_t n) {
  const int64_t full = n / kNativeLanes * kNativeLanes;
  vnf best = vnf{} - kInf;
  vni nan = {};
  for (int64_t i = 0; i < full; i += kNativeLanes) {
    const vnf v = loadn(x + i);
    nan |= v != v;
    best = v > best ? v : best;
  }
  float m = -kInf;
  bool has_nan = false;
  for (int64_t l = 0; l < kNativeLanes; ++l) {
    m = std::max(m, best[l]);
    has_nan = has_nan || nan[l] != 0;
  }
  for (int64_t i = full; i < n; ++i) {
    has_nan = has_nan || std::isnan(x[i]);
    m = std::max(m, x[i]);
  }
  return {m, has_nan};
}

int64_t argmax_row(const float* x, int64_t n) {
  const auto [m, has_nan] = row_max(x, n);
  for (int64_t i = 0; i < n; ++i) {
    if (has_nan ? std::isnan(x[i]) : x[i] == m) return i;
  }
  return 0;  // only a row of no elements; argmax_rows refuses those
}

at::Tensor argmax_rows(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.size(1) > 0 && logits.stride(1) == 1,
              "batchgen::argmax_rows: logits must be [rows, vocab] with vocab > 0 and a contiguous last dimension, ",
              "got ", logits.sizes());
  TORCH_CHECK(logits.scalar_type() == at::kFloat && logits.device().is_cpu(),
              "batchgen::argmax_rows: logits must be a float32 CPU tensor, got ", logits.scalar_type(), " on ",
              logits.device());
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  at::Tensor out = at::empty({rows}, logits.options().dtype(at::kLong));
  int64_t* ids = out.mutable_data_ptr<int64_t>();
  const float* base = logits.const_data_ptr<float>();
  at::parallel_for(0, rows, std::max<int64_t>(1, 65536 / vocab), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) ids[r] = argmax_row(base + r * logits.stride(0), vocab);
  });
  return out;
}

// lowbias32 (Chris Wellons), as batchgen/sampling/random.py's _mix32: on a uint32_t, or on every lane of a vnu.
template <typename U>
inline U mix32(U x) {
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  return x ^ (x >> 16);
}

constexpr uint32_t kGolden = 0x9E3779B9u;

// argmax_i w[i] / E_i, E_i = -log1p(-(x_i + 0.5) / 2^32) and x_i the token's hash; first index on ties.
// E_i >= w_i = (x_i + 0.5) / 2^32, so a token with w_i * best >= w[i] cannot beat the best so far: the vector loop
// only tests that bound, and the exact ratio (in double, as the torch reference) is computed for the few tokens
// that pass it. best_bound rounds best down and the float products err by ~2^-24, so no winner is ever skipped.
int64_t race_row(const float* w, int64_t n, uint32_t key_a, uint32_t key_b) {
  double best = 0.0;
  float best_bound = 0.0f;
  int64_t winner = -1;
  vnu lane;
  for (int64_t l = 0; l < kNativeLanes; ++l) lane[l] = static_cast<uint32_t>(l);
  const auto exact = [&](int64_t i, uint32_t x) {
    const double u = (static_cast<double>(x) + 0.5) * 0x1p-32;
    const double ratio = static_cast<double>(w[i]) / -std::log1p(-u);
    if (ratio > best) {
      best = ratio;
      winner = i;
      best_bound = static_cast<float>(best) * (1.0f - 0x1p-20f);
    }
  };
  const int64_t full = n / kNativeLanes * kNativeLanes;
  for (int64_t i = 0; i < full; i += kNativeLanes) {
    const vnu ids = lane + static_cast<uint32_t>(i);
    const vnu x = mix32(mix32(ids * kGolden + key_a) ^ key_b);
    const vnf p = loadn(w + i);
    const vnf u = __builtin_convertvector(x, vnf) * 0x1p-32f;
    const vni candidate = (p > 0.0f) & (u * best_bound < p);
    bool any = false;
    for (int64_t l = 0; l < kNativeLanes; ++l) any |= candidate[l] != 0;
    if (!any) continue;
    for (int64_t l = 0; l < kNativeLanes; ++l) {
      if (candidate[l] != 0) exact(i + l, x[l]);
    }
  }
  for (int64_t i = full; i < n; ++i) {
    if (w[i] > 0.0f) exact(i, mix32(mix32(static_cast<uint32_t>(i) * kGolden + key_a) ^ key_b));
  }
  return winner >= 0 ? winner : argmax_row(w, n);  // no positive weight: torch.argmax's answer
}

at::Tensor exponential_race(const at::Tensor& weights, const at::Tensor& keys) {
  TORCH_CHECK(weights.dim() == 2 && weights.size(1) > 0 && weights.stride(1) == 1 &&
                  weights.scalar_type() == at::kFloat && weights.device().is_cpu(),
              "batchgen::exponential_race: weights must be float32 [rows, vocab] on the CPU with vocab > 0 and a ",
              "contiguous last dimension, got ", weights.scalar_type(), " ", weights.sizes());
  TORCH_CHECK(keys.dim() == 2 && keys.size(0) == weights.size(0) && keys.size(1) == 2 &&
                  keys.scalar_type() == at::kLong && keys.device().is_cpu(),
              "batchgen::exponential_race: keys must be int64 [rows, 2] on the CPU, got ", keys.scalar_type(), " ",
              keys.sizes());
  const int64_t rows = weights.size(0), vocab = weights.size(1);
  const at::Tensor key = keys.contiguous();
  at::Tensor out = at::empty({rows}, weights.options().dtype(at::kLong));
  int64_t* ids = out.mutable_data_ptr<int64_t>();
  const float* base = weights.const_data_ptr<float>();
  const int64_t* k = key.const_data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      ids[r] = race_row(base + r * weights.stride(0), vocab, static_cast<uint32_t>(k[2 * r]),
                        static_cast<uint32_t>(k[2 * r + 1]));
    }
  });
  return out;
}

// log_softmax(x)[id] = (x[id] - m) - log(sum_j exp(x_j - m)), m the row's maximum (the form PyTorch's log_softmax
// computes), at the k ids of one row: two passes over x (the maximum, then the sum: the row, under 1 MiB for common
// vocabularies, stays in L2 between them), each sum in the vector's lanes then across them. NaN for every id where
// the row holds a NaN or has no finite maximum (all -inf, or a +inf), as PyTorch gives.
void log_softmax_row(const float* x, int64_t n, const int64_t* ids, int64_t k, float* out) {
  const auto [m, has_nan] = row_max(x, n);
  if (has_nan || !std::isfinite(m)) {
    std::fill_n(out, k, std::numeric_limits<float>::quiet_NaN());
    return;
  }
  const int64_t full = n / kNativeLanes * kNativeLanes;
  vnf sums = {};
  for (int64_t i = 0; i < full; i += kNativeLanes) sums += exp_nonpositive(loadn(x + i) - m);
  float sum = 0.f;
  for (int64_t l = 0; l < kNativeLanes; ++l) sum += sums[l];
  for (int64_t i = full; i < n; ++i) sum += std::exp(x[i] - m);
  const float log_sum = std::log(sum);
  for (int64_t j = 0; j < k; ++j) out[j] = (x[ids[j]] - m) - log_sum;
}

at::Tensor log_softmax_at(const at::Tensor& logits, const at::Tensor& ids) {
  TORCH_CHECK(logits.dim() == 2 && logits.size(1) > 0 && logits.stride(1) == 1 &&
                  logits.scalar_type() == at::kFloat && logits.device().is_cpu(),
              "batchgen::log_softmax_at: logits must be float32 [rows, vocab] on the CPU with vocab > 0 and a ",
              "contiguous last dimension, got ", logits.scalar_type(), " ", logits.sizes());
  TORCH_CHECK(ids.dim() == 2 && ids.size(0) == logits.size(0) && ids.scalar_type() == at::kLong &&
                  ids.device().is_cpu(),
              "batchgen::log_softmax_at: ids must be int64 [rows, k] on the CPU, got ", ids.scalar_type(), " ",
              ids.sizes());
  const int64_t rows = logits.size(0), vocab = logits.size(1), k = ids.size(1);
  const at::Tensor wanted = ids.contiguous();
  const int64_t* id = wanted.const_data_ptr<int64_t>();
  for (int64_t i = 0; i < rows * k; ++i) {
    TORCH_CHECK(id[i] >= 0 && id[i] < vocab, "batchgen::log_softmax_at: id ", id[i], " outside [0, ", vocab, ")");
  }
  at::Tensor out = at::empty({rows, k}, logits.options());
  float* values = out.mutable_data_ptr<float>();
  const float* base = logits.const_data_ptr<float>();
  at::parallel_for(0, rows, std::max<int64_t>(1, 65536 / vocab), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      log_softmax_row(base + r * logits.stride(0), vocab, id + r * k, k, values + r * k);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(batchgen, m) {
  m.def("argmax_rows(Tensor logits) -> Tensor");
  m.def("exponential_race(Tensor weights, Tensor keys) -> Tensor");
  m.def("log_softmax_at(Tensor logits, Tensor ids) -> Tensor");
}

TORCH_LIBRARY_IMPL(batchgen, CPU, m) {
  m.impl("argmax_rows", &argmax_rows);
  m.impl("exponential_race", &exponential_race);
  m.impl("log_softmax_at", &log_softmax_at);
}
