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
// (multiples of kKeyBlock from position 0, of kGemmKeyBlock on the brgemm path), reductions run in a fixed order,
// and a query stops at its own last visible key, so its output is bit-identical whatever else is in the batch,
// however many new tokens its row has, and whichever thread runs it. That holds within each path; which path a row
// takes is the caller's `brgemm` (kNever, kManyQueries, kEveryRow below).
//
// bfloat16 on a machine with AVX512-BF16 takes its own path (attend_bf16 in attention_bf16.h): K/V pairs go
// straight into vdpbf16ps, the same accumulation in float32 with fewer instructions, fast enough for prefill
// rows as well. Where the caller asks for brgemm (where it runs bfloat16: AMX tiles or AVX512-BF16), rows run as
// two GEMMs per block of keys through PyTorch's brgemm instead (attend_brgemm, attention_brgemm.h): every row, or
// those of kGemmMinQueries queries or more. Rows of a few queries (decodes) whose leading KV slots are the same, as
// the prefix cache hands them out, read and convert that prefix once for all of them (attention_shared.h finds
// them; attend_bf16_shared, attend_shared on the vector paths, and attend_brgemm_shared run them). The generic
// path's block step is attend_block (attention_generic.h); on AVX2 without AVX-512 it is attend_block_avx2
// (attention_avx2.h), written for that machine's 16 registers of 8 lanes; attention_vector.h holds the work items
// (attend, attend_shared) that run either. attention_common.h holds what the paths share.
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

#include "attention_bf16.h"
#include "attention_brgemm.h"
#include "attention_common.h"
#include "attention_shared.h"
#include "attention_vector.h"

#include <algorithm>
#include <atomic>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

// Head sizes the dot-product path packs: pairs of dims in groups of 16, at most 16 chunks held per query.
constexpr bool bf16_dot_fits(int64_t head_dim) { return head_dim % 32 == 0 && head_dim <= 256; }

#ifdef BATCHGEN_BF16_DOT
bool has_bf16_dot_product() { return true; }
#else
bool has_bf16_dot_product() { return false; }
#endif

// Which rows run through brgemm (the op's `brgemm`): none; rows of kGemmMinQueries queries or more, and the shared
// blocks of rows sharing a prefix (a decode's bits then depend on whether it was grouped); every row, so that a
// query's bits depend on nothing else (the torch_native backend's choice under --deterministic).
constexpr int64_t kNever = 0, kManyQueries = 1, kEveryRow = 2;

// The brgemm path needs the vdpbf16ps path's packing (BATCHGEN_BF16_DOT) and brgemm in bfloat16 at run time.
bool brgemm_path_runs() { return has_bf16_dot_product() && brgemm_bf16_runs(); }

template <typename T, int DC>
void run(const Shape& s, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
         const Rows& rows, int64_t num_rows, int64_t brgemm) {
  const int64_t group = s.num_heads / s.num_kv_heads;
  const int64_t* q_lens = rows.q_lens;
  using Attend = bool (*)(const Shape&, const T*, const T*, const T*, T*, const int64_t*, int64_t, int64_t,
                          int64_t, int64_t, int64_t, int64_t, Scratch&);
  using AttendShared = bool (*)(const Shape&, const T*, const T*, const T*, T*, const Rows&, const int64_t*, int64_t,
                                int64_t, int64_t, Scratch&);
  Attend attend_item = &attend<T, DC>, attend_gemm = nullptr;
  // Rows sharing a prefix: by blocks of kKeyBlock on the vector path, of kGemmKeyBlock through brgemm.
  AttendShared attend_group = &attend_shared<T, DC>, attend_gemm_group = nullptr;
  // A row's path is its own: brgemm for every row with kEveryRow, else for rows of kGemmMinQueries queries or more
  // (where two GEMMs per block beat packing K for the vector path's few queries), the vector path for the others.
  auto on_gemm = [&](int64_t r) {
    return attend_gemm != nullptr && (brgemm == kEveryRow || q_lens[r] * group >= kGemmMinQueries);
  };
#ifdef BATCHGEN_BF16_DOT
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (bf16_dot_fits(s.head_dim)) {
      attend_item = &attend_bf16<DC>;
      attend_group = &attend_bf16_shared<DC>;
      if (brgemm != kNever) {
        attend_gemm = &attend_brgemm<DC>;
        attend_gemm_group = brgemm == kEveryRow ? &attend_brgemm_shared<DC, true> : &attend_brgemm_shared<DC, false>;
      }
    }
  }
