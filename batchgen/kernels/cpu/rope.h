// RoPE for bfloat16 models on the CPU, included by elementwise.cpp (which registers the ops): rotary_embedding, and
// rotary_embedding_kv, which also writes the new tokens' K/V into the KV pool in the same pass.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include "bf16_round.h"
#include "vec16.h"

#include <cstdint>
#include <cstring>
#include <tuple>
#include <type_traits>

namespace {

// One head of RoPE in the rotate-half layout: out = bf16(bf16(x * c) + bf16(rotate_half(x) * s)), c and s the
// table rows rounded to bfloat16, as transformers computes q * cos + rotate_half(q) * sin in bfloat16. x is
// bfloat16 or float32 (rounded on load); out is bfloat16.
template <typename X>
inline void rotate_head(const X* x, const float* cos, const float* sin, int64_t head_dim, BFloat16* out) {
  const int64_t half = head_dim / 2;
  if (half % kNativeLanes == 0) {
    for (int64_t c = 0; c < half; c += kNativeLanes) {
      const vnf lo = load_value(x + c), hi = load_value(x + half + c);
      const vnf cos_lo = round_bf16(loadn(cos + c)), cos_hi = round_bf16(loadn(cos + half + c));
      const vnf sin_lo = round_bf16(loadn(sin + c)), sin_hi = round_bf16(loadn(sin + half + c));
      storen(out + c, round_bf16(lo * cos_lo) + round_bf16(-hi * sin_lo));
      storen(out + half + c, round_bf16(hi * cos_hi) + round_bf16(lo * sin_hi));
    }
    return;
  }
  for (int64_t d = 0; d < head_dim; ++d) {
    const float rotated = d < half ? -value(x[d + half]) : value(x[d - half]);
    out[d] = static_cast<BFloat16>(round_bf16(value(x[d]) * round_bf16(cos[d])) +
                                   round_bf16(rotated * round_bf16(sin[d])));
  }
}

// Token t's heads of x ([tokens, heads, head_dim], X values) rotated into dst(h), bfloat16 rows.
template <typename X, typename Dst>
inline void rotate_heads(const at::Tensor& x, int64_t t, const float* cos, const float* sin, Dst dst) {
  for (int64_t h = 0; h < x.size(1); ++h) {
    rotate_head(x.const_data_ptr<X>() + t * x.stride(0) + h * x.stride(1), cos, sin, x.size(2), dst(h));
  }
}

void check_heads(const at::Tensor& t, const char* name, int64_t tokens, int64_t head_dim) {
  TORCH_CHECK(t.dim() == 3 && t.size(0) == tokens && t.size(2) == head_dim && t.stride(2) == 1,
              "batchgen::rotary_embedding: ", name, " must be [", tokens, ", heads, ", head_dim,
              "] with a contiguous last dimension, got ", t.sizes());
  TORCH_CHECK((t.scalar_type() == at::kBFloat16 || t.scalar_type() == at::kFloat) && t.device().is_cpu(),
              "batchgen::rotary_embedding: ", name, " must be a bfloat16 or float32 CPU tensor, got ", t.scalar_type(),
              " on ", t.device());
}

// The checks rotary_embedding and rotary_embedding_kv share: positions, q, k and the tables.
void check_rope_inputs(const at::Tensor& positions, const at::Tensor& q, const at::Tensor& k,
                       const at::Tensor& cos_table, const at::Tensor& sin_table) {
  TORCH_CHECK(q.dim() == 3, "batchgen::rotary_embedding: q must be 3-D [tokens, heads, head_dim], got shape ",
              q.sizes());
  const int64_t tokens = positions.numel(), head_dim = q.size(2);
  TORCH_CHECK(positions.dim() == 1 && positions.scalar_type() == at::kLong && positions.is_contiguous(),
              "batchgen::rotary_embedding: positions must be contiguous int64 [tokens], got ", positions.scalar_type(),
              " ", positions.sizes());
  TORCH_CHECK(head_dim > 0 && head_dim % 2 == 0, "batchgen::rotary_embedding: head_dim must be even, got ", head_dim);
  check_heads(q, "q", tokens, head_dim);
  check_heads(k, "k", tokens, head_dim);
  TORCH_CHECK(q.scalar_type() == k.scalar_type(), "batchgen::rotary_embedding: q and k must have one dtype, got ",
              q.scalar_type(), " and ", k.scalar_type());
  for (const at::Tensor* t : {&cos_table, &sin_table}) {
    TORCH_CHECK(t->dim() == 2 && t->size(1) == head_dim && t->is_contiguous() && t->scalar_type() == at::kFloat,
                "batchgen::rotary_embedding: cos/sin tables must be contiguous float32 [positions, ", head_dim,
                "], got ", t->scalar_type(), " ", t->sizes());
  }
  TORCH_CHECK(sin_table.size(0) == cos_table.size(0), "batchgen::rotary_embedding: the cos and sin tables must have ",
              "the same rows, got ", cos_table.size(0), " and ", sin_table.size(0));
  const int64_t* pos = positions.const_data_ptr<int64_t>();
  const int64_t table_rows = cos_table.size(0);
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(pos[t] >= 0 && pos[t] < table_rows, "batchgen::rotary_embedding: position ", pos[t],
                " is outside the tables' ", table_rows, " rows");
  }
}

