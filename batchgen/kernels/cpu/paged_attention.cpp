// Paged attention on the CPU: each query attends to its request's keys and values read in place from the
// head-major KV pool through req_to_token, with an online softmax (Milakov & Gimelshein 2018, "Online
// normalizer calculation for softmax"; the recurrence FlashAttention uses). Dot products, softmax and the
// weighted sum of V accumulate in float32; in bfloat16/float16 the probabilities are rounded to that type
// before they weight V, as in PyTorch's SDPA and FlashAttention (see attend_block).
//
// Work is split over (request row, block of its queries, KV head). A work item holds queries that share the
// head's K/V (the row's new tokens times the GQA group), so each K and V vector is loaded and converted to
// float32 once per block of kKeyBlock keys; the queries then run over the converted block, in L1/L2.
//
// Determinism: a query's arithmetic depends only on its own inputs. Key blocks start at fixed positions
// (multiples of kKeyBlock from position 0), reductions run in a fixed order, and a query stops at its own
// last visible key, so its output is bit-identical whatever else is in the batch, however many new tokens
// its row has, and whichever thread runs it.
//
// bfloat16 on a machine with AVX512-BF16 takes its own path (attend_bf16 below): K/V pairs go straight into
// vdpbf16ps, the same accumulation in float32 with fewer instructions, fast enough for prefill rows as well.
//
// Built JIT by batchgen/kernels/cpu/__init__.py with -O3 -march=native -fopenmp. The float32 math is
// written with GCC/Clang vector extensions (16 floats), which the compiler maps onto the machine's SIMD
// (one AVX-512 register, two AVX2 ones, ...); no -ffast-math, since nothing here needs reassociating. Only
// the bfloat16/float16 conversions use x86 intrinsics where the machine has them, with portable fallbacks.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "vec16.h"

#include <algorithm>
#include <atomic>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

// bfloat16 pairs through vdpbf16ps (AVX512-BF16), where the machine has it; elsewhere the generic path.
#if defined(BATCHGEN_HAS_SHUFFLE) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#define BATCHGEN_BF16_DOT 1
#endif

namespace {

constexpr int64_t kKeyBlock = 64;      // keys per online-softmax step (a multiple of kLanes)
constexpr int64_t kQueryBlock = 64;    // queries sharing one pass over K/V (bounds the scratch per thread)
constexpr int64_t kPrefetchKeys = 16;  // how far ahead the K/V rows are requested

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

template <typename T>
inline void prefetch_row(const T* p, int64_t n) {
  const char* bytes = reinterpret_cast<const char*>(p);
  for (int64_t b = 0; b < n * static_cast<int64_t>(sizeof(T)); b += 64) __builtin_prefetch(bytes + b);
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
  int64_t num_heads, num_kv_heads, head_dim, chunks, num_slots, table_stride;
  int64_t q_stride_token, q_stride_head, out_stride_token, out_stride_head;
  int64_t kv_stride_head, kv_stride_slot;
  float scale;
};

// Per-thread scratch, sized once per call.
struct Scratch {
  std::vector<v16f> q, acc, keys, values;  // [queries][chunks] x 2, [kKeyBlock][chunks] x 2
  std::vector<v16f> scores;                // one query's scores for the block, [kKeyBlock / 16]
  std::vector<v16f> odd;                   // [chunks]: a running sum when the head size is not fixed
  std::vector<float> row_max, row_sum;
  std::vector<int64_t> limit, slots;
  std::vector<uint32_t> q_pairs, k_pairs, v_pairs, prob_pairs;  // the bfloat16 dot-product path's packed operands
  Scratch(int64_t queries, int64_t chunks)
      : q(queries * chunks),
        acc(queries * chunks),
        keys(kKeyBlock * chunks),
        values(kKeyBlock * chunks),
        scores(kKeyBlock / kLanes),
        odd(chunks),
        row_max(queries),
        row_sum(queries),
        limit(queries),
        slots(kKeyBlock),
        q_pairs(queries * chunks * kLanes / 2),
        k_pairs(chunks * kLanes / 2 * kKeyBlock),
        v_pairs(kKeyBlock / 2 * chunks * kLanes),
        prob_pairs(kKeyBlock / 2) {}

