// brgemm_linear's tiles of many rows, and of very few, on vdpbf16ps directly, with weights requested ahead of their
// use: the same bits as brgemm's tile (checked at run time, dot_tiles_match_brgemm), faster where the weights come
// from DRAM. brgemm passes a tile's block of W (K/2 pairs x 64 columns, 74 KB at K = 576) once per group of rows,
// the first time from DRAM with its compute waiting on the reads. Here, in a tile of many rows, the later groups'
// passes request the block that comes next, so its reads overlap their compute; a tile of one group (a decode
// round of a few rows) has no compute to hide reads behind and is all stream, so its pass requests every line it
// will read a fixed distance ahead into L2, keeping more reads in flight than the hardware prefetcher alone
// (docs/performance.md has the figures).
#pragma once

#include <ATen/native/CPUBlas.h>
#include <c10/util/BFloat16.h>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

constexpr int64_t kDotGroupRows = 6;  // at most 6 rows x 4 vectors of 16 columns: 24 accumulators of 32 registers
// Tiles of more than one group and fewer than this many rows stay on brgemm, faster there (the figures in docs).
constexpr int64_t kDotTileMinRows = 32;
constexpr int64_t kDotAheadPairs = 8;  // the first of several passes requests its own block this many pairs ahead
constexpr int64_t kDotStreamAhead = 8192;  // how far ahead (bytes) a one-group tile requests its lines

// Whether a tile of `rows` rows runs on dot tiles (where dot_tiles_match_brgemm allows).
constexpr bool dot_tile_takes(int64_t rows) { return rows <= kDotGroupRows || rows >= kDotTileMinRows; }

#if defined(__AVX512BF16__)

// acc[r][c * 16 ..] = sum over pairs p of x[r] pair p . W pair p of columns c * 16 .. c * 16 + 15, in p order from
// zero in one float32 accumulator per output, as brgemm's vdpbf16ps kernel sums. At pair p < `count`, the line at
// `ahead` + p * step is requested into L1; with `stream`, the C lines from there into L2 instead, and at the pairs
// after `count` the C lines at `then` + (p - count) * step (none where `then` is null).
template <int R, int C>
void dot_group(const int32_t* x, int64_t pairs, const char* w, int64_t w_row_bytes, float* acc, int64_t ld_acc,
               const char* ahead, int64_t step, int64_t count, bool stream, const char* then) {
  __m512 a[R][C];
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < C; ++c) a[r][c] = _mm512_setzero_ps();
  }
  for (int64_t p = 0; p < pairs; ++p) {
    if (stream) {
      const char* line = p < count ? ahead + p * step : then != nullptr ? then + (p - count) * step : nullptr;
      if (line != nullptr) {
        for (int c = 0; c < C; ++c) _mm_prefetch(line + 64 * c, _MM_HINT_T1);
      }
    } else if (p < count) {
      _mm_prefetch(ahead + p * step, _MM_HINT_T0);
    }
    __m512i wv[C];
    for (int c = 0; c < C; ++c) wv[c] = _mm512_loadu_si512(w + p * w_row_bytes + 64 * c);
    for (int r = 0; r < R; ++r) {
      const __m512bh xr = reinterpret_cast<__m512bh>(_mm512_set1_epi32(x[r * pairs + p]));
      for (int c = 0; c < C; ++c) a[r][c] = _mm512_dpbf16_ps(a[r][c], xr, reinterpret_cast<__m512bh>(wv[c]));
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(acc + r * ld_acc + 16 * c, a[r][c]);
  }
}

using DotGroup = void (*)(const int32_t*, int64_t, const char*, int64_t, float*, int64_t, const char*, int64_t,
                          int64_t, bool, const char*);

template <int R>
constexpr std::array<DotGroup, 4> dot_groups_of() {
  return {&dot_group<R, 1>, &dot_group<R, 2>, &dot_group<R, 3>, &dot_group<R, 4>};
}

// [rows in a group - 1][vectors of 16 columns - 1]
constexpr std::array<std::array<DotGroup, 4>, kDotGroupRows> kDotGroups = {
    dot_groups_of<1>(), dot_groups_of<2>(), dot_groups_of<3>(),
    dot_groups_of<4>(), dot_groups_of<5>(), dot_groups_of<6>()};

// Whether dot_tile runs here: the instruction is compiled in; dot_tiles_match_brgemm says whether it may replace
// brgemm.
constexpr bool kDotTilesBuilt = true;

#else
constexpr bool kDotTilesBuilt = false;
#endif

