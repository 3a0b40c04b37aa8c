// The paged-attention kernel's generic block step (any SIMD width the compiler maps 16-float vectors onto),
// included by paged_attention.cpp; attention_avx2.h holds the AVX2 one, with the same inputs and result.
#pragma once

#include "attention_common.h"

#include <cstdint>

namespace {

// One query against one converted block of `seen` keys: scores, online-softmax update of (row_max, row_sum),
// weighted values into acc. DC: the head's chunks of 16 floats when fixed at compile time (0: s.chunks).
template <typename T, int DC>
void attend_block(const v16f* q, const v16f* keys, const v16f* values, int64_t seen, int64_t chunks, v16f* acc,
                  float& row_max, float& row_sum, v16f* scores, v16f* scratch) {
  const int64_t dc = DC ? DC : chunks;
  const int64_t used = (seen + kLanes - 1) / kLanes;  // score chunks; keys past `seen` get -inf
  for (int64_t g = 0; g < used; ++g) {
    v16f dots[kLanes];
    for (int64_t jj = 0; jj < kLanes; ++jj) {
      const v16f* key = keys + (g * kLanes + jj) * dc;
      v16f dot = q[0] * key[0];
      for (int64_t c = 1; c < dc; ++c) dot += q[c] * key[c];
      dots[jj] = dot;
    }
    scores[g] = sum16(dots);
  }
  float* flat = reinterpret_cast<float*>(scores);
  const float alpha = softmax_step(scores, seen, used, row_max, row_sum);
  // In bfloat16/float16, the probabilities weight V rounded to that type (their sum above is not), as in
  // PyTorch's SDPA that HF transformers runs and in FlashAttention: greedy tokens then follow HF's further
  // (stories260k and SmolLM2 in bfloat16: all 40 reference tokens, against 16 and 32 with float32 weights).
  for (int64_t g = 0; g < used; ++g) scores[g] = round_to<T>(scores[g]);
  // Weighted values, in two running sums (even and odd keys) so that consecutive FMAs do not wait on each
  // other; with DC fixed they stay in registers over the block.
  v16f even_regs[DC ? DC : 1], odd_regs[DC ? DC : 1];
  v16f* even = DC ? even_regs : acc;
  v16f* odd = DC ? odd_regs : scratch;
  for (int64_t c = 0; c < dc; ++c) {
    even[c] = acc[c] * alpha;
    odd[c] = v16f{};
  }
  int64_t j = 0;
  for (; j + 1 < seen; j += 2) {
    const float p0 = flat[j], p1 = flat[j + 1];
    const v16f *v0 = values + j * dc, *v1 = v0 + dc;
    for (int64_t c = 0; c < dc; ++c) {
      even[c] += p0 * v0[c];
      odd[c] += p1 * v1[c];
    }
  }
  if (j < seen) {
    for (int64_t c = 0; c < dc; ++c) even[c] += flat[j] * values[j * dc + c];
  }
  for (int64_t c = 0; c < dc; ++c) acc[c] = even[c] + odd[c];
}

}  // namespace
