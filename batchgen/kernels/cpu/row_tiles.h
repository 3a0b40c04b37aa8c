// The tiles of a linear layer's output that batchgen's GEMM kernels compute (brgemm_linear.cpp, half_linear.cpp),
// how they are shared among the threads, and how a tile's sums are stored. A tile is up to kRowBlock rows of x
// against one block of `cols` output columns (or a part of one); a kernel's result for one output never depends on
// the tile that computes it.
#pragma once

#include <ATen/Parallel.h>

#include "bf16_round.h"
#include "brgemm_bf16.h"
#include "vec16.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>

namespace {

// Rows of x per tile: a block of x ([128 x K], 144 KiB in bfloat16 and 288 KiB in float32 at K = 576) stays in L2
// while a thread passes the weight blocks over it. No result depends on it (tests/kernels/test_cpu_*_linear.py).
constexpr int64_t kRowBlock = 128;

// Rows [m0, m0 + rows) of x against columns [offset, offset + width) of packed block `block`.
struct Tile {
  int64_t m0, rows, block, offset, width;
};

inline void store_lanes(float* p, vnf v) { std::memcpy(p, &v, sizeof(v)); }
inline void store_lanes(c10::BFloat16* p, vnf v) { storen(p, v); }  // rounded to nearest even, as c10 rounds

// Adds the bias to one block of a tile's float32 sums and stores it as float32 or rounded to bfloat16.
template <typename Out>
void store_block(const float* acc, int64_t ld_acc, const float* bias, Out* out, int64_t ld_out, int64_t rows,
                 int64_t width) {
  for (int64_t i = 0; i < rows; ++i) {
    const float* a = acc + i * ld_acc;
    Out* o = out + i * ld_out;
    int64_t j = 0;
    for (; j + kNativeLanes <= width; j += kNativeLanes) {
      store_lanes(o + j, bias != nullptr ? loadn(a + j) + loadn(bias + j) : loadn(a + j));
    }
    for (; j < width; ++j) o[j] = static_cast<Out>(bias != nullptr ? a[j] + bias[j] : a[j]);
  }
}

// Runs run(tile, scratch) over the tiles of up to kRowBlock rows x `cols` columns that cover M rows and N columns
// (the last block narrower where N is not a multiple of cols), each thread a contiguous run of them (row blocks
// outermost: a thread passes the weight blocks over one block of x at a time) with `scratch_floats` floats of its
// own. The rows are spread evenly over the fewest row blocks that hold them: blocks of 128 rows and one of the rest
// left the threads unequal work (a round of 2,063 rows: 16 blocks of 128 and one of 15, the last on brgemm's slower
// path). Where the tiles do not divide among the threads (a decode round's 9 blocks of a 576-wide layer on 2
// threads), the last few are split by columns into one part per thread, so that no thread waits on another's extra
// block; the part of a block a call computes changes nothing: brgemm's result for one element depends on neither
// the rows nor the columns beside it in the call (tests/kernels/test_cpu_brgemm_linear.py, test_cpu_half_linear.py).
template <typename Run>
void for_each_tile(int64_t M, int64_t N, int64_t blocks, int64_t cols, int64_t scratch_floats, Run run) {
  const int64_t row_tiles = (M + kRowBlock - 1) / kRowBlock;
  const int64_t tiles = row_tiles * blocks;
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), tiles));
  const int64_t part = cols / threads;
  const bool split = tiles % threads != 0 && cols % threads == 0 && part % kNativeLanes == 0;
  const int64_t whole = split ? tiles - tiles % threads : tiles;
  auto tile = [&](int64_t t, int64_t offset, int64_t width) {
    const int64_t r = t / blocks, block = t % blocks, m0 = M * r / row_tiles;
    return Tile{m0, M * (r + 1) / row_tiles - m0, block, offset, std::min(width, N - block * cols - offset)};
  };
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    const ReleaseOnExit release;
    const std::unique_ptr<float[]> scratch(new float[scratch_floats]);  // uninitialised: every use writes first
    for (int64_t th = begin; th < end; ++th) {
      for (int64_t t = whole * th / threads; t < whole * (th + 1) / threads; ++t) run(tile(t, 0, cols), scratch.get());
      for (int64_t t = whole; split && t < tiles; ++t) {
        const Tile piece = tile(t, th * part, part);
        if (piece.width > 0) run(piece, scratch.get());
      }
    }
  });
}

}  // namespace
