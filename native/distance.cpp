// The distance kernels of distance.h. Each is one loop body, inlined into a
// function built twice (FUSIONRAG_SIMD_CLONES): without -ffast-math the compiler
// may not reorder a single float sum, so every loop keeps independent partial
// sums ("lanes"), which it does vectorize.
#include "distance.h"
#include "scan4.h"

#include <cstring>

namespace fusionrag {
namespace {

// Lanes per element type: 16 floats are two AVX2 registers; bytes take 32, because
// with 16 GCC widens them 128 bits at a time, and 32 take whole AVX2 registers
// (half the time per distance at 384 and 784 dimensions).
template <class T>
constexpr size_t kLanes = sizeof(T) == 1 ? 32 : 16;

// Pairwise, so the lanes fold in a few vector adds rather than a serial chain.
template <size_t N>
__attribute__((always_inline)) inline float reduce(float* acc) {
  static_assert(N >= 4 && (N & (N - 1)) == 0);
  for (size_t half = N / 2; half >= 4; half /= 2)
    for (size_t j = 0; j < half; ++j) acc[j] += acc[j + half];
  return (acc[0] + acc[2]) + (acc[1] + acc[3]);
}

// The tail, fewer than N elements, goes into the first lanes: eight at a time (one vector), then one at a time
// (GloVe's 50 dimensions in bytes were 32 and then 18 one at a time). Written out in each body: with the step as
// a lambda, GCC vectorized the clones worse (384 bytes: 104 against 76 ns).
template <class T>
__attribute__((always_inline)) inline float l2_body(const float* q, const T* x, size_t d) {
  constexpr size_t N = kLanes<T>;
  float acc[N] = {};
  size_t i = 0;
  for (; i + N <= d; i += N)
    for (size_t j = 0; j < N; ++j) {
      float t = q[i + j] - float(x[i + j]);
      acc[j] += t * t;
    }
  for (; i + 8 <= d; i += 8)
    for (size_t j = 0; j < 8; ++j) {
      float t = q[i + j] - float(x[i + j]);
      acc[j] += t * t;
    }
  for (size_t j = 0; i < d; ++i, ++j) {
    float t = q[i] - float(x[i]);
    acc[j] += t * t;
  }
  return reduce<N>(acc);
}

template <class T>
__attribute__((always_inline)) inline float dot_body(const float* q, const T* x, size_t d) {
  constexpr size_t N = kLanes<T>;
  float acc[N] = {};
  size_t i = 0;
  for (; i + N <= d; i += N)
    for (size_t j = 0; j < N; ++j) acc[j] += q[i + j] * float(x[i + j]);
  for (; i + 8 <= d; i += 8)
    for (size_t j = 0; j < 8; ++j) acc[j] += q[i + j] * float(x[i + j]);
  for (size_t j = 0; i < d; ++i, ++j) acc[j] += q[i] * float(x[i]);
  return reduce<N>(acc);
}

// sq8_l2's body; N lanes (16 below 64 dimensions: fewer to fold at the end, where that is much of the work).
template <size_t N>
__attribute__((always_inline)) inline float sq8_body(const float* qc, const float* s, const uint8_t* c, size_t d) {
  float acc[N] = {};
  size_t i = 0;
  for (; i + N <= d; i += N)
    for (size_t j = 0; j < N; ++j) {
      float t = s[i + j] * (qc[i + j] - float(c[i + j]));
      acc[j] += t * t;
    }
  for (; i + 8 <= d; i += 8)
    for (size_t j = 0; j < 8; ++j) {
      float t = s[i + j] * (qc[i + j] - float(c[i + j]));
      acc[j] += t * t;
    }
  for (size_t j = 0; i < d; ++i, ++j) {
    float t = s[i] * (qc[i] - float(c[i]));
    acc[j] += t * t;
  }
  return reduce<N>(acc);
}

}  // namespace

FUSIONRAG_SIMD_CLONES float l2_sqr(const float* q, const float* x, size_t d) { return l2_body(q, x, d); }
FUSIONRAG_SIMD_CLONES float l2_sqr(const float* q, const uint8_t* x, size_t d) { return l2_body(q, x, d); }
FUSIONRAG_SIMD_CLONES float l2_sqr(const float* q, const int8_t* x, size_t d) { return l2_body(q, x, d); }
FUSIONRAG_SIMD_CLONES float neg_ip(const float* q, const float* x, size_t d) { return -dot_body(q, x, d); }
FUSIONRAG_SIMD_CLONES float neg_ip(const float* q, const uint8_t* x, size_t d) { return -dot_body(q, x, d); }
FUSIONRAG_SIMD_CLONES float neg_ip(const float* q, const int8_t* x, size_t d) { return -dot_body(q, x, d); }

// Scaled in code units, so it overflows only where the distance does.
FUSIONRAG_SIMD_CLONES
float sq8_l2(const float* qc, const float* s, const uint8_t* c, size_t d) {
  return d < 64 ? sq8_body<16>(qc, s, c, d) : sq8_body<kLanes<uint8_t>>(qc, s, c, d);
}

namespace {

// Eight floats: one AVX register, or two SSE ones; GCC/Clang vector extensions,
// so that the table's inner loop is vector code without -ffast-math.
using Lanes = float __attribute__((vector_size(32)));
constexpr size_t kWidth = sizeof(Lanes) / sizeof(float);
constexpr size_t kBlock = 4 * kWidth;  // centroids whose sums stay in registers across a sub-space
static_assert(kCodebook % kBlock == 0);

// Unaligned loads and stores. GCC notes that Lanes by value has another ABI with AVX than
// without (up to the end of pq_table); these are always inlined, into both builds of
// pq_table, so no call crosses.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wpsabi"
__attribute__((always_inline)) inline Lanes load(const float* p) {
  Lanes v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

__attribute__((always_inline)) inline void store(float* p, Lanes v) { std::memcpy(p, &v, sizeof v); }

}  // namespace

// One query's table over K centroids a sub-space (pq_table's 256, pq4_table's 16): the sums of a block of them
// (at most kBlock) stay in registers across a sub-space's dimensions. Inlined into each build of both.
template <size_t K>
__attribute__((always_inline)) inline void table_body(const float* padded, const float* columns, const float* norms,
                                                      size_t M, size_t dsub, float* lut) {
  constexpr size_t block = K < kBlock ? K : kBlock, lanes = block / kWidth;
  static_assert(K % block == 0 && block % kWidth == 0);
  for (size_t m = 0; m < M; ++m) {
    const float* qm = padded + m * dsub;
    const float* cols = columns + m * dsub * K;
    float* row = lut + m * K;
    float qn = 0;
    for (size_t d = 0; d < dsub; ++d) qn += qm[d] * qm[d];
    for (size_t k = 0; k < K; k += block) {
      Lanes acc[lanes] = {};
      for (size_t d = 0; d < dsub; ++d) {
        Lanes x = Lanes{} + qm[d];
        for (size_t j = 0; j < lanes; ++j) acc[j] += x * load(cols + d * K + k + j * kWidth);
      }
      for (size_t j = 0; j < lanes; ++j) {
        size_t at = k + j * kWidth;
        // As numpy: (-2 q.c + ||q||^2) + ||c||^2, so candidate orders match up to rounding.
        store(row + at, norms ? (acc[j] * -2.0f + qn) + load(norms + m * K + at) : -acc[j]);
      }
    }
  }
}

// numpy's tables come from OpenBLAS kernels picked at run time (AVX2, AVX-512); this
// one has its AVX2 + FMA build too.
FUSIONRAG_SIMD_CLONES
void pq_table(const float* padded, const float* columns, const float* norms, size_t M, size_t dsub, float* lut) {
  table_body<kCodebook>(padded, columns, norms, M, dsub, lut);
}

// The 4-bit tables (scan4.h): the same sums over 16 centroids a sub-space.
FUSIONRAG_SIMD_CLONES
void pq4_table(const float* padded, const float* columns, const float* norms, size_t M, size_t dsub, float* lut) {
  table_body<kCodebook4>(padded, columns, norms, M, dsub, lut);
}
#pragma GCC diagnostic pop

}  // namespace fusionrag
