// The paged-attention kernel's block step for CPUs with AVX2, FMA and F16C but no AVX-512 (AMD Zen 2/3, Intel
// Haswell, Intel's client parts without AVX-512), included by paged_attention.cpp, which uses it where
// BATCHGEN_AVX2_BLOCK is defined and the head size is a multiple of 8.
//
// The generic attend_block holds 16 keys' dot products of 16 float32 lanes at once and sums them with 16-lane
// shuffles: on AVX-512 that is 16 of its 32 registers; on AVX2 each 16-lane vector is two of only 16 registers,
// so the compiler spills most of them and builds the shuffles through memory (several times slower than this step
// on Zen 3: docs/performance.md, machine B, "What made it fast").
// Here everything is 8 lanes wide: K/V rows are widened to float32 8 at a time, eight keys' dot products
// accumulate in eight registers and meet in one fixed tree of horizontal adds, the online-softmax step and the
// rounding of the probabilities run on 8 lanes, and the weighted sum of V keeps 64 dims (eight registers) at a
// time. Two or three queries that see the same keys of a block (the query heads of one KV head's GQA group; also
// the next token's or, over a shared prefix, the next row's) run together:
// each K and V chunk loaded from the converted block then feeds all of them (four keys' dot products and 32 dims
// of V per query in registers), where one query alone needs a load per multiply-add. The inputs and the result
// are attend_block's: probabilities rounded to T before they weight V, the same recurrence. Sums run in one fixed
// order set by key positions alone, so a query's output stays bit-identical in any batch, alone or beside other
// queries of its group (each of its sums is the same sequence of operations either way); it differs from the
// generic path only in the order of its float32 additions.
#pragma once

#include "attention_common.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(__AVX512F__)
#define BATCHGEN_AVX2_BLOCK 1

#include <immintrin.h>

namespace {

constexpr int64_t kAvx2Lanes = kNativeLanes;  // 8 float32 lanes: vnf is one AVX2 register here
static_assert(kAvx2Lanes == 8);

// dst[0 .. n) = src[0 .. n) as float32, n a multiple of 8: load_row for whole heads, without the generic
// 16-lane vectors, which the compiler moves through the stack 16 bytes at a time on AVX2.
template <typename T>
inline void widen_row(const T* src, int64_t n, v16f* dst) {
  float* out = reinterpret_cast<float*>(dst);
  for (int64_t d = 0; d < n; d += kAvx2Lanes) _mm256_storeu_ps(out + d, reinterpret_cast<__m256>(loadn(src + d)));
}

// Lane j = q[0 .. dims) · keys[j][0 .. dims) for the eight keys keys[0..7], rows `stride` floats apart; dims a
// multiple of 8.
inline __m256 dot8(const float* q, const float* keys, int64_t dims, int64_t stride) {
  __m256 a[kAvx2Lanes];
  for (int j = 0; j < kAvx2Lanes; ++j) a[j] = _mm256_setzero_ps();
  for (int64_t c = 0; c < dims; c += kAvx2Lanes) {
    const __m256 qc = _mm256_loadu_ps(q + c);
    for (int j = 0; j < kAvx2Lanes; ++j) a[j] = _mm256_fmadd_ps(qc, _mm256_loadu_ps(keys + j * stride + c), a[j]);
  }
  // Each accumulator's lanes summed by the same tree: (0+1)+(2+3) and (4+5)+(6+7), then the two halves.
  const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);  // [keys 0-3 | 0-3], [4-7 | 4-7]
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// Lanes 0..3 of out[m] = q[m][0 .. dims) · keys[j][0 .. dims) for the four keys keys[0..3] and each of M queries;
// every sum is formed as in dot8 (the same multiply-adds per lane, its lanes summed by the same tree), so the
// scores are the bits dot8 gives.
template <int M>
inline void dot4(const float* const* q, const float* keys, int64_t dims, int64_t stride, float* const* out) {
  __m256 a[M][4];
  for (int m = 0; m < M; ++m) {
    for (int j = 0; j < 4; ++j) a[m][j] = _mm256_setzero_ps();
  }
  for (int64_t c = 0; c < dims; c += kAvx2Lanes) {
    __m256 qc[M];
    for (int m = 0; m < M; ++m) qc[m] = _mm256_loadu_ps(q[m] + c);
    for (int j = 0; j < 4; ++j) {
      const __m256 kj = _mm256_loadu_ps(keys + j * stride + c);
      for (int m = 0; m < M; ++m) a[m][j] = _mm256_fmadd_ps(qc[m], kj, a[m][j]);
    }
  }
  for (int m = 0; m < M; ++m) {
    // [keys 0-3 over lanes 0-3 | keys 0-3 over lanes 4-7], then the two halves: dot8's tree.
    const __m256 u = _mm256_hadd_ps(_mm256_hadd_ps(a[m][0], a[m][1]), _mm256_hadd_ps(a[m][2], a[m][3]));
    _mm_storeu_ps(out[m], _mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1)));
  }
}