  // Query i of a work item starts over: it sees `visible` keys (positions 0 .. visible - 1), has no scores yet.
  void start_query(int64_t i, int64_t visible, int64_t chunks) {
    limit[i] = visible;
    row_max[i] = -kInf;
    row_sum[i] = 0.f;
    std::fill_n(&acc[i * chunks], chunks, v16f{});
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

  // Query i's output, acc / row_sum rounded to T (c10 rounds to nearest even), into dst[0 .. head_dim).
  template <typename T>
  void finish_query(int64_t i, int64_t chunks, int64_t head_dim, T* dst) const {
    const float* sums = reinterpret_cast<const float*>(&acc[i * chunks]);
    for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<T>(sums[d] / row_sum[i]);
  }
};

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

// Queries [first, last) of one (row, kv head) work item; query i is new token i / group, head i % group of
// the kv head's group. Returns false when req_to_token names a slot outside the pool (nothing is read there).
template <typename T, int DC>
bool attend(const Shape& s, const T* q, const T* k, const T* v, T* out, const int64_t* slot_of_position,
            int64_t seq_len, int64_t q_start, int64_t q_len, int64_t kv_head, int64_t first, int64_t last,
            Scratch& w) {
  const int64_t group = s.num_heads / s.num_kv_heads, dc = s.chunks, nq = last - first;
  const int64_t kv_offset = kv_head * s.kv_stride_head;
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
      load_row(k + kv_offset + w.slots[j] * s.kv_stride_slot, s.head_dim, &w.keys[j * dc]);
      load_row(v + kv_offset + w.slots[j] * s.kv_stride_slot, s.head_dim, &w.values[j * dc]);
    }
    for (int64_t i = 0; i < nq; ++i) {
      const int64_t seen = std::min(block_len, w.limit[i] - block);
      if (seen <= 0) continue;  // this query's keys all lie before the block
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

// Head sizes the dot-product path packs: pairs of dims in groups of 16, at most 16 chunks held per query.
constexpr bool bf16_dot_fits(int64_t head_dim) { return head_dim % 32 == 0 && head_dim <= 256; }

bool has_bf16_dot_product() {
#ifdef BATCHGEN_BF16_DOT
  return true;
#else
  return false;
#endif
}

#ifdef BATCHGEN_BF16_DOT

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

// Block packing for `block_len` keys at `slots` (keys past block_len read as zeros): kp[p * kKeyBlock + j] holds
// key j's dims (2p, 2p + 1) for the 16-key groups the block reaches; vp[(j / 2) * head_dim + d] holds dim d of keys
// j and j + 1 (even j). `pairs` = head_dim / 2, a multiple of 16.
inline void pack_block(const uint16_t* k, const uint16_t* v, const int64_t* slots, int64_t block_len, int64_t pairs,
                       int64_t slot_stride, uint32_t* kp, uint32_t* vp) {
  const int64_t head_dim = 2 * pairs;
  for (int64_t g = 0; g * kLanes < block_len; ++g) {
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
      for (int64_t pp = 0; pp < kLanes; ++pp) std::memcpy(kp + (pg + pp) * kKeyBlock + g * kLanes, &rows[pp], 64);
    }
  }
  // Interleaving two rows of 32 bfloat16s: the first 16 dims' pairs, then the last 16 dims' pairs.
  const __m512i first = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38,
                                         6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i last = _mm512_add_epi16(first, _mm512_set1_epi16(16));
  for (int64_t j = 0; j < block_len; j += 2) {
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

// attend() for bfloat16 through the dot-product instructions; the same work item, inputs and result.
template <int DC>
bool attend_bf16(const Shape& s, const c10::BFloat16* q, const c10::BFloat16* k, const c10::BFloat16* v,
                 c10::BFloat16* out, const int64_t* slot_of_position, int64_t seq_len, int64_t q_start, int64_t q_len,
                 int64_t kv_head, int64_t first, int64_t last, Scratch& w) {
  const int64_t group = s.num_heads / s.num_kv_heads, dc = s.chunks, pairs = s.head_dim / 2, nq = last - first;
  const auto* k16 = reinterpret_cast<const uint16_t*>(k + kv_head * s.kv_stride_head);
  const auto* v16 = reinterpret_cast<const uint16_t*>(v + kv_head * s.kv_stride_head);
  int64_t keys = 0;
  for (int64_t i = 0; i < nq; ++i) {
    const int64_t t = (first + i) / group, head = kv_head * group + (first + i) % group;
    std::memcpy(&w.q_pairs[i * pairs], q + (q_start + t) * s.q_stride_token + head * s.q_stride_head,
                s.head_dim * sizeof(c10::BFloat16));
    w.start_query(i, seq_len - q_len + t + 1, dc);
    keys = std::max(keys, w.limit[i]);
  }
  for (int64_t block = 0; block < keys; block += kKeyBlock) {
    const int64_t block_len = std::min(kKeyBlock, keys - block);
    if (!w.take_slots(slot_of_position, block, block_len, s.num_slots)) return false;
    // The next block's rows, requested now: its slots may be anywhere in the pool.
    for (int64_t j = block + kKeyBlock; j < std::min(keys, block + 2 * kKeyBlock); ++j) {
      const int64_t ahead = slot_of_position[j];
      if (ahead >= 0 && ahead < s.num_slots) {
        prefetch_row(k16 + ahead * s.kv_stride_slot, s.head_dim);
        prefetch_row(v16 + ahead * s.kv_stride_slot, s.head_dim);
      }
    }
    pack_block(k16, v16, w.slots.data(), block_len, pairs, s.kv_stride_slot, w.k_pairs.data(), w.v_pairs.data());
    for (int64_t i = 0; i < nq; ++i) {
      const int64_t seen = std::min(block_len, w.limit[i] - block);
      if (seen <= 0) continue;
      attend_block_bf16<DC>(&w.q_pairs[i * pairs], w.k_pairs.data(), w.v_pairs.data(), seen, dc, s.scale,
                            &w.acc[i * dc], w.row_max[i], w.row_sum[i], w.scores.data(), w.prob_pairs.data());
    }
  }
  for (int64_t i = 0; i < nq; ++i) {
    const int64_t t = (first + i) / group, head = kv_head * group + (first + i) % group;
    w.finish_query(i, dc, s.head_dim, out + (q_start + t) * s.out_stride_token + head * s.out_stride_head);
  }
  return true;
}
#endif  // BATCHGEN_BF16_DOT

template <typename T, int DC>
void run(const Shape& s, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
         const int64_t* req_to_token, const int64_t* pool_rows, const int64_t* seq_lens, const int64_t* q_starts,
         const int64_t* q_lens, int64_t num_rows) {
  const int64_t group = s.num_heads / s.num_kv_heads;
  int64_t max_queries = 1;
  for (int64_t r = 0; r < num_rows; ++r) max_queries = std::max(max_queries, q_lens[r] * group);
  const int64_t block_queries = std::min(max_queries, kQueryBlock);
  // Work items: (row, first query of a block of block_queries) x kv head, so that a long prefill row spreads
  // over threads too. Largest first (keys its last query sees), so no thread is left with a long one at the end.
  struct Work {
    int64_t row, first, keys;
  };
  std::vector<Work> work;
  for (int64_t r = 0; r < num_rows; ++r) {
    for (int64_t first = 0; first < q_lens[r] * group; first += block_queries) {
      const int64_t last_query = std::min(q_lens[r] * group, first + block_queries) - 1;
      work.push_back({r, first, seq_lens[r] - q_lens[r] + last_query / group + 1});
    }
  }
  std::stable_sort(work.begin(), work.end(), [](const Work& a, const Work& b) { return a.keys > b.keys; });
  const int64_t items = static_cast<int64_t>(work.size()) * s.num_kv_heads;
  const T* q_ptr = q.const_data_ptr<T>();
  const T* k_ptr = k.const_data_ptr<T>();
  const T* v_ptr = v.const_data_ptr<T>();
  T* out_ptr = out.mutable_data_ptr<T>();
  bool (*attend_item)(const Shape&, const T*, const T*, const T*, T*, const int64_t*, int64_t, int64_t, int64_t,
                      int64_t, int64_t, int64_t, Scratch&) = &attend<T, DC>;
#ifdef BATCHGEN_BF16_DOT
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (bf16_dot_fits(s.head_dim)) attend_item = &attend_bf16<DC>;
  }
#endif
  std::atomic<int64_t> next{0};
  std::atomic<bool> bad_slot{false};
  // Items differ in length, so threads take them one at a time rather than in fixed chunks.
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), items));
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    Scratch scratch(block_queries, s.chunks);
    for (int64_t item = next++; item < items; item = next++) {
      const Work& it = work[item / s.num_kv_heads];
      const int64_t r = it.row, kv_head = item % s.num_kv_heads;
      const int64_t last = std::min(q_lens[r] * group, it.first + block_queries);
      if (!attend_item(s, q_ptr, k_ptr, v_ptr, out_ptr, req_to_token + pool_rows[r] * s.table_stride, seq_lens[r],
                       q_starts[r], q_lens[r], kv_head, it.first, last, scratch)) {
        bad_slot = true;
      }
    }
  });
  TORCH_CHECK(!bad_slot, "batchgen::paged_attention: req_to_token names a KV slot outside [0, ", s.num_slots,
              ") within a row's first seq_len positions");
}

