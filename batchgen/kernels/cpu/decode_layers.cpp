// The decoder layers of a Llama-family bfloat16 model for a round of a few decode rows, in one call. A small
// batch's decode step runs ten short ops a layer; called one by one from Python, each pays the interpreter, the
// module calls and the dispatcher's Python entry, a large part of the step (docs/performance.md). Here the same
// ops run in the same order on the same inputs through the dispatcher's C++ entry, so every output bit is the
// Python path's (tests/kernels/test_cpu_decode_layers.py): this is that path's call sequence, not another kernel.
// Two sequences, as the model's linear layers run: with half-precision weights, the float32 carrier's
// (LlamaForCausalLM.carry_float32): linear layers on those weights (half_weight_linear) hand float32 outputs on
// unrounded, the norms and SiLU-and-multiply write float32 holding bfloat16 values; with brgemm-packed weights
// (brgemm_linear), every op's output is bfloat16. The residual stream and the KV cache
// are bfloat16 in both.

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <chrono>
#include <cstdint>
#include <optional>
#include <tuple>

namespace {

using OptionalTensor = std::optional<at::Tensor>;

// The ops the layers call, looked up once: their schemas are registered by the other sources of this extension.
using RmsNorm = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, double, const OptionalTensor&,
                                                   std::optional<at::ScalarType>);
using Linear = at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, const OptionalTensor&);
using BrgemmLinear = at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, const OptionalTensor&, bool);
using RopeKv = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                          const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                          const at::Tensor&);
using Attention = void(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                       const at::Tensor&, const at::Tensor&, const at::Tensor&, double, const at::Tensor&, int64_t);
using SiluAndMul = at::Tensor(const at::Tensor&, std::optional<at::ScalarType>);
using GateUpSilu = at::Tensor(const at::Tensor&, const at::Tensor&, int64_t);

struct Ops {
  c10::TypedOperatorHandle<RmsNorm> rms_norm;
  c10::TypedOperatorHandle<Linear> linear;
  c10::TypedOperatorHandle<BrgemmLinear> brgemm_linear;
  c10::TypedOperatorHandle<RopeKv> rope_kv;
  c10::TypedOperatorHandle<Attention> attention;
  c10::TypedOperatorHandle<SiluAndMul> silu_and_mul;
  c10::TypedOperatorHandle<GateUpSilu> gate_up_silu;
};

const Ops& ops() {
  static const Ops found = [] {
    auto& d = c10::Dispatcher::singleton();
    return Ops{
        d.findSchemaOrThrow("batchgen::rms_norm", "").typed<RmsNorm>(),
        d.findSchemaOrThrow("batchgen::half_weight_linear", "").typed<Linear>(),
        d.findSchemaOrThrow("batchgen::brgemm_linear", "").typed<BrgemmLinear>(),
        d.findSchemaOrThrow("batchgen::rotary_embedding_kv", "").typed<RopeKv>(),
        d.findSchemaOrThrow("batchgen::paged_attention", "").typed<Attention>(),
        d.findSchemaOrThrow("batchgen::silu_and_mul", "").typed<SiluAndMul>(),
        d.findSchemaOrThrow("batchgen::brgemm_linear_silu_and_mul", "").typed<GateUpSilu>(),
    };
  }();
  return found;
}