// q [tokens, heads, head_dim] and k [tokens, kv_heads, head_dim], both bfloat16 or both float32 (rounded on
// load), rotated into new contiguous bfloat16 tensors.
std::tuple<at::Tensor, at::Tensor> rotary_embedding(const at::Tensor& positions, const at::Tensor& q,
                                                    const at::Tensor& k, const at::Tensor& cos_table,
                                                    const at::Tensor& sin_table) {
  check_rope_inputs(positions, q, k, cos_table, sin_table);
  const int64_t tokens = positions.numel(), head_dim = q.size(2);
  const int64_t* pos = positions.const_data_ptr<int64_t>();
  const auto out_options = q.options().dtype(at::kBFloat16);
  at::Tensor q_out = at::empty(q.sizes(), out_options), k_out = at::empty(k.sizes(), out_options);
  const int64_t q_heads = q.size(1), k_heads = k.size(1);
  BFloat16 *q_out_p = q_out.mutable_data_ptr<BFloat16>(), *k_out_p = k_out.mutable_data_ptr<BFloat16>();
  dispatch_value_types(q.scalar_type(), at::kBFloat16, [&](auto in_type, auto) {
    using X = decltype(in_type);
    at::parallel_for(0, tokens, grain((q_heads + k_heads) * head_dim), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const float* cos = cos_table.const_data_ptr<float>() + pos[t] * head_dim;
        const float* sin = sin_table.const_data_ptr<float>() + pos[t] * head_dim;
        rotate_heads<X>(q, t, cos, sin, [&](int64_t h) { return q_out_p + (t * q_heads + h) * head_dim; });
        rotate_heads<X>(k, t, cos, sin, [&](int64_t h) { return k_out_p + (t * k_heads + h) * head_dim; });
      }
    });
  });
  return {q_out, k_out};
}

// RoPE with the KV store folded in: q rotated into a new bfloat16 tensor (returned), k rotated and v (rounded to
// bfloat16) written straight into one layer of the head-major pool, k_cache/v_cache [kv_heads, slots, head_dim],
// at slots loc [tokens]: what rotary_embedding followed by TokenToKVPool.set_kv does, without k's temporary and the
// two index copies.
at::Tensor rotary_embedding_kv(const at::Tensor& positions, const at::Tensor& q, const at::Tensor& k,
                               const at::Tensor& v, const at::Tensor& cos_table, const at::Tensor& sin_table,
                               const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& loc) {
  constexpr const char* op = "batchgen::rotary_embedding_kv: ";
  check_rope_inputs(positions, q, k, cos_table, sin_table);
  const int64_t tokens = positions.numel(), head_dim = q.size(2), kv_heads = k.size(1);
  check_heads(v, "v", tokens, head_dim);
  TORCH_CHECK(v.scalar_type() == k.scalar_type() && v.size(1) == kv_heads, op, "v must be like k, got ",
              v.scalar_type(), " ", v.sizes());
  for (const at::Tensor* t : {&k_cache, &v_cache}) {
    TORCH_CHECK(t->dim() == 3 && t->size(0) == kv_heads && t->size(2) == head_dim && t->stride(2) == 1 &&
                    t->scalar_type() == at::kBFloat16 && t->device().is_cpu(),
                op, "k_cache and v_cache must be bfloat16 CPU [", kv_heads, ", slots, ", head_dim,
                "] with a contiguous last dimension, got ", t->scalar_type(), " ", t->sizes());
  }
  TORCH_CHECK(v_cache.sizes() == k_cache.sizes() && v_cache.strides() == k_cache.strides(), op,
              "k_cache and v_cache must have one shape and strides");
  TORCH_CHECK(loc.dim() == 1 && loc.numel() == tokens && loc.scalar_type() == at::kLong && loc.is_contiguous(), op,
              "loc must be contiguous int64 [", tokens, "], got ", loc.scalar_type(), " ", loc.sizes());
  const int64_t* slots = loc.const_data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(slots[t] >= 0 && slots[t] < k_cache.size(1), op, "slot ", slots[t], " is outside the pool's ",
                k_cache.size(1), " slots");
  }
  const int64_t* pos = positions.const_data_ptr<int64_t>();
  at::Tensor q_out = at::empty(q.sizes(), q.options().dtype(at::kBFloat16));
  const int64_t q_heads = q.size(1), head_stride = k_cache.stride(0), slot_stride = k_cache.stride(1);
  BFloat16* q_out_p = q_out.mutable_data_ptr<BFloat16>();
  BFloat16* k_pool = k_cache.mutable_data_ptr<BFloat16>();
  BFloat16* v_pool = v_cache.mutable_data_ptr<BFloat16>();
  dispatch_value_types(q.scalar_type(), at::kBFloat16, [&](auto in_type, auto) {
    using X = decltype(in_type);
    at::parallel_for(0, tokens, grain((q_heads + 2 * kv_heads) * head_dim), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const float* cos = cos_table.const_data_ptr<float>() + pos[t] * head_dim;
        const float* sin = sin_table.const_data_ptr<float>() + pos[t] * head_dim;
        rotate_heads<X>(q, t, cos, sin, [&](int64_t h) { return q_out_p + (t * q_heads + h) * head_dim; });
        rotate_heads<X>(k, t, cos, sin, [&](int64_t h) { return k_pool + h * head_stride + slots[t] * slot_stride; });
        for (int64_t h = 0; h < kv_heads; ++h) {
          const int64_t dst = h * head_stride + slots[t] * slot_stride;
          const X* src = v.const_data_ptr<X>() + t * v.stride(0) + h * v.stride(1);
          if constexpr (std::is_same_v<X, BFloat16>) {
            std::memcpy(v_pool + dst, src, head_dim * sizeof(BFloat16));
          } else {
            for (int64_t d = 0; d < head_dim; ++d) v_pool[dst + d] = static_cast<BFloat16>(src[d]);
          }
        }
      }
    });
  });
  return q_out;
}

}  // namespace
