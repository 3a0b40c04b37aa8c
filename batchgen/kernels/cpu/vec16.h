// Sixteen float32 lanes (one AVX-512 register, two AVX2 ones, ...) written with GCC/Clang vector extensions,
// and the machine's own width (vnf: 16 lanes with AVX-512, 8 elsewhere), shared by batchgen's CPU kernels:
// loading float32/bfloat16/float16 as float32, horizontal sums and an exp, each in one fixed order so that
// results do not depend on where a value sits in a batch.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#if defined(__F16C__) || defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#if defined(__has_builtin)
#if __has_builtin(__builtin_shufflevector)
#define BATCHGEN_HAS_SHUFFLE 1
#endif
#endif

namespace {

typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint32_t v16u __attribute__((vector_size(64)));
typedef uint16_t v16h __attribute__((vector_size(32)));

constexpr int64_t kLanes = 16;
constexpr float kInf = std::numeric_limits<float>::infinity();

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return std::bit_cast<float>(static_cast<uint32_t>(x.x) << 16); }
inline float to_float(c10::Half x) { return static_cast<float>(x); }

inline v16f load16(const float* p) {
  v16f v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline v16f load16(const c10::BFloat16* p) {
  // bfloat16 is the top half of a float32: widen the bits and shift them up.
#if defined(__AVX512F__)
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return reinterpret_cast<v16f>(_mm512_slli_epi32(wide, 16));  // gcc's own conversion takes 3 more shuffles
#else
  v16h h;
  std::memcpy(&h, p, sizeof(h));
  return reinterpret_cast<v16f>(__builtin_convertvector(h, v16u) << 16);
#endif
}

inline v16f load16(const c10::Half* p) {
  v16f v;
#if defined(__F16C__)
  const __m256 lo = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256 hi = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)));
  std::memcpy(&v, &lo, sizeof(lo));
  std::memcpy(reinterpret_cast<char*>(&v) + sizeof(lo), &hi, sizeof(hi));
#else
  for (int64_t l = 0; l < kLanes; ++l) v[l] = static_cast<float>(p[l]);
#endif
  return v;
}

inline float hsum(v16f a) {  // the same tree as sum16
  float h[8], q[4];
  for (int l = 0; l < 8; ++l) h[l] = a[l] + a[l + 8];
  for (int l = 0; l < 4; ++l) q[l] = h[l] + h[l + 4];
  return (q[0] + q[2]) + (q[1] + q[3]);
}

// exp(x) for x <= 0 (-inf allowed): x = n ln2 + r with |r| <= ln2 / 2, exp(r) by its Taylor series to r^7
// (truncation error below 1e-8), times 2^n built in the exponent bits, which must stay a normal float: exactly 0
// below -87 (exp(-87) is 1.6e-38, float32's smallest normal 1.2e-38). Vector arithmetic only, so it vectorises,
// unlike expf.
// V: v16f or vnf.
template <typename V>
inline V exp_nonpositive(V x) {
  using I = decltype(x < x);  // the lanes' int32 type
  const I underflow = x < -87.0f;
  x = underflow ? V{} - 87.0f : x;
  constexpr float kRound = 12582912.0f;  // 1.5 * 2^23: adding it rounds a float of magnitude < 2^22 to an integer
  const V n = (x * 1.44269504088896341f + kRound) - kRound;
  V r = x - n * 0.693359375f;  // ln 2 split in two (Cody & Waite) so that n * ln 2 loses no bits
  r = r - n * -2.12194440e-4f;
  V p = r * (1.f / 5040) + 1.f / 720;
  p = p * r + 1.f / 120;
  p = p * r + 1.f / 24;
  p = p * r + 1.f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const I bits = (__builtin_convertvector(n, I) + 127) << 23;
  return underflow ? V{} : p * reinterpret_cast<V>(bits);
}

// ---- the machine's own width ----
//
// Kernels whose lanes never meet (the elementwise ops, argmax) use the widest vector the machine has registers
// for: 16 float32 lanes with AVX-512, 8 elsewhere. GCC keeps a vector wider than the registers in memory (with
// AVX2 a 16-lane vector moves through the stack 16 bytes at a time, and the elementwise ops ran 2-5x slower
// than PyTorch's), so they do not use v16f there.
#if defined(__AVX512F__)
constexpr int64_t kNativeLanes = 16;
#else
constexpr int64_t kNativeLanes = 8;
#endif
typedef float vnf __attribute__((vector_size(kNativeLanes * 4)));
typedef int32_t vni __attribute__((vector_size(kNativeLanes * 4)));
typedef uint32_t vnu __attribute__((vector_size(kNativeLanes * 4)));
typedef uint16_t vnh __attribute__((vector_size(kNativeLanes * 2)));

inline vnf loadn(const float* p) {
  vnf v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline vnf loadn(const c10::BFloat16* p) {
#if defined(__AVX512F__)
  return load16(p);
#elif defined(__AVX2__)
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return reinterpret_cast<vnf>(_mm256_slli_epi32(wide, 16));  // as load16: gcc's own conversion shuffles more
#else
  vnh h;
  std::memcpy(&h, p, sizeof(h));
  return reinterpret_cast<vnf>(__builtin_convertvector(h, vnu) << 16);
#endif
}

inline vnf loadn(const c10::Half* p) {
#if defined(__AVX512F__)
  return load16(p);
#elif defined(__F16C__)
  return reinterpret_cast<vnf>(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#else
  vnf v;
  for (int64_t l = 0; l < kNativeLanes; ++l) v[l] = static_cast<float>(p[l]);
  return v;
#endif
}

// x in every lane, exactly, as one broadcast load from memory: `vnf{} + x` compiles to an add and a register
// shuffle, and the shuffle takes the port an AVX-512 FMA needs.
inline vnf splatn(float x) {
#if defined(__AVX512F__)
  return reinterpret_cast<vnf>(_mm512_set1_ps(x));
#elif defined(__AVX2__)
  return reinterpret_cast<vnf>(_mm256_set1_ps(x));
#else
  vnf v;
  for (int64_t l = 0; l < kNativeLanes; ++l) v[l] = x;
  return v;
#endif
}

// a * b + c rounded once (a fused multiply-add in every lane), whatever the compiler's contraction flags: the
// order-exact sums of half_linear.cpp rest on it.
inline vnf fmaddn(vnf a, vnf b, vnf c) {
#if defined(__AVX512F__)
  return reinterpret_cast<vnf>(_mm512_fmadd_ps(reinterpret_cast<__m512>(a), reinterpret_cast<__m512>(b),
                                               reinterpret_cast<__m512>(c)));
#elif defined(__FMA__)
  return reinterpret_cast<vnf>(_mm256_fmadd_ps(reinterpret_cast<__m256>(a), reinterpret_cast<__m256>(b),
                                               reinterpret_cast<__m256>(c)));
#else
  for (int64_t l = 0; l < kNativeLanes; ++l) c[l] = std::fma(a[l], b[l], c[l]);
  return c;
#endif
}

inline float hsumn(vnf a) {  // 16 lanes: hsum's tree; 8 lanes: its last three levels
#if defined(__AVX512F__)
  return hsum(a);
#else
  float q[4];
  for (int l = 0; l < 4; ++l) q[l] = a[l] + a[l + 4];
  return (q[0] + q[2]) + (q[1] + q[3]);
#endif
}

}  // namespace