#endif
  // Rows of a few queries (decodes) that share a cached prefix read it once together: through brgemm where asked, as
  // GEMMs over all their queries, then (unless every row must take the GEMMs) the rows whose shared prefix holds no
  // whole block of kGemmKeyBlock keys by kKeyBlock ones on the vector path.
  int64_t max_queries = 0;
  const int64_t shared_block = attend_gemm_group != nullptr ? kGemmKeyBlock : kKeyBlock;
  const std::vector<SharedPrefix> shared =
      group_shared_rows(rows, num_rows, group, s.num_kv_heads, shared_block, brgemm != kEveryRow, max_queries);
  // Work items, each for every KV head: a shared prefix's rows, or (row, first query of a block of kQueryBlock, or
  // of kGemmQueryBlock on brgemm) for the other rows, so that a long prefill row spreads over threads too
  // (the blocks depend on the row alone).
  auto item_queries = [&](int64_t r) { return on_gemm(r) ? kGemmQueryBlock : kQueryBlock; };
  // Largest first (keys the item's queries see), so no thread is left with a long one at the end.
  struct Work {
    int64_t row, first, keys, shared;  // shared: index into `shared`, or -1
  };
  std::vector<Work> work;
  std::vector<bool> in_shared(num_rows, false);
  for (size_t g = 0; g < shared.size(); ++g) {
    int64_t keys = 0;
    for (int64_t r : shared[g].members) {
      in_shared[r] = true;
      keys += rows.seq_lens[r] - shared[g].depth * shared[g].block;
    }
    work.push_back({-1, 0, keys + shared[g].depth * shared[g].block, static_cast<int64_t>(g)});
  }
  // The most queries an item holds (a shared prefix's rows hold up to max_queries together): the scratch's size.
  int64_t block_queries = shared.empty() ? 1 : max_queries;
  for (int64_t r = 0; r < num_rows; ++r) {
    block_queries = std::max(block_queries, std::min(q_lens[r] * group, item_queries(r)));
    if (in_shared[r]) continue;
    for (int64_t first = 0; first < q_lens[r] * group; first += item_queries(r)) {
      const int64_t last_query = std::min(q_lens[r] * group, first + item_queries(r)) - 1;
      work.push_back({r, first, rows.seq_lens[r] - q_lens[r] + last_query / group + 1, -1});
    }
  }
  std::stable_sort(work.begin(), work.end(), [](const Work& a, const Work& b) { return a.keys > b.keys; });
  const int64_t items = static_cast<int64_t>(work.size()) * s.num_kv_heads;
  const T* q_ptr = q.const_data_ptr<T>();
  const T* k_ptr = k.const_data_ptr<T>();
  const T* v_ptr = v.const_data_ptr<T>();
  T* out_ptr = out.mutable_data_ptr<T>();
  std::atomic<int64_t> next{0};
  std::atomic<bool> bad_slot{false};
  // Items differ in length, so threads take them one at a time rather than in fixed chunks.
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), items));
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    Scratch scratch(block_queries, s.chunks);
    scratch.use_pool<T>(s);
    // A thread claims its following item before it runs the current one, to request that item's first block of keys
    // meanwhile; only while `threads` items or more are unclaimed, so that a call of few items still uses every thread.
    auto claim_following = [&]() -> int64_t {
      scratch.next_item = {};
      if (items - next.load() < threads) return -1;
      const int64_t item = next++;
      if (item >= items) return item;
      const Work& it = work[item / s.num_kv_heads];
      const int64_t r = it.shared >= 0 ? shared[it.shared].members[0] : it.row;
      const int64_t block = it.shared >= 0 ? shared[it.shared].block : on_gemm(r) ? kGemmKeyBlock : kKeyBlock;
      const int64_t head = item % s.num_kv_heads * s.kv_stride_head;
      scratch.next_item =
          Scratch::rows_at(k_ptr + head, v_ptr + head, rows.slots_of(r), std::min(block, rows.seq_lens[r]));
      return item;
    };
    for (int64_t item = next++; item < items;) {
      const int64_t following = claim_following();
      const Work& it = work[item / s.num_kv_heads];
      const int64_t kv_head = item % s.num_kv_heads;
      bool ok = true;
      if (it.shared >= 0) {
        const SharedPrefix& g = shared[it.shared];
        ok = (g.block == kGemmKeyBlock ? attend_gemm_group : attend_group)(
            s, q_ptr, k_ptr, v_ptr, out_ptr, rows, g.members.data(), static_cast<int64_t>(g.members.size()), g.depth,
            kv_head, scratch);
      } else {
        const int64_t r = it.row, last = std::min(q_lens[r] * group, it.first + item_queries(r));
        ok = (on_gemm(r) ? attend_gemm : attend_item)(s, q_ptr, k_ptr, v_ptr, out_ptr, rows.slots_of(r),
                                                  rows.seq_lens[r], rows.q_starts[r], q_lens[r], kv_head, it.first,
                                                  last, scratch);
      }
      if (!ok) bad_slot = true;
      item = following >= 0 ? following : next++;
    }
    if (attend_gemm != nullptr) at::native::cpublas::brgemm_release();  // hands an AMX tile configuration back
  });
  TORCH_CHECK(!bad_slot, "batchgen::paged_attention: req_to_token names a KV slot outside [0, ", s.num_slots,
              ") within a row's first seq_len positions");
}

