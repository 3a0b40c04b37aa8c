// The paged-attention kernel's bfloat16 path through vdpbf16ps (AVX512-BF16), included by paged_attention.cpp
// where the machine has it (BATCHGEN_BF16_DOT, attention_common.h).
#pragma once

#include "attention_common.h"

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#ifdef BATCHGEN_BF16_DOT

#include <immintrin.h>

namespace {

// ---- bfloat16 through the AVX512-BF16 dot product ----
//
// `vdpbf16ps acc, a, b` adds to each float32 lane the products of one pair of bfloat16s from a and b (exact
// products, each added with rounding to nearest, denormals flushed). Taking the pairs straight from the cache
// removes the float32 conversion of K and V and the horizontal sums of the generic path: a work item packs each
// block of 64 keys once, K as (dim 2p, dim 2p+1) pairs with the keys across the lanes (so one instruction scores
// 16 keys against a broadcast pair of q) and V as (key 2j, key 2j+1) pairs with the dims across the lanes (so
// one instruction adds two keys' weighted values into 16 dims). Every query still sums in a fixed order fixed by
// key positions alone (blocks at multiples of kKeyBlock, pairs at even positions), so its output stays
// bit-identical in any batch; it differs from the generic path only in rounding (scores are scaled after the
// dot product, pairs of products are added together).

// The 16 x 16 transpose of 32-bit elements: rows[i] lane l becomes rows[l] lane i. Four rounds swap the
// off-diagonal blocks of 8, 4, 2 and 1 lanes between rows i and i + b.
#define BATCHGEN_LIST(...) __VA_ARGS__
inline void transpose16(v16u rows[16]) {
#define BATCHGEN_SWAP(B, LO, HI)                                   \
  for (int i = 0; i < 16; ++i) {                                   \
    if (i & B) continue;                                           \
    const v16u a = rows[i], c = rows[i + B];                       \
    rows[i] = __builtin_shufflevector(a, c, LO);                   \
    rows[i + B] = __builtin_shufflevector(a, c, HI);               \
  }
  BATCHGEN_SWAP(8, BATCHGEN_LIST(0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23),
                BATCHGEN_LIST(8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31))
  BATCHGEN_SWAP(4, BATCHGEN_LIST(0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27),
                BATCHGEN_LIST(4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31))
  BATCHGEN_SWAP(2, BATCHGEN_LIST(0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29),
                BATCHGEN_LIST(2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31))
  BATCHGEN_SWAP(1, BATCHGEN_LIST(0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30),
                BATCHGEN_LIST(1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31))
#undef BATCHGEN_SWAP
}
#undef BATCHGEN_LIST

// Block packing for `block_len` keys at `slots` (keys past block_len read as zeros): kp[p * key_block + j] holds
// key j's dims (2p, 2p + 1) for the 16-key groups the block reaches; vp[(j / 2) * head_dim + d] holds dim d of keys
// j and j + 1 (even j). `pairs` = head_dim / 2, a multiple of 16. With `ahead`, requests kAheadKeys of the rows it
// aims at (the next block's, Scratch::request_next) at each step of 16 keys.
inline void pack_block(const uint16_t* k, const uint16_t* v, const int64_t* slots, int64_t block_len, int64_t pairs,
                       int64_t slot_stride, uint32_t* kp, uint32_t* vp, int64_t key_block = kKeyBlock,
                       Scratch* ahead = nullptr) {
  const int64_t head_dim = 2 * pairs;
  for (int64_t g = 0; g * kLanes < block_len; ++g) {
    if (ahead != nullptr) ahead->request_next(kAheadKeys);
    for (int64_t pg = 0; pg < pairs; pg += kLanes) {
      v16u rows[16];
      for (int64_t jj = 0; jj < kLanes; ++jj) {
        const int64_t j = g * kLanes + jj;
        if (j < block_len) {
          std::memcpy(&rows[jj], k + slots[j] * slot_stride + 2 * pg, sizeof(v16u));
        } else {
          rows[jj] = v16u{};
        }
      }
      transpose16(rows);
      for (int64_t pp = 0; pp < kLanes; ++pp) std::memcpy(kp + (pg + pp) * key_block + g * kLanes, &rows[pp], 64);
    }
  }
  // Interleaving two rows of 32 bfloat16s: the first 16 dims' pairs, then the last 16 dims' pairs.
  const __m512i first = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38,
                                         6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i last = _mm512_add_epi16(first, _mm512_set1_epi16(16));
  for (int64_t j = 0; j < block_len; j += 2) {
    if (ahead != nullptr && j % kLanes == 0) ahead->request_next(kAheadKeys);
    const uint16_t* a = v + slots[j] * slot_stride;
    const uint16_t* b = j + 1 < block_len ? v + slots[j + 1] * slot_stride : nullptr;
    uint32_t* dst = vp + (j / 2) * head_dim;
    for (int64_t d = 0; d < head_dim; d += 32) {
      const __m512i x = _mm512_loadu_si512(a + d);
      const __m512i y = b ? _mm512_loadu_si512(b + d) : _mm512_setzero_si512();
      _mm512_storeu_si512(dst + d, _mm512_permutex2var_epi16(x, first, y));
      _mm512_storeu_si512(dst + d + 16, _mm512_permutex2var_epi16(x, last, y));
    }
  }
}

inline __m512 dot_pairs(__m512 acc, __m512i a, __m512i b) {
  return _mm512_dpbf16_ps(acc, reinterpret_cast<__m512bh>(a), reinterpret_cast<__m512bh>(b));
}

// One query (qp: its head_dim / 2 bf16 pairs, unscaled) against one packed block of `seen` keys: the same
// online-softmax step as attend_block, on the packed K/V. DC: chunks of 16 dims when fixed (0: `chunks`).
template <int DC>
void attend_block_bf16(const uint32_t* qp, const uint32_t* kp, const uint32_t* vp, int64_t seen, int64_t chunks,
                       float scale, v16f* acc, float& row_max, float& row_sum, v16f* scores, uint32_t* probs) {
  const int64_t dc = DC ? DC : chunks, pairs = dc * kLanes / 2;
  const int64_t used = (seen + kLanes - 1) / kLanes;
  // Two running sums per 16 keys (even and odd pairs) so that consecutive instructions do not wait on each other.
  __m512 even[kKeyBlock / kLanes], odd[kKeyBlock / kLanes];
  for (int64_t g = 0; g < used; ++g) even[g] = odd[g] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; p += 2) {
    const __m512i q0 = _mm512_set1_epi32(static_cast<int>(qp[p])), q1 = _mm512_set1_epi32(static_cast<int>(qp[p + 1]));
    for (int64_t g = 0; g < used; ++g) {
      even[g] = dot_pairs(even[g], q0, _mm512_loadu_si512(kp + p * kKeyBlock + g * kLanes));
      odd[g] = dot_pairs(odd[g], q1, _mm512_loadu_si512(kp + (p + 1) * kKeyBlock + g * kLanes));
    }
  }
  for (int64_t g = 0; g < used; ++g) scores[g] = reinterpret_cast<v16f>(_mm512_add_ps(even[g], odd[g])) * scale;
  const float alpha = softmax_step(scores, seen, used, row_max, row_sum);
  // The probabilities weight V rounded to bfloat16 (to nearest even), as in the generic path; keys past `seen`
  // have probability 0.
  for (int64_t g = 0; g < used; g += 2) {
    const __m512 hi = g + 1 < used ? reinterpret_cast<__m512>(scores[g + 1]) : _mm512_setzero_ps();
    _mm512_storeu_si512(probs + g * kLanes / 2,
                        reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, reinterpret_cast<__m512>(scores[g]))));
  }
  __m512 even_acc[DC ? DC : 16], odd_acc[DC ? DC : 16];
  for (int64_t c = 0; c < dc; ++c) {
    even_acc[c] = reinterpret_cast<__m512>(acc[c] * alpha);
    odd_acc[c] = _mm512_setzero_ps();
  }
  const int64_t full_pairs = seen / 2;
  int64_t j = 0;
  for (; j + 1 < full_pairs; j += 2) {
    const __m512i p0 = _mm512_set1_epi32(static_cast<int>(probs[j]));
    const __m512i p1 = _mm512_set1_epi32(static_cast<int>(probs[j + 1]));
    const uint32_t* v0 = vp + j * dc * kLanes;
    for (int64_t c = 0; c < dc; ++c) {
      even_acc[c] = dot_pairs(even_acc[c], p0, _mm512_loadu_si512(v0 + c * kLanes));
      odd_acc[c] = dot_pairs(odd_acc[c], p1, _mm512_loadu_si512(v0 + (dc + c) * kLanes));
    }
  }
  if (j < full_pairs) {
    const __m512i p0 = _mm512_set1_epi32(static_cast<int>(probs[j]));
    for (int64_t c = 0; c < dc; ++c) {
      even_acc[c] = dot_pairs(even_acc[c], p0, _mm512_loadu_si512(vp + (j * dc + c) * kLanes));
    }
  }
  if (seen % 2) {
    // The last visible key pairs with the next position, a key this query must not see: its V is cleared (its
    // probability is already 0, but 0 x inf would be NaN), so the output never depends on it.
    const int64_t last = full_pairs;
    const __m512i p0 = _mm512_set1_epi32(static_cast<int>(probs[last]));
    const __m512i first_key = _mm512_set1_epi32(0xffff);
    for (int64_t c = 0; c < dc; ++c) {
      const __m512i v = _mm512_and_si512(_mm512_loadu_si512(vp + (last * dc + c) * kLanes), first_key);
      even_acc[c] = dot_pairs(even_acc[c], p0, v);
    }
  }
  for (int64_t c = 0; c < dc; ++c) acc[c] = reinterpret_cast<v16f>(_mm512_add_ps(even_acc[c], odd_acc[c]));
}