// Layer l's tensors: norms[2l], norms[2l + 1] (input and post-attention RMSNorm weights, bfloat16), weights[4l ..
// 4l + 3] (the qkv, o, gate/up and down projections' weights, packed for half_weight_linear with float32_carrier,
// else for brgemm_linear; out_features[w] their output widths), biases[2l], biases[2l + 1] (qkv's and o's float32
// biases or None);
// norms[2L] is the final norm's weight; brgemm as paged_attention takes it; gate_up_silu: empty, or a flag a layer
// for the projection and SiLU-and-multiply as one op. Returns the final norm's bfloat16 output. With
// attention_seconds (float64 [1]), adds the wall time of the attention calls to it: the benchmarks' attention clock,
// which cannot see into this call otherwise.
at::Tensor decode_layers(const at::Tensor& hidden, const at::Tensor& positions, at::TensorList norms,
                         at::TensorList weights, const c10::List<OptionalTensor>& biases, double eps,
                         int64_t num_heads, const at::Tensor& cos_table, const at::Tensor& sin_table,
                         const at::Tensor& k_buffer, const at::Tensor& v_buffer, const at::Tensor& loc,
                         const at::Tensor& req_to_token, const at::Tensor& req_pool_indices,
                         const at::Tensor& seq_lens, const at::Tensor& q_starts, const at::Tensor& q_lens,
                         double scale, int64_t brgemm, at::IntArrayRef out_features, bool float32_carrier,
                         const c10::List<bool>& gate_up_silu, const OptionalTensor& attention_seconds) {
  constexpr const char* op = "batchgen::decode_layers: ";
  const int64_t layers = k_buffer.size(0);
  TORCH_CHECK(k_buffer.dim() == 4 && v_buffer.sizes() == k_buffer.sizes(), op,
              "k_buffer and v_buffer must both be [layers, num_kv_heads, slots, head_dim], got ", k_buffer.sizes(),
              " and ", v_buffer.sizes());
  TORCH_CHECK(static_cast<int64_t>(norms.size()) == 2 * layers + 1 &&
                  static_cast<int64_t>(weights.size()) == 4 * layers &&
                  static_cast<int64_t>(biases.size()) == 2 * layers,
              op, "the pool has ", layers, " layers: expected ", 2 * layers + 1, " norms, ", 4 * layers,
              " weights and ", 2 * layers, " biases, got ", norms.size(), ", ", weights.size(), " and ",
              biases.size());
  TORCH_CHECK(out_features.size() == weights.size(), op, "out_features must list one width for each of ",
              weights.size(), " weights, got ", out_features.size());
  TORCH_CHECK(gate_up_silu.empty() || static_cast<int64_t>(gate_up_silu.size()) == layers, op,
              "gate_up_silu must be empty or hold one flag for each of ", layers, " layers, got ", gate_up_silu.size());
  for (const bool fused : gate_up_silu) {
    TORCH_CHECK(!float32_carrier || !fused, op, "gate_up_silu needs brgemm-packed weights");
  }
  TORCH_CHECK(hidden.dim() == 2, op, "hidden must be [tokens, hidden_size], got ", hidden.sizes());
  TORCH_CHECK(!attention_seconds || (attention_seconds->scalar_type() == at::kDouble &&
                                     attention_seconds->numel() == 1 && attention_seconds->device().is_cpu()),
              op, "attention_seconds must be a float64 CPU tensor of one element");
  double* clock = attention_seconds ? attention_seconds->mutable_data_ptr<double>() : nullptr;
  const Ops& o = ops();
  const int64_t tokens = hidden.size(0), num_kv_heads = k_buffer.size(1), head_dim = k_buffer.size(3);
  const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  const std::optional<at::ScalarType> carrier =
      float32_carrier ? std::optional<at::ScalarType>(at::kFloat) : std::nullopt;
  const auto linear = [&](const at::Tensor& x_in, int64_t w, const OptionalTensor& bias) {
    return float32_carrier ? o.linear.call(x_in, weights[w], out_features[w], bias)
                           : o.brgemm_linear.call(x_in, weights[w], out_features[w], bias, true);
  };
  at::Tensor x = hidden;
  OptionalTensor residual;
  for (int64_t l = 0; l < layers; ++l) {
    auto [normed, summed] = o.rms_norm.call(x, norms[2 * l], eps, residual, carrier);
    residual = summed;
    const at::Tensor qkv = linear(normed, 4 * l, biases.get(2 * l));
    const at::Tensor q = qkv.narrow(1, 0, q_size).view({tokens, num_heads, head_dim});
    const at::Tensor k = qkv.narrow(1, q_size, kv_size).view({tokens, num_kv_heads, head_dim});
    const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({tokens, num_kv_heads, head_dim});
    const at::Tensor k_cache = k_buffer.select(0, l), v_cache = v_buffer.select(0, l);
    const at::Tensor rotated = o.rope_kv.call(positions, q, k, v, cos_table, sin_table, k_cache, v_cache, loc);
    const at::Tensor attended = at::empty_like(rotated);
    const auto start = std::chrono::steady_clock::now();
    o.attention.call(rotated, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, q_starts, q_lens, scale,
                     attended, brgemm);
    if (clock != nullptr) *clock += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    const at::Tensor projected = linear(attended.view({tokens, q_size}), 4 * l + 1, biases.get(2 * l + 1));
    auto [mlp_in, mlp_residual] = o.rms_norm.call(projected, norms[2 * l + 1], eps, residual, carrier);
    residual = mlp_residual;
    // The projection and SiLU-and-multiply as one op (brgemm_linear.cpp, the bits of the two) where the model fuses
    // them (MLP.gate_up_silu).
    const at::Tensor activated = !gate_up_silu.empty() && gate_up_silu.get(l)
                                     ? o.gate_up_silu.call(mlp_in, weights[4 * l + 2], out_features[4 * l + 2] / 2)
                                     : o.silu_and_mul.call(linear(mlp_in, 4 * l + 2, std::nullopt), carrier);
    x = linear(activated, 4 * l + 3, std::nullopt);
  }
  return std::get<0>(o.rms_norm.call(x, norms[2 * layers], eps, residual, std::nullopt));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(batchgen, m) {
  m.def(
      "decode_layers(Tensor hidden, Tensor positions, Tensor[] norms, Tensor[] weights, Tensor?[] biases, float eps, "
      "int num_heads, Tensor cos_table, Tensor sin_table, Tensor(a!) k_buffer, Tensor(b!) v_buffer, Tensor loc, "
      "Tensor req_to_token, Tensor req_pool_indices, Tensor seq_lens, Tensor q_starts, Tensor q_lens, float scale, "
      "int brgemm, int[] out_features, bool float32_carrier, bool[] gate_up_silu, Tensor(c!)? attention_seconds=None) "
      "-> Tensor");
}

TORCH_LIBRARY_IMPL(batchgen, CPU, m) { m.impl("decode_layers", &decode_layers); }