template <typename T>
void run_any_dim(const Shape& s, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                 const at::Tensor& out, const int64_t* req_to_token, const int64_t* pool_rows,
                 const int64_t* seq_lens, const int64_t* q_starts, const int64_t* q_lens, int64_t num_rows) {
  // The common head sizes 64, 128, 256 get code with the loops over a head unrolled; others a generic loop.
  switch (s.chunks) {
    case 4:
      return run<T, 4>(s, q, k, v, out, req_to_token, pool_rows, seq_lens, q_starts, q_lens, num_rows);
    case 8:
      return run<T, 8>(s, q, k, v, out, req_to_token, pool_rows, seq_lens, q_starts, q_lens, num_rows);
    case 16:
      return run<T, 16>(s, q, k, v, out, req_to_token, pool_rows, seq_lens, q_starts, q_lens, num_rows);
    default:
      return run<T, 0>(s, q, k, v, out, req_to_token, pool_rows, seq_lens, q_starts, q_lens, num_rows);
  }
}

at::Tensor contiguous_index(const at::Tensor& t, const char* name, int64_t n) {
  TORCH_CHECK(t.dim() == 1 && t.size(0) == n, "batchgen::paged_attention: ", name, " must be 1-D of length ", n,
              " (one entry per row, like req_pool_indices), got shape ", t.sizes());
  TORCH_CHECK(t.scalar_type() == at::kLong, "batchgen::paged_attention: ", name, " must be int64, got ",
              t.scalar_type());
  TORCH_CHECK(t.device().is_cpu(), "batchgen::paged_attention: ", name, " must be on the CPU");
  return t.contiguous();
}

void paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& req_to_token, const at::Tensor& req_pool_indices, const at::Tensor& seq_lens,
                     const at::Tensor& q_starts, const at::Tensor& q_lens, double scale, const at::Tensor& out) {
  constexpr const char* op = "batchgen::paged_attention: ";
  TORCH_CHECK(q.dim() == 3, op, "q must be [num_tokens, num_heads, head_dim], got shape ", q.sizes());
  TORCH_CHECK(k_cache.dim() == 3 && k_cache.sizes() == v_cache.sizes(), op,
              "k_cache and v_cache must both be [num_kv_heads, num_slots, head_dim], got shapes ", k_cache.sizes(),
              " and ", v_cache.sizes());
  TORCH_CHECK(out.sizes() == q.sizes(), op, "out must have q's shape ", q.sizes(), ", got ", out.sizes());
  const auto dtype = q.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf, op,
              "q must be float32, bfloat16 or float16, got ", dtype);
  TORCH_CHECK(k_cache.scalar_type() == dtype && v_cache.scalar_type() == dtype && out.scalar_type() == dtype, op,
              "q, k_cache, v_cache and out must share one dtype, got ", dtype, ", ", k_cache.scalar_type(), ", ",
              v_cache.scalar_type(), ", ", out.scalar_type());
  for (const at::Tensor* t : {&q, &k_cache, &v_cache, &out, &req_to_token}) {
    TORCH_CHECK(t->device().is_cpu(), op, "all tensors must be on the CPU, got one on ", t->device());
  }
  const int64_t num_heads = q.size(1), head_dim = q.size(2), num_kv_heads = k_cache.size(0);
  TORCH_CHECK(k_cache.size(2) == head_dim, op, "k_cache's head_dim ", k_cache.size(2), " differs from q's ",
              head_dim);
  TORCH_CHECK(num_kv_heads > 0 && num_heads % num_kv_heads == 0, op, "q's ", num_heads,
              " heads are not a multiple of the cache's ", num_kv_heads, " KV heads");
  TORCH_CHECK(head_dim > 0, op, "head_dim must be positive");
  TORCH_CHECK(q.stride(2) == 1 && out.stride(2) == 1 && k_cache.stride(2) == 1 && v_cache.stride(2) == 1 &&
                  k_cache.strides() == v_cache.strides(),
              op,
              "q, out, k_cache and v_cache need a contiguous last dimension, and k_cache and v_cache equal "
              "strides");
  TORCH_CHECK(req_to_token.dim() == 2 && req_to_token.scalar_type() == at::kLong && req_to_token.stride(1) == 1,
              op, "req_to_token must be int64 [max_reqs, context_len] with contiguous rows, got ",
              req_to_token.scalar_type(), " ", req_to_token.sizes());
  TORCH_CHECK(req_pool_indices.dim() == 1, op, "req_pool_indices must be 1-D, got shape ", req_pool_indices.sizes());
  const int64_t n = req_pool_indices.size(0);
  const at::Tensor rows = contiguous_index(req_pool_indices, "req_pool_indices", n);
  const at::Tensor lens = contiguous_index(seq_lens, "seq_lens", n);
  const at::Tensor starts = contiguous_index(q_starts, "q_starts", n);
  const at::Tensor new_lens = contiguous_index(q_lens, "q_lens", n);
  const int64_t *row_p = rows.const_data_ptr<int64_t>(), *len_p = lens.const_data_ptr<int64_t>();
  const int64_t *start_p = starts.const_data_ptr<int64_t>(), *new_p = new_lens.const_data_ptr<int64_t>();
  const int64_t num_tokens = q.size(0), max_reqs = req_to_token.size(0), context_len = req_to_token.size(1);
  for (int64_t r = 0; r < n; ++r) {
    TORCH_CHECK(row_p[r] >= 0 && row_p[r] < max_reqs, op, "row ", r, ": req_pool_indices ", row_p[r],
                " is outside req_to_token's ", max_reqs, " rows");
    TORCH_CHECK(new_p[r] >= 0 && new_p[r] <= len_p[r] && len_p[r] <= context_len, op, "row ", r,
                ": needs 0 <= q_lens (", new_p[r], ") <= seq_lens (", len_p[r], ") <= context_len (", context_len,
                ")");
    TORCH_CHECK(start_p[r] >= 0 && start_p[r] + new_p[r] <= num_tokens, op, "row ", r, ": its tokens [",
                start_p[r], ", ", start_p[r] + new_p[r], ") are outside q's ", num_tokens, " tokens");
  }
  const Shape s{num_heads,
                num_kv_heads,
                head_dim,
                (head_dim + kLanes - 1) / kLanes,
                k_cache.size(1),
                req_to_token.stride(0),
                q.stride(0),
                q.stride(1),
                out.stride(0),
                out.stride(1),
                k_cache.stride(0),
                k_cache.stride(1),
                static_cast<float>(scale)};
  const int64_t* table = req_to_token.const_data_ptr<int64_t>();
  switch (dtype) {
    case at::kFloat:
      return run_any_dim<float>(s, q, k_cache, v_cache, out, table, row_p, len_p, start_p, new_p, n);
    case at::kBFloat16:
      return run_any_dim<c10::BFloat16>(s, q, k_cache, v_cache, out, table, row_p, len_p, start_p, new_p, n);
    default:
      return run_any_dim<c10::Half>(s, q, k_cache, v_cache, out, table, row_p, len_p, start_p, new_p, n);
  }
}

}  // namespace

TORCH_LIBRARY(batchgen, m) {
  m.def(
      "paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor req_to_token, Tensor req_pool_indices, "
      "Tensor seq_lens, Tensor q_starts, Tensor q_lens, float scale, Tensor(a!) out) -> ()");
  // Whether bfloat16 attention runs on vdpbf16ps here (built for a CPU with AVX512-BF16): fast enough for
  // prefill rows too, which otherwise go to SDPA.
  m.def("has_bf16_dot_product() -> bool", &has_bf16_dot_product);
}

TORCH_LIBRARY_IMPL(batchgen, CPU, m) { m.impl("paged_attention", &paged_attention); }
