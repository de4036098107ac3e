// pq4_sums (scan4.h): a block of 32 candidates' 4-bit codes summed under a query's uint8 table.
//
// AVX2: each candidate's row is read 32 bytes at a time and the 32 rows x 32 bytes are transposed in registers
// (four rounds of unpacks within each 128-bit lane, then one lane exchange), so that a register holds one code
// byte of all 32 candidates; its low and high nibbles index the table rows of two sub-spaces in registers
// (pshufb), and the uint8 entries add into uint16 sums. Measured against gathering 4 bytes a candidate
// (vpgatherdd) and against a copy of each list's codes in blocks of 32: faster than both, and no extra memory
// (bench/results/peers/fastscan.md). The baseline: one candidate at a time, two table lookups a byte.
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>

#include "scan4.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define FUSIONRAG_SCAN4_X86 1
#endif

namespace fusionrag {
namespace {

void sums_baseline(const uint8_t* codes, size_t, size_t P, const uint32_t* ids, size_t count, const uint8_t* q8,
                   uint16_t* sums) {
  for (size_t v = 0; v < count; ++v) {
    const uint8_t* row = codes + size_t(ids[v]) * P;
    uint32_t s = 0;
    for (size_t b = 0; b < P; ++b)
      s += q8[2 * b * kCodebook4 + (row[b] & 15)] + q8[(2 * b + 1) * kCodebook4 + (row[b] >> 4)];
    sums[v] = uint16_t(s);
  }
}

#ifdef FUSIONRAG_SCAN4_X86
#pragma GCC push_options
#pragma GCC target("avx2")

// 16 rows of 32 bytes (a 16 x 16 byte matrix in each 128-bit lane) transposed in each lane.
__attribute__((always_inline)) inline void transpose16(__m256i* r) {
  __m256i t[16];
  for (int j = 0; j < 8; ++j)
    t[j] = _mm256_unpacklo_epi8(r[2 * j], r[2 * j + 1]), t[j + 8] = _mm256_unpackhi_epi8(r[2 * j], r[2 * j + 1]);
  for (int j = 0; j < 8; ++j)
    r[j] = _mm256_unpacklo_epi16(t[2 * j], t[2 * j + 1]), r[j + 8] = _mm256_unpackhi_epi16(t[2 * j], t[2 * j + 1]);
  for (int j = 0; j < 8; ++j)
    t[j] = _mm256_unpacklo_epi32(r[2 * j], r[2 * j + 1]), t[j + 8] = _mm256_unpackhi_epi32(r[2 * j], r[2 * j + 1]);
  for (int j = 0; j < 8; ++j)
    r[j] = _mm256_unpacklo_epi64(t[2 * j], t[2 * j + 1]), r[j + 8] = _mm256_unpackhi_epi64(t[2 * j], t[2 * j + 1]);
}

// 32 rows (a: 0-15, b: 16-31) of 32 bytes -> out[j]: byte column Layout::col[j] of every row, row Layout::row[p]
// at byte p.
__attribute__((always_inline)) inline void transpose32(__m256i* a, __m256i* b, __m256i* out) {
  transpose16(a);
  transpose16(b);
  for (int j = 0; j < 16; ++j)
    out[j] = _mm256_permute2x128_si256(a[j], b[j], 0x20), out[j + 16] = _mm256_permute2x128_si256(a[j], b[j], 0x31);
}

// Where transpose32 puts each row and column, found once by transposing labelled rows.
struct Layout {
  int col[32], row[32];
  Layout() {
    alignas(32) uint8_t in[32][32], got[32][32];
    __m256i a[16], b[16], out[32];
    for (int pass = 0; pass < 2; ++pass) {
      for (int v = 0; v < 32; ++v)
        for (int c = 0; c < 32; ++c) in[v][c] = uint8_t(pass ? c : v);
      for (int v = 0; v < 16; ++v)
        a[v] = _mm256_load_si256(reinterpret_cast<const __m256i*>(in[v])),
        b[v] = _mm256_load_si256(reinterpret_cast<const __m256i*>(in[v + 16]));
      transpose32(a, b, out);
      for (int j = 0; j < 32; ++j) _mm256_store_si256(reinterpret_cast<__m256i*>(got[j]), out[j]);
      for (int j = 0; j < 32; ++j) {
        if (pass)
          col[j] = got[j][0];
        else
          row[j] = got[0][j];
      }
    }
  }
};

// Byte column b of 32 candidates (sub-spaces 2b and 2b + 1) into the even and odd bytes' uint16 sums.
__attribute__((always_inline)) inline void add_column(__m256i col, const uint8_t* q8, size_t b, __m256i& even,
                                                      __m256i& odd) {
  const __m256i nibble = _mm256_set1_epi8(0x0f), low = _mm256_set1_epi16(0xff);
  __m256i t0 = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q8 + 2 * b * kCodebook4)));
  __m256i t1 =
      _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q8 + (2 * b + 1) * kCodebook4)));
  __m256i r0 = _mm256_shuffle_epi8(t0, _mm256_and_si256(col, nibble));
  __m256i r1 = _mm256_shuffle_epi8(t1, _mm256_and_si256(_mm256_srli_epi16(col, 4), nibble));
  even = _mm256_add_epi16(even, _mm256_add_epi16(_mm256_and_si256(r0, low), _mm256_and_si256(r1, low)));
  odd = _mm256_add_epi16(odd, _mm256_add_epi16(_mm256_srli_epi16(r0, 8), _mm256_srli_epi16(r1, 8)));
}