// Queries [first, last) of a work item (query i: new token i / group, head i % group of the KV head's group) copied
// as bfloat16 rows into w.q_pairs and started; returns the most keys any of them sees.
inline int64_t start_bf16_queries(const Shape& s, const c10::BFloat16* q, int64_t seq_len, int64_t q_start,
                                  int64_t q_len, int64_t kv_head, int64_t first, int64_t last, Scratch& w) {
  const int64_t group = s.num_heads / s.num_kv_heads;
  int64_t keys = 0;
  for (int64_t i = 0; i < last - first; ++i) {
    const int64_t t = (first + i) / group, head = kv_head * group + (first + i) % group;
    std::memcpy(&w.q_pairs[i * s.head_dim / 2], q + (q_start + t) * s.q_stride_token + head * s.q_stride_head,
                s.head_dim * sizeof(c10::BFloat16));
    w.start_query(i, seq_len - q_len + t + 1, s.chunks);
    keys = std::max(keys, w.limit[i]);
  }
  return keys;
}

// Queries [first, last) held in w against the block of `block_len` keys at position `block` (their slots in
// w.slots), packed here, through attend_block_bf16.
template <int DC>
void attend_queries_bf16(const Shape& s, const uint16_t* k16, const uint16_t* v16, int64_t first, int64_t last,
                         int64_t block, int64_t block_len, Scratch& w) {
  const int64_t dc = s.chunks, pairs = s.head_dim / 2;
  pack_block(k16, v16, w.slots.data(), block_len, pairs, s.kv_stride_slot, w.k_pairs.data(), w.v_pairs.data(),
             kKeyBlock, &w);
  w.request_next(w.ahead.keys);  // what the packing left of the next block
  for (int64_t i = first; i < last; ++i) {
    const int64_t seen = std::min(block_len, w.limit[i] - block);
    if (seen <= 0) continue;
    attend_block_bf16<DC>(&w.q_pairs[i * pairs], w.k_pairs.data(), w.v_pairs.data(), seen, dc, s.scale,
                          &w.acc[i * dc], w.row_max[i], w.row_sum[i], w.scores.data(), w.prob_pairs.data());
  }
}

