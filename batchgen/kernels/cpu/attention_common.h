// What the paged-attention kernel's two paths share (paged_attention.cpp: the generic float32 path;
// attention_bf16.h: bfloat16 through vdpbf16ps): block sizes, the work item's per-thread scratch, loading a
// row as float32 chunks, the fixed-order horizontal sums and the online-softmax step.
#pragma once

#include "vec16.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

// bfloat16 pairs through vdpbf16ps (AVX512-BF16), where the machine has it; elsewhere the generic path.
#if defined(BATCHGEN_HAS_SHUFFLE) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#define BATCHGEN_BF16_DOT 1
#endif

namespace {

constexpr int64_t kKeyBlock = 64;      // keys per online-softmax step (a multiple of kLanes)
// The brgemm path's step (attention_brgemm.h): longer, so that each GEMM call does more work.
constexpr int64_t kGemmKeyBlock = 256;
// The keys its GEMMs run over in a block are the block's rounded up to this (gemm_keys): P is written 32
// bfloat16s (two float32 vectors) at a time, and it is one AMX tile's depth in bfloat16.
constexpr int64_t kGemmKeyStep = 32;
// Rows with fewer queries (new tokens x GQA group) than this stay on the vector path where brgemm is asked for rows
// of many queries (BrgemmRows::MANY_QUERIES), unless they share a prefix with others: with a handful of queries the
// GEMM calls cost more than they save (docs/performance.md). They are also the rows grouped by shared prefix.
constexpr int64_t kGemmMinQueries = 8;
// Queries of a brgemm work item: the GEMMs' rows; more of them pack each block of K/V for more queries.
constexpr int64_t kGemmQueryBlock = 192;
// Queries of the rows that read one shared prefix together (attention_shared.h): more rows per pass read the prefix
// fewer times, fewer leave the threads more passes to share.
constexpr int64_t kSharedQueries = 192;
constexpr int64_t kQueryBlock = 64;    // queries sharing one pass over K/V (bounds the scratch per thread)
constexpr int64_t kPrefetchKeys = 16;  // how far ahead the K/V rows are requested
// The next block's keys requested at each step of 16 keys of pack_block's K and V loops: one of its keys for each
// key packed, so the memory reads run at one pace rather than in a burst the core stalls on (docs/performance.md).
constexpr int64_t kAheadKeys = 8;

// ---- loading a row of q or of the cache as float32 chunks ----

// dst[0 .. ceil(n / 16)) = src[0 .. n) as float, the last chunk zero-padded (nothing past src[n - 1] is read).
template <typename T>
inline void load_row(const T* src, int64_t n, v16f* dst) {
  const int64_t full = n / kLanes, tail = n % kLanes;
  for (int64_t c = 0; c < full; ++c) dst[c] = load16(src + c * kLanes);
  if (tail) {
    v16f v = {};
    for (int64_t l = 0; l < tail; ++l) v[l] = to_float(src[full * kLanes + l]);
    dst[full] = v;
  }
}

// The empty volatile asm keeps the requests: GCC 12 counts __builtin_prefetch as no side effect, so it finds a
// function that only requests rows (prefetch_positions, below) pure and deletes its calls (docs/performance.md).
template <typename T>
inline void prefetch_row(const T* p, int64_t n) {
  const char* bytes = reinterpret_cast<const char*>(p);
  for (int64_t b = 0; b < n * static_cast<int64_t>(sizeof(T)); b += 64) {
    __builtin_prefetch(bytes + b);
    asm volatile("");
  }
}

// ---- horizontal sums, max and exp, each in one fixed order ----

// The sum of each of 16 vectors, as lanes 0..15 of one vector. Every vector is summed by the same tree:
// lanes l + (l + 8), then + 4, + 2, + 1; the shuffles only move lanes, never mix two inputs' lanes.
inline v16f sum16(const v16f* d) {
#ifdef BATCHGEN_HAS_SHUFFLE
  v16f h[8], q[4], e[2];
  for (int k = 0; k < 8; ++k) {  // [d[2k] lanes l + l+8 | d[2k+1] lanes l + l+8], l < 8
    h[k] = __builtin_shufflevector(d[2 * k], d[2 * k + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(d[2 * k], d[2 * k + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29,
                                   30, 31);
  }
  for (int k = 0; k < 4; ++k) {  // four inputs, four lanes each
    q[k] = __builtin_shufflevector(h[2 * k], h[2 * k + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26,
                                   27) +
           __builtin_shufflevector(h[2 * k], h[2 * k + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30,
                                   31);
  }
  for (int k = 0; k < 2; ++k) {  // eight inputs, two lanes each
    e[k] = __builtin_shufflevector(q[2 * k], q[2 * k + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28,
                                   29) +
           __builtin_shufflevector(q[2 * k], q[2 * k + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30,
                                   31);
  }
  return __builtin_shufflevector(e[0], e[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         __builtin_shufflevector(e[0], e[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
#else
  v16f out;
  for (int k = 0; k < 16; ++k) {
    float h[8], q[4];
    for (int l = 0; l < 8; ++l) h[l] = d[k][l] + d[k][l + 8];
    for (int l = 0; l < 4; ++l) q[l] = h[l] + h[l + 4];
    out[k] = (q[0] + q[2]) + (q[1] + q[3]);
  }
  return out;
#endif
}

inline float hmax(v16f a) {
  float m = a[0];
  for (int64_t l = 1; l < kLanes; ++l) m = std::max(m, a[l]);
  return m;
}

struct Shape {
  int64_t num_heads, num_kv_heads, head_dim, chunks, num_slots;
  int64_t q_stride_token, q_stride_head, out_stride_token, out_stride_head;
  int64_t kv_stride_head, kv_stride_slot;
  float scale;
};

// The rows of one call: row r is request row pool_rows[r] of req_to_token, seq_lens[r] tokens long, of which the last
// q_lens[r] are new, at q_starts[r] in q.
struct Rows {
  const int64_t *req_to_token, *pool_rows, *seq_lens, *q_starts, *q_lens;
  int64_t table_stride;
  const int64_t* slots_of(int64_t r) const { return req_to_token + pool_rows[r] * table_stride; }
};

// The K and V rows (of the head at k, v) of positions [from, min(to, keys)) requested ahead of their block: their
// slots may be anywhere in the pool, so the hardware prefetcher cannot guess them. Slots outside the pool are
// skipped (the block's own check reports them).
template <typename T>
inline void prefetch_positions(const Shape& s, const T* k, const T* v, const int64_t* slot_of_position, int64_t from,
                               int64_t to, int64_t keys) {
  for (int64_t j = from; j < std::min(to, keys); ++j) {
    const int64_t slot = slot_of_position[j];
    if (slot >= 0 && slot < s.num_slots) {
      prefetch_row(k + slot * s.kv_stride_slot, s.head_dim);
      prefetch_row(v + slot * s.kv_stride_slot, s.head_dim);
    }
  }
}

// Per-thread scratch, sized once per call.
struct Scratch {
  std::vector<v16f> q, acc, keys, values;  // [queries][chunks] x 2, [kKeyBlock][chunks] x 2
  std::vector<v16f> scores;                // a block's scores: one query's, or the AVX2 step's 2-3 queries'
  std::vector<v16f> odd;                   // [chunks]: a running sum when the head size is not fixed
  std::vector<float> row_max, row_sum;
  std::vector<int64_t> limit, slots;
  std::vector<uint32_t> q_pairs, k_pairs, v_pairs, prob_pairs;  // the bfloat16 dot-product path's packed operands
  std::vector<float> block_scores;     // the brgemm path's S, [queries][kGemmKeyBlock]
  std::vector<uint16_t> block_probs;   // and its P in bfloat16, [queries][kGemmKeyBlock]
  // K/V rows the bfloat16 paths request into L2 as they pack a block (request_next): the next block of its row; after
  // a row's last block, the next member's first own block in a shared prefix's item, or the first block of the item
  // this thread takes next (run() claims it one ahead). A decode row's keys come from DRAM, where the prefetchers
  // alone leave the packing waiting.
  struct AheadRows {
    const char *k = nullptr, *v = nullptr;  // the KV head's K and V
    const int64_t* slots = nullptr;         // the slots of its positions
    int64_t keys = 0, requested = 0;
  };
  AheadRows ahead, next_item;
  int64_t num_slots = 0, slot_bytes = 0, row_bytes = 0;
  Scratch(int64_t queries, int64_t chunks)
      : q(queries * chunks),
        acc(queries * chunks),
        keys(kKeyBlock * chunks),
        values(kKeyBlock * chunks),
        scores(kGemmKeyBlock / kLanes),
        odd(chunks),
        row_max(queries),
        row_sum(queries),
        limit(queries),
        slots(kGemmKeyBlock),
        q_pairs(queries * chunks * kLanes / 2),
        k_pairs(chunks * kLanes / 2 * kGemmKeyBlock),
        v_pairs(kGemmKeyBlock / 2 * chunks * kLanes),
        prob_pairs(kKeyBlock / 2),
        block_scores(queries * kGemmKeyBlock),
        block_probs(queries * kGemmKeyBlock) {}

  // Query i of a work item starts over: it sees `visible` keys (positions 0 .. visible - 1), has no scores yet.
  void start_query(int64_t i, int64_t visible, int64_t chunks) {
    limit[i] = visible;
    row_max[i] = -kInf;
    row_sum[i] = 0.f;
    std::fill_n(&acc[i * chunks], chunks, v16f{});
  }

  // The pool's geometry for request_next, once a call (T: the pool's element type).
  template <typename T>
  void use_pool(const Shape& s) {
    num_slots = s.num_slots;
    slot_bytes = s.kv_stride_slot * static_cast<int64_t>(sizeof(T));
    row_bytes = s.head_dim * static_cast<int64_t>(sizeof(T));
  }

  // Rows `keys` positions from slot_of_position of the KV head at k, v, none requested yet.
  template <typename T>
  static AheadRows rows_at(const T* k, const T* v, const int64_t* slot_of_position, int64_t keys) {
    return {reinterpret_cast<const char*>(k), reinterpret_cast<const char*>(v), slot_of_position, keys, 0};
  }

  // Requests the next n of `ahead`'s rows not yet requested into L2 (prefetcht1: L1 holds the block being packed).
  void request_next(int64_t n) {
    const int64_t end = std::min(ahead.keys, ahead.requested + n);
    for (int64_t j = ahead.requested; j < end; ++j) {
      const int64_t slot = ahead.slots[j];
      if (slot < 0 || slot >= num_slots) continue;
      for (int64_t b = 0; b < row_bytes; b += 64) {
        __builtin_prefetch(ahead.k + slot * slot_bytes + b, 0, 2);
        __builtin_prefetch(ahead.v + slot * slot_bytes + b, 0, 2);
      }
    }
    ahead.requested = end;
  }

  // slots[0 .. block_len) = the KV slots of positions block .. block + block_len - 1; false when one lies outside
  // the pool's num_slots (nothing is read there).
  bool take_slots(const int64_t* slot_of_position, int64_t block, int64_t block_len, int64_t num_slots) {
    for (int64_t j = 0; j < block_len; ++j) {
      const int64_t slot = slot_of_position[block + j];
      if (slot < 0 || slot >= num_slots) return false;
      slots[j] = slot;
    }
    return true;
  }

  // Query i's output, acc / row_sum rounded to T (c10 rounds to nearest even), into dst[0 .. head_dim). Adding 0
  // turns a -0 into +0 and changes nothing else: a sum that came to zero has the sign of its last terms, and the
  // brgemm path's sums end in as many exact zeros (keys past the query) as its row has keys after it in the block.
  template <typename T>
  void finish_query(int64_t i, int64_t chunks, int64_t head_dim, T* dst) const {
    const float* sums = reinterpret_cast<const float*>(&acc[i * chunks]);
    for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<T>(sums[d] / row_sum[i] + 0.f);
  }
};

// Runs attend(position, length) over the blocks of `block` keys in positions [from, keys) of slot_of_position, each
// block's slots taken into w.slots first and w.ahead aimed at the next block's K/V rows (of the head at k, v), or
// after the last block at `then` (default: the thread's next item), for attend's packing to request as it goes.
// False where a slot lies outside the pool (nothing is read there).
template <typename T, typename Attend>
bool over_key_blocks(const Shape& s, const T* k, const T* v, const int64_t* slot_of_position, int64_t from,
                     int64_t keys, int64_t block, Scratch& w, Attend attend,
                     const Scratch::AheadRows* then = nullptr) {
  for (int64_t at = from; at < keys; at += block) {
    const int64_t len = std::min(block, keys - at);
    if (!w.take_slots(slot_of_position, at, len, s.num_slots)) return false;
    const int64_t rest = keys - at - block;  // attend's packing requests w.ahead as it goes (pack_block)
    if (rest > 0) {
      w.ahead = Scratch::rows_at(k, v, slot_of_position + at + block, std::min(block, rest));
    } else {
      w.ahead = then != nullptr ? *then : w.next_item;
    }
    attend(at, len);
  }
  return true;
}

// x rounded to T's precision (to nearest even) and back: probabilities in half precision, as SDPA and
// FlashAttention weight V with. Only for x in [0, 1], as here (no NaN, no overflow).
template <typename T>
inline v16f round_to(v16f x) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    const v16u bits = reinterpret_cast<v16u>(x);
    return reinterpret_cast<v16f>((bits + 0x7fffu + ((bits >> 16) & 1u)) & 0xffff0000u);
  } else if constexpr (std::is_same_v<T, c10::Half>) {
#if defined(__AVX512F__)
    const __m256i half = _mm512_cvtps_ph(reinterpret_cast<__m512>(x), _MM_FROUND_TO_NEAREST_INT);
    return reinterpret_cast<v16f>(_mm512_cvtph_ps(half));
#else
    for (int64_t l = 0; l < kLanes; ++l) x[l] = static_cast<float>(c10::Half(x[l]));
    return x;
#endif
  } else {
    return x;
  }
}

// The online-softmax step of one query over a block (Milakov & Gimelshein 2018): scores [used chunks of 16], of
// which the first `seen` are keys it sees, become exp(score - new max) (0 past `seen`); (row_max, row_sum) move to
// the new max. Returns alpha = exp(old max - new max), the factor that rescales what the query accumulated so far.
inline float softmax_step(v16f* scores, int64_t seen, int64_t used, float& row_max, float& row_sum) {
  float* flat = reinterpret_cast<float*>(scores);
  std::fill(flat + seen, flat + used * kLanes, -kInf);
  v16f m = scores[0];
  for (int64_t g = 1; g < used; ++g) m = m > scores[g] ? m : scores[g];
  const float new_max = std::max(row_max, hmax(m));
  const float alpha = std::exp(row_max - new_max);  // 0 on the first block (exp(-inf))
  v16f sum = {};
  for (int64_t g = 0; g < used; ++g) {
    scores[g] = exp_nonpositive(scores[g] - new_max);
    sum += scores[g];
  }
  row_sum = row_sum * alpha + hsum(sum);
  row_max = new_max;
  return alpha;
}

}  // namespace
