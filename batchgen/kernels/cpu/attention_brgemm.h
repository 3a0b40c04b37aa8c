// The paged-attention kernel's bfloat16 path through PyTorch's brgemm (oneDNN's batch-reduce GEMM ukernel:
// tdpbf16ps on AMX tiles, vdpbf16ps on AVX512-BF16), included by paged_attention.cpp where the machine has
// AVX512-BF16 (BATCHGEN_BF16_DOT, attention_common.h); the caller picks it at run time, where brgemm runs bfloat16
// (brgemm_bf16.h).
//
// A work item's queries (up to kGemmQueryBlock: the row's new tokens times the GQA group, all on one KV head) form the
// rows of two GEMMs per block of kGemmKeyBlock (256) keys, over n = gemm_keys(the block's keys) of them:
//   S [queries x n keys] = Q [queries x head_dim] . K^T        (K^T packed as (dim 2p, dim 2p + 1) pairs)
//   acc [queries x head_dim] = alpha * acc + P [queries x n] . V   (V packed as (key 2j, key 2j + 1) pairs)
// with the online softmax (attention_common.h's softmax_step) between them, per query, in float32; P is rounded to
// bfloat16 as on the other paths. The packed layouts are the VNNI layouts brgemm takes for B, the same ones the
// vdpbf16ps path builds (pack_block), so a block is packed once for all its queries. Against the vdpbf16ps path's
// per-query loops, oneDNN's kernel holds a block of queries' accumulators in registers (or tiles) and reuses each
// load of K and V across them.
//
// Determinism: a query's result depends on its own inputs only. Keys are blocked at fixed positions; the GEMMs of a
// block run over its keys rounded up to kGemmKeyStep (gemm_keys), and the keys past a query's last visible one add
// exact zeros to its sum, however many the row has; a query that sees none of a block skips the softmax step and
// adds exact zeros, and items hold fixed blocks of a row's own queries, so neither the other rows of the round nor
// the thread that runs an item change its arithmetic. (brgemm's result for one element of C does not depend on M,
// nor, but for the sign of a zero, on how many zero terms follow: tests/kernels/test_cpu_attention_paths.py checks
// both.) Keys after a query never reach it, even where a broken model wrote inf or NaN into them
// (weigh_values_per_query).
#pragma once

#include "attention_bf16.h"
#include "attention_common.h"
#include "brgemm_bf16.h"

#include <ATen/native/CPUBlas.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#ifdef BATCHGEN_BF16_DOT