// attend() for bfloat16 through the dot-product instructions; the same work item, inputs and result.
template <int DC>
bool attend_bf16(const Shape& s, const c10::BFloat16* q, const c10::BFloat16* k, const c10::BFloat16* v,
                 c10::BFloat16* out, const int64_t* slot_of_position, int64_t seq_len, int64_t q_start, int64_t q_len,
                 int64_t kv_head, int64_t first, int64_t last, Scratch& w) {
  const int64_t group = s.num_heads / s.num_kv_heads, dc = s.chunks, pairs = s.head_dim / 2, nq = last - first;
  const auto* k16 = reinterpret_cast<const uint16_t*>(k + kv_head * s.kv_stride_head);
  const auto* v16 = reinterpret_cast<const uint16_t*>(v + kv_head * s.kv_stride_head);
  const int64_t keys = start_bf16_queries(s, q, seq_len, q_start, q_len, kv_head, first, last, w);
  auto attend = [&](int64_t block, int64_t block_len) {
    attend_queries_bf16<DC>(s, k16, v16, 0, nq, block, block_len, w);
  };
  if (!over_key_blocks(s, k16, v16, slot_of_position, 0, keys, kKeyBlock, w, attend)) return false;
  for (int64_t i = 0; i < nq; ++i) {
    const int64_t t = (first + i) / group, head = kv_head * group + (first + i) % group;
    w.finish_query(i, dc, s.head_dim, out + (q_start + t) * s.out_stride_token + head * s.out_stride_head);
  }
  return true;
}


