// dot_rows (distance.h): inner products of a block of queries with every row of a matrix of floats or bytes,
// blocked as a matrix product is. The navigation tier's exact search (graph.cpp exact_search) is its user:
// it reads the graph's SQ8 codes in place, with no decoded copy and no BLAS.
//
// The body (dot_kernel.inc) is built twice where GCC targets x86-64: for AVX2 + FMA, picked where the CPU has
// them, and for the baseline (vectors of 8 floats as two SSE registers). An AVX-512 build (16 floats a vector)
// was no faster on a Sapphire Rapids VM (MiniLM's 3,550 x 384 codes: 94-99 against 73-75 us a query in
// batches of 64, 126 against 137 alone), so there is none.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#include "distance.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 11  // arch=x86-64-v3: GCC 11
#include <immintrin.h>
#define FUSIONRAG_DOT_X86 1
#endif

// Vectors by value cross no call here (every helper is inlined into its target's dot_rows).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wpsabi"

namespace fusionrag {

#define FUSIONRAG_DOT_ISA 0
namespace dot_base {
#include "dot_kernel.inc"
}  // namespace dot_base
#undef FUSIONRAG_DOT_ISA

#ifdef FUSIONRAG_DOT_X86
#pragma GCC push_options
#pragma GCC target("arch=x86-64-v3")
#define FUSIONRAG_DOT_ISA 256
namespace dot_v3 {
#include "dot_kernel.inc"
}  // namespace dot_v3
#undef FUSIONRAG_DOT_ISA
#pragma GCC pop_options
#endif

namespace {

template <class T>
using DotRowsFn = void (*)(const float*, size_t, const T*, size_t, size_t, float*);

// FUSIONRAG_DOT_BASELINE=1 takes the baseline build on any CPU (its tests).
template <class T>
DotRowsFn<T> pick() {
  const char* baseline = std::getenv("FUSIONRAG_DOT_BASELINE");
  if (baseline && std::strcmp(baseline, "1") == 0) return dot_base::dot_rows<T>;
#ifdef FUSIONRAG_DOT_X86
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return dot_v3::dot_rows<T>;
#endif
  return dot_base::dot_rows<T>;
}

}  // namespace

void dot_rows(const float* q, size_t nq, const uint8_t* x, size_t n, size_t d, float* dots) {
  static const DotRowsFn<uint8_t> fn = pick<uint8_t>();
  fn(q, nq, x, n, d, dots);
}

void dot_rows(const float* q, size_t nq, const float* x, size_t n, size_t d, float* dots) {
  static const DotRowsFn<float> fn = pick<float>();
  fn(q, nq, x, n, d, dots);
}

}  // namespace fusionrag

#pragma GCC diagnostic pop