namespace {

// The keys a block's GEMMs run over: its block_len keys rounded up to kGemmKeyStep. A query's result does not
// depend on it: S's columns are independent, and the keys past the query's last visible one add exact zeros to
// P . V (P is 0 there, V finite or cleared), whose sum over keys brgemm walks in one order from key 0 whatever K;
// those zeros can only turn a -0 sum into +0, which finish_query makes +0 anyway
// (tests/kernels/test_cpu_attention_paths.py checks every extent, and a zero output).
constexpr int64_t gemm_keys(int64_t block_len) { return (block_len + kGemmKeyStep - 1) / kGemmKeyStep * kGemmKeyStep; }

// Whether all of bf16[0 .. n) (n a multiple of 32) are finite: an exponent of all ones is inf or NaN.
inline bool all_finite(const uint16_t* bf16, int64_t n) {
  const __m512i exponent = _mm512_set1_epi16(0x7f80);
  for (int64_t i = 0; i < n; i += 32) {
    const __m512i x = _mm512_and_si512(_mm512_loadu_si512(bf16 + i), exponent);
    if (_mm512_cmpeq_epi16_mask(x, exponent)) return false;
  }
  return true;
}

// acc[i] += P[i] . V for each query i in [first, last) alone, V's keys from the query's `seen` on cleared: for a
// block whose V holds inf or NaN (a broken model's) at keys some queries must not see, where one GEMM would give
// them 0 x inf = NaN.
inline void weigh_values_per_query(const Scratch& w, const c10::BFloat16* probs, float* acc, int64_t first,
                                   int64_t last, int64_t head_dim, int64_t block, int64_t block_len) {
  const int64_t extent = gemm_keys(block_len);
  std::vector<uint16_t> masked(w.v_pairs.size() * 2);
  for (int64_t i = first; i < last; ++i) {
    const int64_t seen = std::min(block_len, w.limit[i] - block);
    if (seen <= 0) continue;
    std::memcpy(masked.data(), w.v_pairs.data(), masked.size() * sizeof(uint16_t));
    // Key j's dim d sits at [(j / 2) * head_dim + d] * 2 + j % 2.
    for (int64_t j = seen; j < extent; ++j) {
      for (int64_t d = 0; d < head_dim; ++d) masked[((j / 2) * head_dim + d) * 2 + j % 2] = 0;
    }
    at::native::cpublas::brgemm(1, head_dim, extent, kGemmKeyBlock, head_dim, head_dim, true,
                                probs + i * kGemmKeyBlock, reinterpret_cast<const c10::BFloat16*>(masked.data()),
                                acc + i * head_dim);
  }
}

// Queries [first, last) held in w (q rows in w.q_pairs, started) against the block of `block_len` keys at position
// `block` (their slots in w.slots): K and V packed, S = Q . K^T, the online-softmax step per query,
// acc = alpha * acc + P . V, the GEMMs over gemm_keys(block_len) keys (those past a query's last visible one get
// probability 0). brgemm's result for one element does not depend on the rows beside it, so a query's bits do not
// depend on which other queries share the call.
inline void attend_gemm_block(const Shape& s, const uint16_t* k16, const uint16_t* v16, int64_t first, int64_t last,
                              int64_t block, int64_t block_len, Scratch& w) {
  const int64_t dc = s.chunks, head_dim = s.head_dim, pairs = head_dim / 2, nq = last - first;
  auto* q_rows = reinterpret_cast<c10::BFloat16*>(w.q_pairs.data());     // [queries][head_dim]
  auto* probs = reinterpret_cast<c10::BFloat16*>(w.block_probs.data());  // [queries][kGemmKeyBlock]
  auto* acc = reinterpret_cast<float*>(w.acc.data());                    // [queries][head_dim]: dc * 16 == head_dim
  const auto* kp = reinterpret_cast<const c10::BFloat16*>(w.k_pairs.data());
  const auto* vp = reinterpret_cast<const c10::BFloat16*>(w.v_pairs.data());
  pack_block(k16, v16, w.slots.data(), block_len, pairs, s.kv_stride_slot, w.k_pairs.data(), w.v_pairs.data(),
             kGemmKeyBlock, &w);
  w.request_next(w.ahead.keys);  // what the packing left of the next block (all but a short block's share)
  const int64_t extent = gemm_keys(block_len);
  // Past the block's keys P is 0, but 0 x NaN is NaN, so the V pairs there up to the GEMMs' extent (pack_block
  // leaves them as they were) are cleared; the scores there are computed, never read.
  const int64_t written = (block_len + 1) / 2;
  std::fill(w.v_pairs.begin() + written * head_dim, w.v_pairs.begin() + extent / 2 * head_dim, 0u);
  at::native::cpublas::brgemm(nq, extent, head_dim, head_dim, kGemmKeyBlock, kGemmKeyBlock, false,
                              q_rows + first * head_dim, kp, w.block_scores.data() + first * kGemmKeyBlock);
  int64_t fewest = block + block_len;  // the fewest keys a query here sees, up to the block's end
  for (int64_t i = first; i < last; ++i) {
    c10::BFloat16* p = probs + i * kGemmKeyBlock;
    const int64_t seen = std::min(block_len, w.limit[i] - block);
    fewest = std::min(fewest, w.limit[i]);
    if (seen <= 0) {  // none of this block is visible: P . V adds zeros, the running max and sum stay
      std::fill_n(reinterpret_cast<uint16_t*>(p), extent, uint16_t{0});
      continue;
    }
    v16f* scores = w.scores.data();
    const int64_t used = (seen + kLanes - 1) / kLanes;
    const float* row_scores = w.block_scores.data() + i * kGemmKeyBlock;
    for (int64_t g = 0; g < used; ++g) scores[g] = load16(row_scores + g * kLanes) * s.scale;
    const float alpha = softmax_step(scores, seen, used, w.row_max[i], w.row_sum[i]);
    for (int64_t g = 0; g < extent / kLanes; g += 2) {
      const __m512 lo = g < used ? reinterpret_cast<__m512>(scores[g]) : _mm512_setzero_ps();
      const __m512 hi = g + 1 < used ? reinterpret_cast<__m512>(scores[g + 1]) : _mm512_setzero_ps();
      // Rounded to nearest even, as the other paths round P.
      _mm512_storeu_si512(p + g * kLanes, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo)));
    }
    v16f* row = &w.acc[i * dc];
    for (int64_t c = 0; c < dc; ++c) row[c] *= alpha;
  }
  // One GEMM weighs every query's values, unless some query must not see part of this block and V holds inf or
  // NaN there: then 0 x inf would reach it, so each query weighs its own visible keys.
  const auto* v_bits = reinterpret_cast<const uint16_t*>(vp);
  if (block + block_len > fewest && !all_finite(v_bits, (block_len + 1) / 2 * 2 * head_dim)) {
    weigh_values_per_query(w, probs, acc, first, last, head_dim, block, block_len);
  } else {
    at::native::cpublas::brgemm(nq, head_dim, extent, kGemmKeyBlock, head_dim, head_dim, true,
                                probs + first * kGemmKeyBlock, vp, acc + first * head_dim);
  }
}