// brgemm(rows, width, K, K, cols, cols, false, x, w_block + offset pairs, acc) for rows x [rows, K] bfloat16
// (row-major), columns [offset, offset + width) of a packed block ([K / 2][cols][2]), width a multiple of 16 up to 64;
// `next` (up to `next_bytes`; the block the thread runs next) is requested while the groups after the first run,
// spread evenly over their pairs. A tile of one group requests the lines of its columns kDotStreamAhead bytes ahead
// instead: its own block's, then, for its last pairs, the first ones of `next`.
inline void dot_tile(int64_t rows, const c10::BFloat16* x, int64_t K, const c10::BFloat16* w_block, int64_t cols,
                     int64_t offset, int64_t width, float* acc, int64_t ld_acc, const char* next,
                     int64_t next_bytes) {
#if defined(__AVX512BF16__)
  const int64_t pairs = K / 2, w_row_bytes = cols * 4;
  const auto* xp = reinterpret_cast<const int32_t*>(x);
  const char* w = reinterpret_cast<const char*>(w_block) + offset * 4;
  const int64_t groups = (rows + kDotGroupRows - 1) / kDotGroupRows;
  // The later groups' share of `next`, a line every `step` bytes at each pair.
  const int64_t share = groups > 1 ? (next_bytes + groups - 2) / (groups - 1) : 0;
  const int64_t step = std::max<int64_t>(64, ((share + pairs - 1) / pairs + 63) / 64 * 64);
  for (int64_t g = 0; g < groups; ++g) {
    // Rows spread evenly over the groups: a last group of one or two rows would wait on its few accumulators.
    const int64_t r0 = rows * g / groups, n = rows * (g + 1) / groups - r0;
    const DotGroup run = kDotGroups[n - 1][width / 16 - 1];
    if (groups == 1) {
      // The pairs whose lines kDotStreamAhead bytes ahead are in this block; the rest request `next`'s first lines.
      const int64_t own = std::max<int64_t>(0, pairs - kDotStreamAhead / w_row_bytes);
      const char* then = next_bytes > 0 ? next + offset * 4 : nullptr;
      run(xp, pairs, w, w_row_bytes, acc, ld_acc, w + kDotStreamAhead, w_row_bytes, own, true, then);
    } else if (g == 0) {
      run(xp, pairs, w, w_row_bytes, acc, ld_acc, w + kDotAheadPairs * w_row_bytes, w_row_bytes,
          pairs - kDotAheadPairs, false, nullptr);
    } else {
      const int64_t from = (g - 1) * share;
      const int64_t count = std::min(pairs, (std::min(share, next_bytes - from) + step - 1) / step);
      run(xp + r0 * pairs, pairs, w, w_row_bytes, acc + r0 * ld_acc, ld_acc, next + from, step, count, false, nullptr);
    }
  }
#else
  (void)rows, (void)x, (void)K, (void)w_block, (void)cols, (void)offset, (void)width, (void)acc, (void)ld_acc,
      (void)next, (void)next_bytes;
#endif
}

// Whether dot_tile may stand in for brgemm: built, brgemm without AMX tiles (PyTorch's could_pack asks for them;
// there brgemm is the faster), and the same bits as brgemm on probes of 40, 6 and 1 rows x each width the tiles take
// (16 to 64 columns, at the far end of a 64-column block) x K = 1,154 and 8,962 (subnormal, huge and infinite inputs
// among the random ones, in the rows of every probe). Where brgemm sums in another order, or flushes otherwise, the
// bits differ and brgemm keeps every tile.
inline bool dot_tiles_match_brgemm() {
  static const bool match = [] {
    if (!kDotTilesBuilt || at::native::cpublas::could_pack(at::kBFloat16)) return false;
    constexpr int64_t rows = 40, cols = 64;
    uint32_t state = 12345;
    auto next_value = [&] {
      state = state * 1664525u + 1013904223u;
      return c10::BFloat16(static_cast<float>(static_cast<int32_t>(state >> 8) - (1 << 23)) * 0x1p-22f);
    };
    for (const int64_t K : {1154, 8962}) {
      std::vector<c10::BFloat16> x(rows * K), w(K * cols);
      for (auto& v : x) v = next_value();
      for (auto& v : w) v = next_value();
      const float specials[] = {1e-39f, -1e-39f, 3e38f, -3e38f, 1e-30f, 65504.f};
      for (int i = 0; i < 6; ++i) x[7 * K + 3 * i] = c10::BFloat16(specials[i]);
      x[11 * K + 5] = c10::BFloat16(std::numeric_limits<float>::infinity());
      for (int64_t width = 16; width <= cols; width += 16) {
        for (const int64_t m : {rows, kDotGroupRows, int64_t{1}}) {
          const int64_t offset = cols - width;
          const c10::BFloat16* xm = x.data() + (m == rows ? 0 : 7 * K);  // rows 7 and 11 hold the special values
          std::vector<float> by_brgemm(m * cols), by_dot(m * cols);
          at::native::cpublas::brgemm(m, width, K, K, cols, cols, false, xm, w.data() + offset * 2, by_brgemm.data());
          at::native::cpublas::brgemm_release();
          dot_tile(m, xm, K, w.data(), cols, offset, width, by_dot.data(), cols, nullptr, 0);
          if (std::memcmp(by_brgemm.data(), by_dot.data(), by_dot.size() * sizeof(float)) != 0) return false;
        }
      }
    }
    return true;
  }();
  return match;
}

}  // namespace