// softmax_step over `used` x 16 scores at the machine's width (the 16-lane one spills on AVX2): the scores of
// keys past `seen` become 0, the others exp(score - new max); (row_max, row_sum) move to the new max. Returns
// alpha = exp(old max - new max).
inline float softmax_step_avx2(float* scores, int64_t seen, int64_t used, float& row_max, float& row_sum) {
  const int64_t n = used * kLanes;
  std::fill(scores + seen, scores + n, -kInf);
  vnf m = loadn(scores);
  for (int64_t j = kAvx2Lanes; j < n; j += kAvx2Lanes) m = m > loadn(scores + j) ? m : loadn(scores + j);
  float block_max = m[0];
  for (int l = 1; l < kAvx2Lanes; ++l) block_max = std::max(block_max, m[l]);
  const float new_max = std::max(row_max, block_max);
  const float alpha = std::exp(row_max - new_max);  // 0 on the first block (exp(-inf))
  vnf sum = {};
  for (int64_t j = 0; j < n; j += kAvx2Lanes) {
    const vnf e = exp_nonpositive(loadn(scores + j) - new_max);
    std::memcpy(scores + j, &e, sizeof(e));
    sum += e;
  }
  row_sum = row_sum * alpha + hsumn(sum);
  row_max = new_max;
  return alpha;
}

// Probabilities rounded to T's precision (to nearest even) and back, as round_to does, 8 at a time.
template <typename T>
inline void round_probabilities(float* p, int64_t n) {
  for (int64_t j = 0; j < n; j += kAvx2Lanes) {
    __m256 x = _mm256_loadu_ps(p + j);
    if constexpr (std::is_same_v<T, c10::BFloat16>) {
      const __m256i bits = _mm256_castps_si256(x);
      const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
      const __m256i up = _mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7fff)), lsb);
      x = _mm256_castsi256_ps(_mm256_and_si256(up, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
    } else if constexpr (std::is_same_v<T, c10::Half>) {
      x = _mm256_cvtph_ps(_mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT));
    }
    _mm256_storeu_ps(p + j, x);
  }
}

// acc[m][d0 .. d0 + 8 NC) = alpha[m] acc[m] + sum over keys j < seen of p[m][j] v_j[d0 .. d0 + 8 NC) for M queries,
// the V rows `stride` floats apart: M x NC registers of 8 dims stay in registers over all keys, and each V chunk is
// loaded once for the M queries. A query's sums run in the same order for any M.
template <int M, int NC>
inline void weigh_values(const float* const* p, const float* v, int64_t seen, int64_t stride, const float* alpha,
                         float* const* acc, int64_t d0) {
  __m256 a[M][NC];
  for (int m = 0; m < M; ++m) {
    for (int c = 0; c < NC; ++c) {
      a[m][c] = _mm256_mul_ps(_mm256_loadu_ps(acc[m] + d0 + c * kAvx2Lanes), _mm256_set1_ps(alpha[m]));
    }
  }
  for (int64_t j = 0; j < seen; ++j) {
    __m256 pj[M];
    for (int m = 0; m < M; ++m) pj[m] = _mm256_set1_ps(p[m][j]);
    for (int c = 0; c < NC; ++c) {
      const __m256 vc = _mm256_loadu_ps(v + j * stride + d0 + c * kAvx2Lanes);
      for (int m = 0; m < M; ++m) a[m][c] = _mm256_fmadd_ps(pj[m], vc, a[m][c]);
    }
  }
  for (int m = 0; m < M; ++m) {
    for (int c = 0; c < NC; ++c) _mm256_storeu_ps(acc[m] + d0 + c * kAvx2Lanes, a[m][c]);
  }
}