// attend() for bfloat16 through brgemm: the same work item, inputs and result. Call
// at::native::cpublas::brgemm_release() on the thread when its items are done.
template <int DC>
bool attend_brgemm(const Shape& s, const c10::BFloat16* q, const c10::BFloat16* k, const c10::BFloat16* v,
                   c10::BFloat16* out, const int64_t* slot_of_position, int64_t seq_len, int64_t q_start,
                   int64_t q_len, int64_t kv_head, int64_t first, int64_t last, Scratch& w) {
  const int64_t group = s.num_heads / s.num_kv_heads, nq = last - first;
  const auto* k16 = reinterpret_cast<const uint16_t*>(k + kv_head * s.kv_stride_head);
  const auto* v16 = reinterpret_cast<const uint16_t*>(v + kv_head * s.kv_stride_head);
  const int64_t keys = start_bf16_queries(s, q, seq_len, q_start, q_len, kv_head, first, last, w);
  auto attend = [&](int64_t block, int64_t block_len) { attend_gemm_block(s, k16, v16, 0, nq, block, block_len, w); };
  if (!over_key_blocks(s, k16, v16, slot_of_position, 0, keys, kGemmKeyBlock, w, attend)) return false;
  for (int64_t i = 0; i < nq; ++i) {
    const int64_t t = (first + i) / group, head = kv_head * group + (first + i) % group;
    w.finish_query(i, s.chunks, s.head_dim, out + (q_start + t) * s.out_stride_token + head * s.out_stride_head);
  }
  return true;
}

// The rows of a shared prefix (attention_shared.h) whose first `depth` blocks of kGemmKeyBlock keys are the same
// pool slots: those blocks run as GEMMs over all the members' queries at once (every query sees them whole), then
// each member goes on over its own keys: with kGemmTails through the GEMMs too, in blocks of kGemmKeyBlock, so that
// each query gets the bits attend_brgemm gives its row alone (brgemm's rows do not depend on one another); without,
// on the vdpbf16ps path (finish_shared_members' blocks of kKeyBlock), whose per-query loops cost less for the few
// keys a decode row has of its own, but whose rounding differs from the GEMMs', so a row's bits then depend on
// whether it was grouped. Rows of a few queries (decodes) gain most: their per-query loops reuse no load of K or V.
template <int DC, bool kGemmTails>
bool attend_brgemm_shared(const Shape& s, const c10::BFloat16* q, const c10::BFloat16* k, const c10::BFloat16* v,
                          c10::BFloat16* out, const Rows& rows, const int64_t* members, int64_t num_members,
                          int64_t depth, int64_t kv_head, Scratch& w) {
  const auto* k16 = reinterpret_cast<const uint16_t*>(k + kv_head * s.kv_stride_head);
  const auto* v16 = reinterpret_cast<const uint16_t*>(v + kv_head * s.kv_stride_head);
  const int64_t nq = start_shared_queries(s, q, rows, members, num_members, kv_head, w);
  auto gemm = [&](int64_t first, int64_t last, int64_t block, int64_t block_len) {
    attend_gemm_block(s, k16, v16, first, last, block, block_len, w);
  };
  auto gemm_all = [&](int64_t block, int64_t block_len) { gemm(0, nq, block, block_len); };
  const int64_t shared_keys = depth * kGemmKeyBlock;
  const Scratch::AheadRows tail =
      member_tail(k16, v16, rows, members, 0, shared_keys, kGemmTails ? kGemmKeyBlock : kKeyBlock);
  if (!over_key_blocks(s, k16, v16, rows.slots_of(members[0]), 0, shared_keys, kGemmKeyBlock, w, gemm_all, &tail)) {
    return false;
  }
  if constexpr (kGemmTails) {
    return finish_shared_members(s, k16, v16, out, rows, members, num_members, shared_keys, kGemmKeyBlock, kv_head,
                                 w, gemm);
  } else {
    auto vector = [&](int64_t first, int64_t last, int64_t block, int64_t block_len) {
      attend_queries_bf16<DC>(s, k16, v16, first, last, block, block_len, w);
    };
    return finish_shared_members(s, k16, v16, out, rows, members, num_members, shared_keys, kKeyBlock, kv_head, w,
                                 vector);
  }
}

}  // namespace

#endif  // BATCHGEN_BF16_DOT
