// Every distance the native core computes: the graph's (float and SQ8), the PQ
// tables and ADC of the CPU scan, the re-rank's exact ones on stored records.
// Smaller is always better: "l2" is the squared Euclidean distance, "ip" the
// negative inner product. The vector kernels are in distance.cpp, each built twice.
#pragma once
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>

namespace fusionrag {

// An x86-64-v3 (AVX2 + FMA) clone beside the baseline, picked at load time, so
// the wheel still runs on any x86-64 and builds unchanged elsewhere.
#if defined(__x86_64__) && defined(__GNUC__) && defined(__has_attribute)
#if __has_attribute(target_clones)
#define FUSIONRAG_SIMD_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#endif
#endif
#ifndef FUSIONRAG_SIMD_CLONES
#define FUSIONRAG_SIMD_CLONES
#endif

enum class Metric { L2, IP };

inline Metric parse_metric(const std::string& name) {
  if (name == "l2") return Metric::L2;
  if (name == "ip") return Metric::IP;
  throw std::invalid_argument("metric must be 'l2' or 'ip', not '" + name + "'");
}

inline const char* metric_name(Metric m) { return m == Metric::L2 ? "l2" : "ip"; }

// A float query against d elements of a vector: float (the graph, f32 records),
// uint8_t (u8 records, SQ8 codes) or int8_t (i8 records).
float l2_sqr(const float* q, const float* x, size_t d);
float l2_sqr(const float* q, const uint8_t* x, size_t d);
float l2_sqr(const float* q, const int8_t* x, size_t d);
float neg_ip(const float* q, const float* x, size_t d);
float neg_ip(const float* q, const uint8_t* x, size_t d);
float neg_ip(const float* q, const int8_t* x, size_t d);

using DistanceFn = float (*)(const float*, const float*, size_t);

inline DistanceFn distance_fn(Metric m) {
  return m == Metric::L2 ? static_cast<DistanceFn>(l2_sqr) : static_cast<DistanceFn>(neg_ip);
}

// The distance from a float query to a stored record of elements T, as bytes.
template <class T>
float record_l2(const float* q, const uint8_t* record, size_t d) {
  return l2_sqr(q, reinterpret_cast<const T*>(record), d);
}
template <class T>
float record_neg_ip(const float* q, const uint8_t* record, size_t d) {
  return neg_ip(q, reinterpret_cast<const T*>(record), d);
}
using RecordDistanceFn = float (*)(const float*, const uint8_t*, size_t);

template <class T>
RecordDistanceFn record_distance(Metric m) {
  return m == Metric::L2 ? record_l2<T> : record_neg_ip<T>;
}

// SQ8 l2 with per-dimension scales: sum (s_i (qc_i - c_i))^2, the query qc in
// code units. (SQ8 ip is neg_ip of the query scaled into code units.)
float sq8_l2(const float* qc, const float* s, const uint8_t* c, size_t d);

// Inner products of nq queries (rows of d floats) with n rows x of d elements: dots[r * n + j] = q_r . x_j.
// Blocked as a matrix product is (dot_rows.cpp): rows a chunk at a time (~256 KiB, in L2), queries four at a
// time (in L1) with two rows in registers, bytes widened to floats in registers.
void dot_rows(const float* q, size_t nq, const uint8_t* x, size_t n, size_t d, float* dots);
void dot_rows(const float* q, size_t nq, const float* x, size_t n, size_t d, float* dots);
// One query (d floats) with chosen rows: dots[j] = q . x_rows[j].
void dot_some(const float* q, const uint8_t* x, const uint32_t* rows, size_t count, size_t d, float* dots);
// Integer inner products of nq queries of signed 7-bit integers (|q_i| <= 63; rows of round_up(d, 32), zero
// past d) with n rows x of d bytes: dots[r * n + j] = q_r . x_j, exactly.
void idot_rows(const int8_t* q, size_t nq, const uint8_t* x, size_t n, size_t d, int32_t* dots);
constexpr size_t kIdotPad = 32;  // idot_rows' query rows are padded to a multiple of it
// Which build of the kernels this CPU runs: baseline, avx2, avxvnni or avx512vnni.
const char* dot_isa();
constexpr size_t kDotQueries = 8;  // exact_search's queries per task: a pass over the rows serves them all

// Product quantization: 256 centroids per sub-space, one uint8 code.
constexpr size_t kCodebook = 256;

// One query's M x 256 table from its zero-padded sub-vectors (M x dsub) and the
// codebooks transposed to M x dsub x 256: l2 (norms = ||c||^2, M x 256) or ip
// (norms null).
void pq_table(const float* padded, const float* columns, const float* norms, size_t M, size_t dsub, float* lut);

// Asymmetric distance: the sum of a code's M table entries. Several partial sums
// so that consecutive table lookups do not wait on one add chain.
inline float adc(const float* lut, const uint8_t* code, size_t M) {
  float s[4] = {0, 0, 0, 0};
  size_t m = 0;
  for (; m + 4 <= M; m += 4)
    for (size_t j = 0; j < 4; ++j) s[j] += lut[(m + j) * kCodebook + code[m + j]];
  for (; m < M; ++m) s[0] += lut[m * kCodebook + code[m]];
  return (s[0] + s[1]) + (s[2] + s[3]);
}

}  // namespace fusionrag