// The queries of a shared prefix's rows `members` (indices into the round's rows, each with all its queries) copied
// as bfloat16 rows into w.q_pairs, in member order, and started; returns how many.
inline int64_t start_shared_queries(const Shape& s, const c10::BFloat16* q, const Rows& rows, const int64_t* members,
                                    int64_t num_members, int64_t kv_head, Scratch& w) {
  const int64_t group = s.num_heads / s.num_kv_heads;
  int64_t nq = 0;
  for (int64_t m = 0; m < num_members; ++m) {
    const int64_t r = members[m];
    for (int64_t i = 0; i < rows.q_lens[r] * group; ++i, ++nq) {
      const int64_t t = i / group, head = kv_head * group + i % group;
      std::memcpy(&w.q_pairs[nq * s.head_dim / 2],
                  q + (rows.q_starts[r] + t) * s.q_stride_token + head * s.q_stride_head,
                  s.head_dim * sizeof(c10::BFloat16));
      w.start_query(nq, rows.seq_lens[r] - rows.q_lens[r] + t + 1, s.chunks);
    }
  }
  return nq;
}

// Member m's first block of its own keys (from position `from`, blocks of `block`) in a shared prefix's item: where
// the packing before it requests ahead.
inline Scratch::AheadRows member_tail(const uint16_t* k16, const uint16_t* v16, const Rows& rows,
                                      const int64_t* members, int64_t m, int64_t from, int64_t block) {
  const int64_t r = members[m];
  return Scratch::rows_at(k16, v16, rows.slots_of(r) + from, std::min(block, rows.seq_lens[r] - from));
}

// The end of a shared prefix's work item: each member's queries (held in w in member order, as
// start_shared_queries put them) go on from key `from` over the member's own blocks of `block` keys, through
// attend(first, last, block position, block length) for the member's queries [first, last), then are written out.
// False where a slot lies outside the pool.
template <typename Attend>
bool finish_shared_members(const Shape& s, const uint16_t* k16, const uint16_t* v16, c10::BFloat16* out,
                           const Rows& rows, const int64_t* members, int64_t num_members, int64_t from, int64_t block,
                           int64_t kv_head, Scratch& w, Attend attend) {
  const int64_t group = s.num_heads / s.num_kv_heads;
  int64_t first = 0;
  for (int64_t m = 0; m < num_members; ++m) {
    const int64_t r = members[m], last = first + rows.q_lens[r] * group;
    const int64_t keys = rows.seq_lens[r];  // what the member's last query sees
    auto attend_member = [&](int64_t at, int64_t block_len) { attend(first, last, at, block_len); };
    const Scratch::AheadRows then =
        m + 1 < num_members ? member_tail(k16, v16, rows, members, m + 1, from, block) : w.next_item;
    if (!over_key_blocks(s, k16, v16, rows.slots_of(r), from, keys, block, w, attend_member, &then)) return false;
    for (int64_t i = first; i < last; ++i) {
      const int64_t t = (i - first) / group, head = kv_head * group + (i - first) % group;
      w.finish_query(i, s.chunks, s.head_dim,
                     out + (rows.q_starts[r] + t) * s.out_stride_token + head * s.out_stride_head);
    }
    first = last;
  }
  return true;
}

// attend_bf16 for the rows of a shared prefix (attention_shared.h): rows `members` (indices into the round's rows,
// each with all its queries) whose first `depth` blocks of kKeyBlock keys are the same pool slots. Those blocks are
// packed once and run for every member's queries; then each member goes on over its own blocks. A query meets the
// same packed blocks in the same order, through the same attend_block_bf16 calls, as attend_bf16 gives it alone,
// so its output is the same bits; only the reads of the shared K/V and their packing are not repeated.
template <int DC>
bool attend_bf16_shared(const Shape& s, const c10::BFloat16* q, const c10::BFloat16* k, const c10::BFloat16* v,
                        c10::BFloat16* out, const Rows& rows, const int64_t* members, int64_t num_members,
                        int64_t depth, int64_t kv_head, Scratch& w) {
  const auto* k16 = reinterpret_cast<const uint16_t*>(k + kv_head * s.kv_stride_head);
  const auto* v16 = reinterpret_cast<const uint16_t*>(v + kv_head * s.kv_stride_head);
  const int64_t nq = start_shared_queries(s, q, rows, members, num_members, kv_head, w);
  auto attend = [&](int64_t first, int64_t last, int64_t block, int64_t block_len) {
    attend_queries_bf16<DC>(s, k16, v16, first, last, block, block_len, w);
  };
  auto attend_all = [&](int64_t block, int64_t block_len) { attend(0, nq, block, block_len); };
  const int64_t shared_keys = depth * kKeyBlock;
  const Scratch::AheadRows tail = member_tail(k16, v16, rows, members, 0, shared_keys, kKeyBlock);
  if (!over_key_blocks(s, k16, v16, rows.slots_of(members[0]), 0, shared_keys, kKeyBlock, w, attend_all, &tail)) {
    return false;
  }
  return finish_shared_members(s, k16, v16, out, rows, members, num_members, shared_keys, kKeyBlock, kv_head, w,
                               attend);
}

}  // namespace

#endif  // BATCHGEN_BF16_DOT
