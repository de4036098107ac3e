// 4-bit product quantization (#68 item 2): 16 centroids a sub-space, two sub-spaces a code byte (sub-space 2b in
// the low nibble of byte b, 2b + 1 in the high one), so a code of M sub-spaces is P = ceil(M / 2) bytes. A query's
// table is quantized to uint8 (an offset a sub-space, one scale) and a candidate's distance is the sum of its M
// entries in integers: at most 255 x 256, a uint16. scan4_kernel.cpp sums 32 candidates at a time with the table
// in registers (pshufb) where the CPU has AVX2, else one at a time (bench/results/peers/fastscan.md).
#pragma once
#include <cstddef>
#include <cstdint>

namespace fusionrag {

constexpr size_t kCodebook4 = 16;   // centroids a sub-space
constexpr size_t kMaxM4 = 256;      // sub-spaces at most: 255 x 256 fits a uint16
constexpr size_t kSumBlock = 32;    // candidates a SIMD pass sums

// The uint16 sums of the count candidates ids (rows of P bytes of codes, N rows; ids < N, unchecked) under the
// quantized table q8 (2P x 16 bytes: a row a sub-space, rows past M all zero) into sums[0, count).
void pq4_sums(const uint8_t* codes, size_t N, size_t P, const uint32_t* ids, size_t count, const uint8_t* q8,
              uint16_t* sums);
// The same with the scalar loop or the AVX2 one chosen by the caller ("baseline" or "avx2"; for the tests);
// false where this build or CPU has no such kernel.
bool pq4_sums_isa(const char* isa, const uint8_t* codes, size_t N, size_t P, const uint32_t* ids, size_t count,
                  const uint8_t* q8, uint16_t* sums);
// One query's M x 16 float table from its zero-padded sub-vectors (M x dsub) and the codebooks transposed to
// M x dsub x 16 (distance.cpp, beside pq_table): l2 (norms = ||c||^2, M x 16) or ip (norms null).
void pq4_table(const float* padded, const float* columns, const float* norms, size_t M, size_t dsub, float* lut);
// Which kernel pq4_sums runs: "avx2" or "baseline" (FUSIONRAG_SCAN4_ISA=baseline asks for the scalar one).
const char* pq4_isa();

}  // namespace fusionrag