template <typename T>
void run_any_dim(const Shape& s, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                 const at::Tensor& out, const Rows& rows, int64_t num_rows, int64_t brgemm) {
  // The common head sizes 64, 128, 256 get code with the loops over a head unrolled; others a generic loop.
  switch (s.chunks) {
    case 4:
      return run<T, 4>(s, q, k, v, out, rows, num_rows, brgemm);
    case 8:
      return run<T, 8>(s, q, k, v, out, rows, num_rows, brgemm);
    case 16:
      return run<T, 16>(s, q, k, v, out, rows, num_rows, brgemm);
    default:
      return run<T, 0>(s, q, k, v, out, rows, num_rows, brgemm);
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
                     const at::Tensor& q_starts, const at::Tensor& q_lens, double scale, const at::Tensor& out,
                     int64_t brgemm) {
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
  const bool brgemm_ok = brgemm == kNever || ((brgemm == kManyQueries || brgemm == kEveryRow) &&
                                                dtype == at::kBFloat16 && bf16_dot_fits(q.size(2)) &&
                                                brgemm_path_runs());
  TORCH_CHECK(brgemm_ok, op,
              "brgemm must be 0, 1 or 2, and 1 and 2 need bfloat16, a head size that is a multiple of 32 up to 256, "
              "and brgemm in bfloat16 on this CPU with AVX512-BF16 (brgemm_bf16_runs); got ", brgemm);
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
  const at::Tensor pool_rows = contiguous_index(req_pool_indices, "req_pool_indices", n);
  const at::Tensor lens = contiguous_index(seq_lens, "seq_lens", n);
  const at::Tensor starts = contiguous_index(q_starts, "q_starts", n);
  const at::Tensor new_lens = contiguous_index(q_lens, "q_lens", n);
  const int64_t *row_p = pool_rows.const_data_ptr<int64_t>(), *len_p = lens.const_data_ptr<int64_t>();
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
  const Shape s{num_heads,   num_kv_heads, head_dim,      (head_dim + kLanes - 1) / kLanes, k_cache.size(1),
                q.stride(0), q.stride(1),  out.stride(0), out.stride(1), k_cache.stride(0),     k_cache.stride(1),
                static_cast<float>(scale)};
  const Rows rows{req_to_token.const_data_ptr<int64_t>(), row_p, len_p, start_p, new_p, req_to_token.stride(0)};
  switch (dtype) {
    case at::kFloat:
      return run_any_dim<float>(s, q, k_cache, v_cache, out, rows, n, brgemm);
    case at::kBFloat16:
      return run_any_dim<c10::BFloat16>(s, q, k_cache, v_cache, out, rows, n, brgemm);
    default:
      return run_any_dim<c10::Half>(s, q, k_cache, v_cache, out, rows, n, brgemm);
  }
}

}  // namespace

TORCH_LIBRARY(batchgen, m) {
  m.def(
      "paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor req_to_token, Tensor req_pool_indices, "
      "Tensor seq_lens, Tensor q_starts, Tensor q_lens, float scale, Tensor(a!) out, int brgemm=0) -> ()");
  // Whether bfloat16 attention runs on vdpbf16ps here (built for a CPU with AVX512-BF16), or on AVX2's 8-lane block
  // step; prefill_rows_supported (kernels/cpu/__init__.py) asks them.
  m.def("has_bf16_dot_product() -> bool", &has_bf16_dot_product);
  m.def("has_avx2_block() -> bool", &has_avx2_block);
}

TORCH_LIBRARY_IMPL(batchgen, CPU, m) { m.impl("paged_attention", &paged_attention); }
