// Rows of a round that share a prefix of KV slots (the prefix cache hands requests with a common prompt prefix the
// same slots): found here so that the paged-attention kernel reads and converts that prefix's K/V once for all of
// them (attend_bf16_shared, attend_shared, attend_brgemm_shared), as cascade attention does (FlashInfer's "cascade",
// SGLang's and vLLM's shared-prefix decoding). On the vector paths and with every row through brgemm a query's
// arithmetic is unchanged, so its output is bit-identical with or without the sharing; with brgemm for the shared
// blocks only (BrgemmRows::MANY_QUERIES) a grouped decode's rounding differs from its own alone.
#pragma once

#include "attention_common.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

// Rows (their indices in the call) whose first `depth` blocks of keys (kKeyBlock, or kGemmKeyBlock where they run
// through brgemm) are the same slots, every one of them seen whole by all their queries.
struct SharedPrefix {
  std::vector<int64_t> members;
  int64_t depth, block;  // depth blocks of `block` keys
};

// Groups of the `candidates` rows (each adding `queries_of(r)` queries, at most max_queries <= kSharedQueries in a
// group) that share whole leading blocks of `block` keys. Rows are sorted by their slots, so rows with a common
// prefix sit side by side; a run grows while the blocks it saves reading (depth x (members - 1)) do not shrink.
// Cost: a sort and a comparison of slot lists, small beside reading the K/V they name.
template <typename QueriesOf>
std::vector<SharedPrefix> shared_prefixes(const Rows& rows, std::vector<int64_t> candidates, QueriesOf queries_of,
                                          int64_t max_queries, int64_t block) {
  // Whole blocks every query of row r sees: its first new token sees seq_len - q_len + 1 keys.
  auto whole_blocks = [&](int64_t r) { return (rows.seq_lens[r] - rows.q_lens[r] + 1) / block; };
  std::erase_if(candidates, [&](int64_t r) { return whole_blocks(r) == 0; });
  auto common_blocks = [&](int64_t a, int64_t b) {
    const int64_t limit = std::min(whole_blocks(a), whole_blocks(b));
    int64_t n = 0;
    while (n < limit && std::memcmp(rows.slots_of(a) + n * block, rows.slots_of(b) + n * block,
                                    block * sizeof(int64_t)) == 0) {
      ++n;
    }
    return n;
  };
  // By their whole blocks' slots (a row's a prefix of a longer one's sorts first): a strict weak order, as the
  // sort needs, under which rows with a common prefix still sit side by side.
  std::stable_sort(candidates.begin(), candidates.end(), [&](int64_t a, int64_t b) {
    return std::lexicographical_compare(rows.slots_of(a), rows.slots_of(a) + whole_blocks(a) * block,
                                        rows.slots_of(b), rows.slots_of(b) + whole_blocks(b) * block);
  });
  std::vector<SharedPrefix> groups;
  for (size_t i = 0; i < candidates.size();) {
    SharedPrefix g{{candidates[i]}, whole_blocks(candidates[i]), block};
    int64_t queries = queries_of(candidates[i]);
    size_t j = i + 1;
    for (; j < candidates.size(); ++j) {
      const int64_t depth = std::min(g.depth, common_blocks(candidates[j - 1], candidates[j]));
      const int64_t members = static_cast<int64_t>(g.members.size());
      const bool fits = queries + queries_of(candidates[j]) <= max_queries;
      if (depth == 0 || !fits || depth * members < g.depth * (members - 1)) break;
      g.depth = depth;
      g.members.push_back(candidates[j]);
      queries += queries_of(candidates[j]);
    }
    if (g.members.size() > 1) groups.push_back(std::move(g));
    i = j;
  }
  return groups;
}

// The groups of a call's rows that read a shared prefix together: rows of fewer than kGemmMinQueries queries
// (decodes) grouped by whole blocks of `block` keys, then, with `then_key_blocks`, the rows left ungrouped, by
// blocks of kKeyBlock (SharedPrefix::block says which). A group is one work item per KV head: its queries are capped
// (max_queries, set here) so that the rows make at least two items per thread (one group of all the rows would
// leave a thread idle beside a few long items); rows of fewer queries than that are not grouped.
inline std::vector<SharedPrefix> group_shared_rows(const Rows& rows, int64_t num_rows, int64_t group,
                                                   int64_t num_kv_heads, int64_t block, bool then_key_blocks,
                                                   int64_t& max_queries) {
  std::vector<int64_t> few;
  int64_t few_queries = 0;
  for (int64_t r = 0; r < num_rows; ++r) {
    if (rows.q_lens[r] > 0 && rows.q_lens[r] * group < kGemmMinQueries) {
      few.push_back(r);
      few_queries += rows.q_lens[r] * group;
    }
  }
  const int64_t groups_wanted = (2 * at::get_num_threads() + num_kv_heads - 1) / num_kv_heads;
  max_queries = std::min(kSharedQueries, few_queries / groups_wanted);
  auto queries_of = [&](int64_t r) { return rows.q_lens[r] * group; };
  std::vector<SharedPrefix> shared;
  if (few.size() > 1) shared = shared_prefixes(rows, few, queries_of, max_queries, block);
  if (then_key_blocks && block != kKeyBlock) {
    std::vector<bool> grouped(num_rows, false);
    for (const SharedPrefix& g : shared) {
      for (int64_t r : g.members) grouped[r] = true;
    }
    std::erase_if(few, [&](int64_t r) { return grouped[r]; });
    if (few.size() > 1) {
      for (SharedPrefix& g : shared_prefixes(rows, few, queries_of, max_queries, kKeyBlock)) shared.push_back(g);
    }
  }
  return shared;
}

}  // namespace
