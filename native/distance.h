// Float distances shared by the native parts. Smaller is always better:
// "l2" is the squared Euclidean distance, "ip" the negative inner product.
#pragma once
#include <cstddef>
#include <stdexcept>
#include <string>

namespace fusionrag {

// One AVX2 clone beside the baseline, picked at load time, so the wheel still
// runs on any x86-64 and builds unchanged elsewhere.
#if defined(__x86_64__)
#define FUSIONRAG_SIMD_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define FUSIONRAG_SIMD_CLONES
#endif

enum class Metric { L2, IP };

inline Metric parse_metric(const std::string& name) {
  if (name == "l2") return Metric::L2;
  if (name == "ip") return Metric::IP;
  throw std::invalid_argument("unknown metric '" + name + "' (expected 'l2' or 'ip')");
}

inline const char* metric_name(Metric m) { return m == Metric::L2 ? "l2" : "ip"; }

// Pairwise, so the lanes fold in a few vector adds rather than a serial chain.
static inline float reduce16(float* acc) {
  for (size_t j = 0; j < 8; ++j) acc[j] += acc[j + 8];
  for (size_t j = 0; j < 4; ++j) acc[j] += acc[j + 4];
  return (acc[0] + acc[2]) + (acc[1] + acc[3]);
}

// Sixteen independent partial sums: without -ffast-math the compiler may not
// reorder a single float sum, but it does vectorize these lanes.
FUSIONRAG_SIMD_CLONES
static inline float l2_sqr(const float* a, const float* b, size_t d) {
  float acc[16] = {};
  size_t i = 0;
  for (; i + 16 <= d; i += 16)
    for (size_t j = 0; j < 16; ++j) {
      float t = a[i + j] - b[i + j];
      acc[j] += t * t;
    }
  for (size_t j = 0; i < d; ++i, ++j) {
    float t = a[i] - b[i];
    acc[j] += t * t;
  }
  return reduce16(acc);
}

FUSIONRAG_SIMD_CLONES
static inline float neg_ip(const float* a, const float* b, size_t d) {
  float acc[16] = {};
  size_t i = 0;
  for (; i + 16 <= d; i += 16)
    for (size_t j = 0; j < 16; ++j) acc[j] += a[i + j] * b[i + j];
  for (size_t j = 0; i < d; ++i, ++j) acc[j] += a[i] * b[i];
  return -reduce16(acc);
}

using DistanceFn = float (*)(const float*, const float*, size_t);

inline DistanceFn distance_fn(Metric m) { return m == Metric::L2 ? l2_sqr : neg_ip; }

}  // namespace fusionrag