// weigh_values over all `dims` (a multiple of 8) in blocks that fit the 16 registers: 64 dims for one query, 32 for
// two or three.
template <int M>
inline void weigh_all_values(const float* const* p, const float* v, int64_t seen, int64_t dims, int64_t stride,
                             const float* alpha, float* const* acc) {
  constexpr int kBlock = M == 1 ? 8 : 4;
  int64_t d0 = 0;
  for (; d0 + kBlock * kAvx2Lanes <= dims; d0 += kBlock * kAvx2Lanes) {
    weigh_values<M, kBlock>(p, v, seen, stride, alpha, acc, d0);
  }
  switch ((dims - d0) / kAvx2Lanes) {  // the last dims of a head that is not a multiple of the block (96, 80, 40, ...)
    case 1: return weigh_values<M, 1>(p, v, seen, stride, alpha, acc, d0);
    case 2: return weigh_values<M, 2>(p, v, seen, stride, alpha, acc, d0);
    case 3: return weigh_values<M, 3>(p, v, seen, stride, alpha, acc, d0);
    case 4: return weigh_values<M, 4>(p, v, seen, stride, alpha, acc, d0);
    case 5: return weigh_values<M, 5>(p, v, seen, stride, alpha, acc, d0);
    case 6: return weigh_values<M, 6>(p, v, seen, stride, alpha, acc, d0);
    case 7: return weigh_values<M, 7>(p, v, seen, stride, alpha, acc, d0);
    default: return;
  }
}

// attend_block for M queries (consecutive in scratch: q + m * chunks, acc + m * chunks, row_max[m], row_sum[m]) that
// all see the first `seen` keys of a converted block, heads of `dims` dims (a multiple of 8) held in scratch rows of
// `chunks` x 16 floats: scores, the online-softmax update of (row_max, row_sum), weighted values into acc. `scores`
// holds M x 64 floats. Nothing past a row's `dims` floats is read (the rows' padding may hold stale values).
template <typename T, int M>
void attend_block_avx2(const v16f* q, const v16f* keys, const v16f* values, int64_t seen, int64_t dims,
                       int64_t chunks, v16f* acc, float* row_max, float* row_sum, v16f* scores) {
  static_assert(M * kKeyBlock <= kGemmKeyBlock, "the scratch's scores hold M blocks of keys");
  const int64_t stride = chunks * kLanes, used = (seen + kLanes - 1) / kLanes, n = used * kLanes;
  const float* kf = reinterpret_cast<const float*>(keys);
  const float *qm[M], *pm[M];
  float *flat[M], *accm[M], alpha[M];
  for (int m = 0; m < M; ++m) {
    qm[m] = reinterpret_cast<const float*>(q + m * chunks);
    flat[m] = reinterpret_cast<float*>(scores) + m * kKeyBlock;
    pm[m] = flat[m];
    accm[m] = reinterpret_cast<float*>(acc + m * chunks);
  }
  // Keys past `seen` (scratch rows of an earlier block) are scored too; softmax_step sets them to -inf.
  for (int64_t j = 0; j < n; j += M == 1 ? kAvx2Lanes : 4) {
    if constexpr (M == 1) {
      _mm256_storeu_ps(flat[0] + j, dot8(qm[0], kf + j * stride, dims, stride));
    } else {
      float* out[M];
      for (int m = 0; m < M; ++m) out[m] = flat[m] + j;
      dot4<M>(qm, kf + j * stride, dims, stride, out);
    }
  }
  for (int m = 0; m < M; ++m) {
    alpha[m] = softmax_step_avx2(flat[m], seen, used, row_max[m], row_sum[m]);
    round_probabilities<T>(flat[m], n);
  }
  weigh_all_values<M>(pm, reinterpret_cast<const float*>(values), seen, dims, stride, alpha, accm);
}

// attend_block_avx2 for the `count` (1 to 3) queries from query i of the scratch.
template <typename T>
void attend_queries_avx2(int64_t count, int64_t i, const v16f* keys, const v16f* values, int64_t seen, int64_t dims,
                         int64_t chunks, v16f* q, v16f* acc, float* row_max, float* row_sum, v16f* scores) {
  auto run = [&](auto m) {
    attend_block_avx2<T, decltype(m)::value>(q + i * chunks, keys, values, seen, dims, chunks, acc + i * chunks,
                                             row_max + i, row_sum + i, scores);
  };
  switch (count) {
    case 3: return run(std::integral_constant<int, 3>{});
    case 2: return run(std::integral_constant<int, 2>{});
    default: return run(std::integral_constant<int, 1>{});
  }
}

}  // namespace

#endif  // AVX2, FMA and F16C without AVX-512

// Whether the block step above is built here: prefill_rows_supported (kernels/cpu/__init__.py) sends prefill rows
// to the kernel only where a fast vector step runs them.
#ifdef BATCHGEN_AVX2_BLOCK
inline bool has_avx2_block() { return true; }
#else
inline bool has_avx2_block() { return false; }
#endif
