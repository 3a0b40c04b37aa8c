// The paged-attention kernel's work item on the float32 vector paths (paged_attention.cpp): attend() converts each
// block of K/V to float32 once and runs every query of the item over it, with the generic block step
// (attention_generic.h) or, on AVX2 without AVX-512, the 8-lane one (attention_avx2.h).
#pragma once

#include "attention_avx2.h"
#include "attention_common.h"
#include "attention_generic.h"

#include <algorithm>
#include <cstdint>

namespace {

// Queries [first, last) of one (row, kv head) work item; query i is new token i / group, head i % group of
// the kv head's group. Returns false when req_to_token names a slot outside the pool (nothing is read there).
template <typename T, int DC>
bool attend(const Shape& s, const T* q, const T* k, const T* v, T* out, const int64_t* slot_of_position,
            int64_t seq_len, int64_t q_start, int64_t q_len, int64_t kv_head, int64_t first, int64_t last,
            Scratch& w) {
  const int64_t group = s.num_heads / s.num_kv_heads, dc = s.chunks, nq = last - first;
  const int64_t kv_offset = kv_head * s.kv_stride_head;
#ifdef BATCHGEN_AVX2_BLOCK
  const bool avx2_block = s.head_dim % kAvx2Lanes == 0;  // whole registers of each row, nothing past it
#endif
  int64_t keys = 0;  // keys any query here can see
  for (int64_t i = 0; i < nq; ++i) {
    const int64_t t = (first + i) / group, head = kv_head * group + (first + i) % group;
    v16f* qi = &w.q[i * dc];
    load_row(q + (q_start + t) * s.q_stride_token + head * s.q_stride_head, s.head_dim, qi);
    for (int64_t c = 0; c < dc; ++c) qi[c] *= s.scale;
    // The new token t sits at position seq_len - q_len + t and sees keys 0..that position.
    w.start_query(i, seq_len - q_len + t + 1, dc);
    keys = std::max(keys, w.limit[i]);
  }
  for (int64_t block = 0; block < keys; block += kKeyBlock) {
    const int64_t block_len = std::min(kKeyBlock, keys - block);
    if (!w.take_slots(slot_of_position, block, block_len, s.num_slots)) return false;
    for (int64_t j = 0; j < block_len; ++j) {
      // Slots may be anywhere in the pool, so the hardware prefetcher cannot guess the next rows: ask for them.
      if (block + j + kPrefetchKeys < keys) {
        const int64_t ahead = slot_of_position[block + j + kPrefetchKeys];
        if (ahead >= 0 && ahead < s.num_slots) {
          prefetch_row(k + kv_offset + ahead * s.kv_stride_slot, s.head_dim);
          prefetch_row(v + kv_offset + ahead * s.kv_stride_slot, s.head_dim);
        }
      }
#ifdef BATCHGEN_AVX2_BLOCK
      if (avx2_block) {
        widen_row(k + kv_offset + w.slots[j] * s.kv_stride_slot, s.head_dim, &w.keys[j * dc]);
        widen_row(v + kv_offset + w.slots[j] * s.kv_stride_slot, s.head_dim, &w.values[j * dc]);
        continue;
      }
#endif
      load_row(k + kv_offset + w.slots[j] * s.kv_stride_slot, s.head_dim, &w.keys[j * dc]);
      load_row(v + kv_offset + w.slots[j] * s.kv_stride_slot, s.head_dim, &w.values[j * dc]);
    }
    for (int64_t i = 0; i < nq; ++i) {
      const int64_t seen = std::min(block_len, w.limit[i] - block);
      if (seen <= 0) continue;  // this query's keys all lie before the block
#ifdef BATCHGEN_AVX2_BLOCK
      if (avx2_block) {
        attend_block_avx2<T>(&w.q[i * dc], w.keys.data(), w.values.data(), seen, s.head_dim, dc, &w.acc[i * dc],
                             w.row_max[i], w.row_sum[i], w.scores.data());
        continue;
      }
#endif
      attend_block<T, DC>(&w.q[i * dc], w.keys.data(), w.values.data(), seen, dc, &w.acc[i * dc],
                          w.row_max[i], w.row_sum[i], w.scores.data(), w.odd.data());
    }
  }
  for (int64_t i = 0; i < nq; ++i) {
    const int64_t t = (first + i) / group, head = kv_head * group + (first + i) % group;
    w.finish_query(i, dc, s.head_dim, out + (q_start + t) * s.out_stride_token + head * s.out_stride_head);
  }
  return true;
}

}  // namespace