void sums_avx2(const uint8_t* codes, size_t N, size_t P, const uint32_t* ids, size_t count, const uint8_t* q8,
               uint16_t* sums) {
  static const Layout layout;
  const size_t bytes = N * P;
  for (size_t v0 = 0; v0 < count; v0 += kSumBlock) {
    const size_t in_block = std::min(kSumBlock, count - v0);
    size_t rows[kSumBlock];  // where each candidate's row starts
    for (size_t v = 0; v < kSumBlock; ++v) rows[v] = size_t(ids[v0 + (v < in_block ? v : 0)]) * P;
    // the next block's rows, fetched while this one is summed (a random row of a large array)
    for (size_t v = v0 + kSumBlock; v < std::min(count, v0 + 2 * kSumBlock); ++v)
      __builtin_prefetch(codes + size_t(ids[v]) * P);
    __m256i even = _mm256_setzero_si256(), odd = _mm256_setzero_si256();
    for (size_t h = 0; h < P; h += 32) {
      alignas(32) uint8_t tail[kSumBlock][32];  // a row whose 32 bytes would pass the array's end, copied
      __m256i a[16], b[16], cols[32];
      for (size_t v = 0; v < kSumBlock; ++v) {
        const size_t from = rows[v] + h;
        const uint8_t* at = codes + from;
        if (from + 32 > bytes) {
          std::memset(tail[v], 0, 32);
          std::memcpy(tail[v], at, bytes - from);
          at = tail[v];
        }
        __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at));
        if (v < 16)
          a[v] = x;
        else
          b[v - 16] = x;
      }
      transpose32(a, b, cols);
      for (size_t j = 0; j < 32; ++j) {
        size_t c = h + size_t(layout.col[j]);
        if (c < P) add_column(cols[j], q8, c, even, odd);
      }
    }
    alignas(32) uint16_t e[16], o[16];
    _mm256_store_si256(reinterpret_cast<__m256i*>(e), even);
    _mm256_store_si256(reinterpret_cast<__m256i*>(o), odd);
    for (size_t p = 0; p < kSumBlock; ++p) {
      size_t v = size_t(layout.row[p]);
      if (v < in_block) sums[v0 + v] = (p & 1) ? o[p / 2] : e[p / 2];
    }
  }
}

#pragma GCC pop_options
#endif

using SumsFn = void (*)(const uint8_t*, size_t, size_t, const uint32_t*, size_t, const uint8_t*, uint16_t*);

bool has_avx2() {
#ifdef FUSIONRAG_SCAN4_X86
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2");
#else
  return false;
#endif
}

struct Chosen {
  const char* isa;
  SumsFn fn;
};

Chosen pick() {
  const char* want = std::getenv("FUSIONRAG_SCAN4_ISA");
#ifdef FUSIONRAG_SCAN4_X86
  if (has_avx2() && !(want && std::string(want) == "baseline")) return {"avx2", sums_avx2};
#endif
  (void)want;
  return {"baseline", sums_baseline};
}

const Chosen& chosen() {
  static const Chosen c = pick();
  return c;
}

}  // namespace

void pq4_sums(const uint8_t* codes, size_t N, size_t P, const uint32_t* ids, size_t count, const uint8_t* q8,
              uint16_t* sums) {
  chosen().fn(codes, N, P, ids, count, q8, sums);
}

bool pq4_sums_isa(const char* isa, const uint8_t* codes, size_t N, size_t P, const uint32_t* ids, size_t count,
                  const uint8_t* q8, uint16_t* sums) {
  const std::string want = isa;
  if (want == "baseline") {
    sums_baseline(codes, N, P, ids, count, q8, sums);
    return true;
  }
#ifdef FUSIONRAG_SCAN4_X86
  if (want == "avx2" && has_avx2()) {
    sums_avx2(codes, N, P, ids, count, q8, sums);
    return true;
  }
#endif
  return false;
}

const char* pq4_isa() { return chosen().isa; }

}  // namespace fusionrag
