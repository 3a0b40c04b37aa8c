// The paged-attention kernel's work items on the float32 vector paths (paged_attention.cpp): each block of K/V is
// converted to float32 once and every query of the item runs over it, with the generic block step
// (attention_generic.h) or, on AVX2 without AVX-512, the 8-lane one (attention_avx2.h). attend() runs one row's
// queries for one KV head; attend_shared() runs several rows that share a cached prefix, converting the prefix's
// blocks once for all of them (the vector paths' counterpart of attend_bf16_shared).
#pragma once

#include "attention_avx2.h"
#include "attention_common.h"
#include "attention_generic.h"

#include <algorithm>
#include <cstdint>

namespace {

// Whether the 8-lane AVX2 block step serves heads of this size: whole registers of each row, nothing past it.
inline bool avx2_block_fits(int64_t head_dim) {
#ifdef BATCHGEN_AVX2_BLOCK
  return head_dim % kAvx2Lanes == 0;
#else
  (void)head_dim;
  return false;
#endif
}

// Scratch query i = query head `head` of q's token `token`, scaled; it sees `visible` keys.
template <typename T>
void load_query(const Shape& s, const T* q, int64_t token, int64_t head, int64_t i, int64_t visible, Scratch& w) {
  v16f* qi = &w.q[i * s.chunks];
  load_row(q + token * s.q_stride_token + head * s.q_stride_head, s.head_dim, qi);
  for (int64_t c = 0; c < s.chunks; ++c) qi[c] *= s.scale;
  w.start_query(i, visible, s.chunks);
}

// The block of `block_len` keys at w.slots (from position `block` of slot_of_position, whose first `keys`
// positions are readable) into w.keys / w.values as float32 rows of the head at kv_offset.
template <typename T>
void load_block(const Shape& s, const T* k, const T* v, int64_t kv_offset, const int64_t* slot_of_position,
                int64_t block, int64_t block_len, int64_t keys, Scratch& w) {
  const int64_t dc = s.chunks;
  const bool avx2 = avx2_block_fits(s.head_dim);
  for (int64_t j = 0; j < block_len; ++j) {
    const int64_t ahead = block + j + kPrefetchKeys;
    prefetch_positions(s, k + kv_offset, v + kv_offset, slot_of_position, ahead, ahead + 1, keys);
    const T* k_row = k + kv_offset + w.slots[j] * s.kv_stride_slot;
    const T* v_row = v + kv_offset + w.slots[j] * s.kv_stride_slot;
#ifdef BATCHGEN_AVX2_BLOCK
    if (avx2) {
      widen_row(k_row, s.head_dim, &w.keys[j * dc]);
      widen_row(v_row, s.head_dim, &w.values[j * dc]);
      continue;
    }
#endif
    (void)avx2;
    load_row(k_row, s.head_dim, &w.keys[j * dc]);
    load_row(v_row, s.head_dim, &w.values[j * dc]);
  }
}

// Scratch queries [first, last) over the loaded block of `block_len` keys from position `block`.
template <typename T, int DC>
void attend_loaded(const Shape& s, int64_t first, int64_t last, int64_t block, int64_t block_len, Scratch& w) {
  const int64_t dc = s.chunks;
  const bool avx2 = avx2_block_fits(s.head_dim);
  auto seen_by = [&](int64_t i) { return std::min(block_len, w.limit[i] - block); };
  for (int64_t i = first; i < last;) {
    const int64_t seen = seen_by(i);
    if (seen <= 0) {  // this query's keys all lie before the block
      ++i;
      continue;
    }
#ifdef BATCHGEN_AVX2_BLOCK
    if (avx2) {
      // Up to three queries that see the same keys (a token's query heads, or rows' heads over a shared prefix)
      // go together, each K/V chunk loaded once for all of them.
      int64_t count = 1;
      while (count < 3 && i + count < last && seen_by(i + count) == seen) ++count;
      attend_queries_avx2<T>(count, i, w.keys.data(), w.values.data(), seen, s.head_dim, dc, w.q.data(),
                             w.acc.data(), w.row_max.data(), w.row_sum.data(), w.scores.data());
      i += count;
      continue;
    }
#endif
    (void)avx2;
    attend_block<T, DC>(&w.q[i * dc], w.keys.data(), w.values.data(), seen, dc, &w.acc[i * dc], w.row_max[i],
                        w.row_sum[i], w.scores.data(), w.odd.data());
    ++i;
  }
}

// Queries [first, last) of one (row, kv head) work item; query i is new token i / group, head i % group of
// the kv head's group. Returns false when req_to_token names a slot outside the pool (nothing is read there).
template <typename T, int DC>
bool attend(const Shape& s, const T* q, const T* k, const T* v, T* out, const int64_t* slot_of_position,
            int64_t seq_len, int64_t q_start, int64_t q_len, int64_t kv_head, int64_t first, int64_t last,
            Scratch& w) {
  const int64_t group = s.num_heads / s.num_kv_heads, nq = last - first;
  const int64_t kv_offset = kv_head * s.kv_stride_head;
  int64_t keys = 0;  // keys any query here can see
  for (int64_t i = 0; i < nq; ++i) {
    const int64_t t = (first + i) / group, head = kv_head * group + (first + i) % group;
    // The new token t sits at position seq_len - q_len + t and sees keys 0..that position.
    load_query(s, q, q_start + t, head, i, seq_len - q_len + t + 1, w);
    keys = std::max(keys, w.limit[i]);
  }
  for (int64_t block = 0; block < keys; block += kKeyBlock) {
    const int64_t block_len = std::min(kKeyBlock, keys - block);
    if (!w.take_slots(slot_of_position, block, block_len, s.num_slots)) return false;
    load_block(s, k, v, kv_offset, slot_of_position, block, block_len, keys, w);
    attend_loaded<T, DC>(s, 0, nq, block, block_len, w);
  }
  for (int64_t i = 0; i < nq; ++i) {
    const int64_t t = (first + i) / group, head = kv_head * group + (first + i) % group;
    w.finish_query(i, s.chunks, s.head_dim, out + (q_start + t) * s.out_stride_token + head * s.out_stride_head);
  }
  return true;
}

// All queries of the `members` rows (their indices in the call) for one KV head, rows whose first `depth` blocks
// of keys are the same pool slots, seen whole by every query. Those blocks are converted once and run for every
// member's queries; then each member goes on over its own blocks. A query meets the same converted blocks in the
// same order, through the same block steps, as attend() gives it alone, so its output is the same bits.
template <typename T, int DC>
bool attend_shared(const Shape& s, const T* q, const T* k, const T* v, T* out, const Rows& rows,
                   const int64_t* members, int64_t num_members, int64_t depth, int64_t kv_head, Scratch& w) {
  const int64_t group = s.num_heads / s.num_kv_heads, kv_offset = kv_head * s.kv_stride_head;
  int64_t nq = 0;
  for (int64_t m = 0; m < num_members; ++m) {
    const int64_t r = members[m];
    for (int64_t i = 0; i < rows.q_lens[r] * group; ++i, ++nq) {
      const int64_t t = i / group;
      load_query(s, q, rows.q_starts[r] + t, kv_head * group + i % group, nq,
                 rows.seq_lens[r] - rows.q_lens[r] + t + 1, w);
    }
  }
  const int64_t* shared_slots = rows.slots_of(members[0]);
  const int64_t shared_keys = depth * kKeyBlock;
  for (int64_t block = 0; block < shared_keys; block += kKeyBlock) {
    if (!w.take_slots(shared_slots, block, kKeyBlock, s.num_slots)) return false;
    load_block(s, k, v, kv_offset, shared_slots, block, kKeyBlock, shared_keys, w);
    attend_loaded<T, DC>(s, 0, nq, block, kKeyBlock, w);
  }
  int64_t first = 0;
  for (int64_t m = 0; m < num_members; ++m) {
    const int64_t r = members[m], last = first + rows.q_lens[r] * group;
    const int64_t keys = rows.seq_lens[r];  // what the member's last query sees
    for (int64_t block = shared_keys; block < keys; block += kKeyBlock) {
      const int64_t block_len = std::min(kKeyBlock, keys - block);
      if (!w.take_slots(rows.slots_of(r), block, block_len, s.num_slots)) return false;
      load_block(s, k, v, kv_offset, rows.slots_of(r), block, block_len, keys, w);
      attend_loaded<T, DC>(s, first, last, block, block_len, w);
    }
    for (int64_t i = first; i < last; ++i) {
      const int64_t t = (i - first) / group, head = kv_head * group + (i - first) % group;
      w.finish_query(i, s.chunks, s.head_dim,
                     out + (rows.q_starts[r] + t) * s.out_stride_token + head * s.out_stride_head);
    }
    first = last;
  }
  return true;
}

}  // namespace
