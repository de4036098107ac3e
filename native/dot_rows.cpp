// dot_rows and idot_rows (distance.h): inner products of a block of queries with every row of a matrix of
// floats or bytes, blocked as a matrix product is. The navigation tier's exact search (graph.cpp exact_search)
// is their user: it reads the graph's SQ8 codes in place, with no decoded copy and no BLAS.
//
// The body (dot_kernel.inc) is built for the baseline (vectors of 8 floats as two SSE registers) and, where
// GCC targets x86-64, for AVX2 + FMA and for AVX2 with either VNNI (the integer kernel's byte products in one
// instruction); the best the CPU has is picked at run time. An AVX-512 float build (16 floats a vector) was no
// faster on a Sapphire Rapids VM (MiniLM's 3,550 x 384 codes: 94-99 against 73-75 us a query in batches of
// 64, 126 against 137 alone), so there is none.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
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
#define FUSIONRAG_DOT_ISA 256
#pragma GCC push_options
#pragma GCC target("arch=x86-64-v3")
#define FUSIONRAG_DOT_VNNI 0
namespace dot_v3 {
#include "dot_kernel.inc"
}  // namespace dot_v3
#undef FUSIONRAG_DOT_VNNI
#pragma GCC pop_options
// The integer kernel again with VNNI's one-instruction byte products: AVX-VNNI (Alder Lake, Sapphire Rapids,
// Zen 5) or AVX512-VNNI on 256-bit vectors (Cascade Lake, Ice Lake, Zen 4).
#pragma GCC push_options
#pragma GCC target("arch=x86-64-v3,avxvnni")
#define FUSIONRAG_DOT_VNNI 1
namespace dot_avxvnni {
#include "dot_kernel.inc"
}  // namespace dot_avxvnni
#undef FUSIONRAG_DOT_VNNI
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("arch=x86-64-v3,avx512vnni,avx512vl")
#define FUSIONRAG_DOT_VNNI 2
namespace dot_avx512vnni {
#include "dot_kernel.inc"
}  // namespace dot_avx512vnni
#undef FUSIONRAG_DOT_VNNI
#pragma GCC pop_options
#undef FUSIONRAG_DOT_ISA
#endif

namespace {

struct Kernels {
  const char* isa;
  void (*dot_u8)(const float*, size_t, const uint8_t*, size_t, size_t, float*);
  void (*dot_f32)(const float*, size_t, const float*, size_t, size_t, float*);
  void (*some_u8)(const float*, const uint8_t*, const uint32_t*, size_t, size_t, float*);
  void (*idot)(const int8_t*, size_t, const uint8_t*, size_t, size_t, int32_t*);
};

#define FUSIONRAG_KERNELS(name, ns) \
  Kernels { name, ns::dot_rows<uint8_t>, ns::dot_rows<float>, ns::dot_some<uint8_t>, ns::idot_rows }

// The best build this CPU runs; FUSIONRAG_DOT_ISA (baseline, avx2, avxvnni or avx512vnni) asks for one, for the
// tests, and gets it where the CPU has it (else the best it has).
Kernels pick() {
  const char* want = std::getenv("FUSIONRAG_DOT_ISA");
  const std::string asked = want ? want : "";
  if (asked == "baseline") return FUSIONRAG_KERNELS("baseline", dot_base);
#ifdef FUSIONRAG_DOT_X86
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
    const bool avxvnni = __builtin_cpu_supports("avxvnni");
    const bool avx512vnni = __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl");
    if (asked == "avx2") return FUSIONRAG_KERNELS("avx2", dot_v3);
    if (avxvnni && asked != "avx512vnni") return FUSIONRAG_KERNELS("avxvnni", dot_avxvnni);
    if (avx512vnni) return FUSIONRAG_KERNELS("avx512vnni", dot_avx512vnni);
    return FUSIONRAG_KERNELS("avx2", dot_v3);
  }
#endif
  return FUSIONRAG_KERNELS("baseline", dot_base);
}

const Kernels& kernels() {
  static const Kernels k = pick();
  return k;
}

}  // namespace

void dot_rows(const float* q, size_t nq, const uint8_t* x, size_t n, size_t d, float* dots) {
  kernels().dot_u8(q, nq, x, n, d, dots);
}

void dot_rows(const float* q, size_t nq, const float* x, size_t n, size_t d, float* dots) {
  kernels().dot_f32(q, nq, x, n, d, dots);
}

void dot_some(const float* q, const uint8_t* x, const uint32_t* rows, size_t count, size_t d, float* dots) {
  kernels().some_u8(q, x, rows, count, d, dots);
}

void idot_rows(const int8_t* q, size_t nq, const uint8_t* x, size_t n, size_t d, int32_t* dots) {
  kernels().idot(q, nq, x, n, d, dots);
}

const char* dot_isa() { return kernels().isa; }

}  // namespace fusionrag

#pragma GCC diagnostic pop
