// #68 item 2's study: the scan of a query's candidates by 8-bit PQ with float tables (the
// engine's native/scan.cpp scan_query) against 4-bit PQ with 8-bit tables looked up in registers (pshufb, as
// Faiss's IVFPQFastScan), on the data bench/peers/fastscan.py writes to DIR. Not part of the engine: built and
// run by that script (g++ -O3 -march=x86-64-v3).
//
// Each variant does, per query, what the engine's scan does after navigation: the probed lists' ids de-duplicated
// (a seen-bitmap), every candidate scored, the n best kept (nth_element + sort of (distance, id) keys):
//   pq8       8-bit codes by id (N x M bytes), the query's float table M x 256 (the engine's adc()).
//   pq4-rows  4-bit codes by id (N x P bytes, P = M4 / 2, two sub-spaces a byte), the table M4 x 16 quantized to
//             uint8 (one scale, an offset a sub-space; built here per query from the float table), sums in uint16.
//             32 candidates at a time: each one's row read 32 bytes at a time, the 32 x 32 bytes transposed in
//             registers (unpacks), then scanned column by column (pshufb); the next 32 rows are prefetched while a
//             block is scanned. Same memory as pq8 at M4 = 2M: no copy of a code per list.
//   pq4       the same, the block's codes gathered 4 bytes a candidate (vpgatherdd) and transposed in registers
//             (a pshufb and 8 unpacks per 4 bytes).
//   pq4-scalar  the same block transposed by scalar copies (the reference both SIMD ones must equal).
//   pq4-lists   4-bit codes copied per posting list in blocks of 32 (each list's replicas and padding cost
//             memory), scanned with no de-duplication before scoring (duplicates dropped among the best).
//   select    de-duplication, the table's quantization and the selection alone (ids as keys): the floor.
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace {

constexpr size_t K8 = 256, K4 = 16, kBlock = 32;

std::string dir;

std::vector<char> read_file(const char* name) {
  std::string p = dir + "/" + name;
  FILE* f = std::fopen(p.c_str(), "rb");
  if (!f) {
    std::fprintf(stderr, "cannot open %s\n", p.c_str());
    std::exit(2);
  }
  std::fseek(f, 0, SEEK_END);
  long size = std::ftell(f);
  std::fseek(f, 0, SEEK_SET);
  std::vector<char> b(size + 64);  // slack: a gather of the last row's last 4 bytes stays inside
  if (std::fread(b.data(), 1, size, f) != size_t(size)) std::exit(2);
  std::fclose(f);
  return b;
}

float adc(const float* lut, const uint8_t* code, size_t M) {
  float s[4] = {0, 0, 0, 0};
  size_t m = 0;
  for (; m + 4 <= M; m += 4)
    for (size_t j = 0; j < 4; ++j) s[j] += lut[(m + j) * K8 + code[m + j]];
  for (; m < M; ++m) s[0] += lut[m * K8 + code[m]];
  return (s[0] + s[1]) + (s[2] + s[3]);
}

uint64_t float_key(float d, uint32_t id) {
  uint32_t u;
  d += 0.0f;
  std::memcpy(&u, &d, 4);
  u = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
  return (uint64_t(u) << 32) | id;
}

// The float table M4 x 16 as uint8: (entry - the sub-space's least) / scale, scale = the widest sub-space's / 255.
void quantize(const float* lut, size_t M4, uint8_t* q8) {
  float mins[4096], widest = 0;
  for (size_t m = 0; m < M4; ++m) {
    const float* r = lut + m * K4;
    float lo = r[0], hi = r[0];
    for (size_t k = 1; k < K4; ++k) lo = std::min(lo, r[k]), hi = std::max(hi, r[k]);
    mins[m] = lo;
    widest = std::max(widest, hi - lo);
  }
  float inv = widest > 0 ? 255.0f / widest : 0.0f;
  for (size_t m = 0; m < M4; ++m)
    for (size_t k = 0; k < K4; ++k) q8[m * K4 + k] = uint8_t(int((lut[m * K4 + k] - mins[m]) * inv + 0.5f));
}

// Accumulates byte column b (32 candidates' byte b: sub-spaces 2b low nibble, 2b + 1 high) into the even and odd
// bytes' uint16 sums.
inline void scan_column(__m256i col, const uint8_t* q8, size_t b, __m256i& even, __m256i& odd) {
  const __m256i nib = _mm256_set1_epi8(0x0f), low = _mm256_set1_epi16(0xff);
  __m256i t0 = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q8 + 2 * b * K4)));
  __m256i t1 = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q8 + (2 * b + 1) * K4)));
  __m256i r0 = _mm256_shuffle_epi8(t0, _mm256_and_si256(col, nib));
  __m256i r1 = _mm256_shuffle_epi8(t1, _mm256_and_si256(_mm256_srli_epi16(col, 4), nib));
  even = _mm256_add_epi16(even, _mm256_add_epi16(_mm256_and_si256(r0, low), _mm256_and_si256(r1, low)));
  odd = _mm256_add_epi16(odd, _mm256_add_epi16(_mm256_srli_epi16(r0, 8), _mm256_srli_epi16(r1, 8)));
}

// A block laid out by column (byte b of candidate v at b * 32 + v): 32 uint16 sums in candidate order.
void scan_columns(const uint8_t* cols, size_t P, const uint8_t* q8, uint16_t* out) {
  __m256i even = _mm256_setzero_si256(), odd = _mm256_setzero_si256();
  for (size_t b = 0; b < P; ++b)
    scan_column(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(cols + b * kBlock)), q8, b, even, odd);
  alignas(32) uint16_t e[16], o[16];
  _mm256_store_si256(reinterpret_cast<__m256i*>(e), even);
  _mm256_store_si256(reinterpret_cast<__m256i*>(o), odd);
  for (size_t j = 0; j < 16; ++j) out[2 * j] = e[j], out[2 * j + 1] = o[j];
}

// Up to 32 candidates' codes by id (rows of P bytes, P % 4 == 0), gathered 4 bytes at a time and transposed in
// registers. After the per-lane pshufb and the unpacks, byte p of column register t holds candidate
// 8 (p % 16 / 4) + 4 (p / 16) + p % 4.
void scan_gathered(const uint8_t* codes, size_t P, const uint32_t* ids, size_t count, const uint8_t* q8,
                   uint16_t* out) {
  alignas(32) int32_t at[kBlock];
  for (size_t v = 0; v < kBlock; ++v) at[v] = int32_t(ids[v < count ? v : 0] * P);
  __m256i i0 = _mm256_load_si256(reinterpret_cast<const __m256i*>(at)),
          i1 = _mm256_load_si256(reinterpret_cast<const __m256i*>(at + 8)),
          i2 = _mm256_load_si256(reinterpret_cast<const __m256i*>(at + 16)),
          i3 = _mm256_load_si256(reinterpret_cast<const __m256i*>(at + 24));
  const __m256i by_byte = _mm256_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15,
                                           0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  __m256i even = _mm256_setzero_si256(), odd = _mm256_setzero_si256();
  for (size_t c = 0; c < P; c += 4) {
    const int* base = reinterpret_cast<const int*>(codes + c);
    __m256i g0 = _mm256_shuffle_epi8(_mm256_i32gather_epi32(base, i0, 1), by_byte);
    __m256i g1 = _mm256_shuffle_epi8(_mm256_i32gather_epi32(base, i1, 1), by_byte);
    __m256i g2 = _mm256_shuffle_epi8(_mm256_i32gather_epi32(base, i2, 1), by_byte);
    __m256i g3 = _mm256_shuffle_epi8(_mm256_i32gather_epi32(base, i3, 1), by_byte);
    __m256i a = _mm256_unpacklo_epi32(g0, g1), b = _mm256_unpackhi_epi32(g0, g1);
    __m256i e = _mm256_unpacklo_epi32(g2, g3), d = _mm256_unpackhi_epi32(g2, g3);
    scan_column(_mm256_unpacklo_epi64(a, e), q8, c, even, odd);
    scan_column(_mm256_unpackhi_epi64(a, e), q8, c + 1, even, odd);
    scan_column(_mm256_unpacklo_epi64(b, d), q8, c + 2, even, odd);
    scan_column(_mm256_unpackhi_epi64(b, d), q8, c + 3, even, odd);
  }
  alignas(32) uint16_t ev[16], od[16];
  _mm256_store_si256(reinterpret_cast<__m256i*>(ev), even);
  _mm256_store_si256(reinterpret_cast<__m256i*>(od), odd);
  for (size_t p = 0; p < kBlock; ++p) out[8 * (p % 16 / 4) + 4 * (p / 16) + p % 4] = (p & 1) ? od[p / 2] : ev[p / 2];
}

// 16 rows of 32 bytes (two 16 x 16 byte matrices, one a 128-bit lane) transposed in each lane by four rounds of
// unpacks: r[j]'s lane 0 then holds one byte column of the 16 rows, its lane 1 the column 16 further on (in an
// order of rows and columns fixed by the unpacks, found once by Layout below).
inline void transpose16(__m256i* r) {
  __m256i t[16];
  for (int j = 0; j < 8; ++j) t[j] = _mm256_unpacklo_epi8(r[2 * j], r[2 * j + 1]),
                              t[j + 8] = _mm256_unpackhi_epi8(r[2 * j], r[2 * j + 1]);
  for (int j = 0; j < 8; ++j) r[j] = _mm256_unpacklo_epi16(t[2 * j], t[2 * j + 1]),
                              r[j + 8] = _mm256_unpackhi_epi16(t[2 * j], t[2 * j + 1]);
  for (int j = 0; j < 8; ++j) t[j] = _mm256_unpacklo_epi32(r[2 * j], r[2 * j + 1]),
                              t[j + 8] = _mm256_unpackhi_epi32(r[2 * j], r[2 * j + 1]);
  for (int j = 0; j < 8; ++j) r[j] = _mm256_unpacklo_epi64(t[2 * j], t[2 * j + 1]),
                              r[j + 8] = _mm256_unpackhi_epi64(t[2 * j], t[2 * j + 1]);
}

// 32 rows of 32 bytes -> 32 column registers: out[j] holds byte column col[j] of all 32 rows, row row[p] at byte p.
inline void transpose32(__m256i* a, __m256i* b, __m256i* out) {
  transpose16(a);
  transpose16(b);
  for (int j = 0; j < 16; ++j) out[j] = _mm256_permute2x128_si256(a[j], b[j], 0x20),
                               out[j + 16] = _mm256_permute2x128_si256(a[j], b[j], 0x31);
}

// Where transpose32 puts each row and column: found by transposing labelled rows.
struct Layout {
  int col[32], row[32];
  Layout() {
    alignas(32) uint8_t in[32][32], got[32][32];
    __m256i a[16], b[16], out[32];
    for (int pass = 0; pass < 2; ++pass) {
      for (int v = 0; v < 32; ++v)
        for (int c = 0; c < 32; ++c) in[v][c] = uint8_t(pass ? c : v);
      for (int v = 0; v < 16; ++v) a[v] = _mm256_load_si256(reinterpret_cast<const __m256i*>(in[v])),
                                   b[v] = _mm256_load_si256(reinterpret_cast<const __m256i*>(in[v + 16]));
      transpose32(a, b, out);
      for (int j = 0; j < 32; ++j) _mm256_store_si256(reinterpret_cast<__m256i*>(got[j]), out[j]);
      for (int j = 0; j < 32; ++j) (pass ? col[j] : row[j]) = got[pass ? j : 0][pass ? 0 : j];
    }
  }
};

// Up to 32 candidates' codes by id (rows of P bytes), each row read 32 bytes at a time and the block transposed
// in registers (no gathers); columns past P are skipped. The caller's array has 32 bytes of slack past its end.
void scan_rows(const uint8_t* codes, size_t P, const uint32_t* ids, size_t count, const uint8_t* q8,
               uint16_t* out) {
  static const Layout layout;
  const uint8_t* rows[kBlock];
  for (size_t v = 0; v < kBlock; ++v) rows[v] = codes + size_t(ids[v < count ? v : 0]) * P;
  __m256i even = _mm256_setzero_si256(), odd = _mm256_setzero_si256();
  for (size_t h = 0; h < P; h += 32) {
    __m256i a[16], b[16], cols[32];
    for (size_t v = 0; v < 16; ++v) a[v] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows[v] + h)),
                                    b[v] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows[v + 16] + h));
    transpose32(a, b, cols);
    for (size_t j = 0; j < 32; ++j) {
      size_t c = h + size_t(layout.col[j]);
      if (c < P) scan_column(cols[j], q8, c, even, odd);
    }
  }
  alignas(32) uint16_t ev[16], od[16];
  _mm256_store_si256(reinterpret_cast<__m256i*>(ev), even);
  _mm256_store_si256(reinterpret_cast<__m256i*>(od), odd);
  for (size_t p = 0; p < kBlock; ++p) out[layout.row[p]] = (p & 1) ? od[p / 2] : ev[p / 2];
}

using Clock = std::chrono::steady_clock;

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: fastscan_kernels DIR N [REPEATS]\n");
    return 2;
  }
  dir = argv[1];
  const size_t n = size_t(std::atol(argv[2])), repeats = argc > 3 ? size_t(std::atol(argv[3])) : 9;
  size_t N, M8, M4, Q, C, T;
  {
    FILE* f = std::fopen((dir + "/shape.txt").c_str(), "r");
    if (!f || std::fscanf(f, "%zu %zu %zu %zu %zu %zu", &N, &M8, &M4, &Q, &C, &T) != 6) return 2;
    std::fclose(f);
  }
  const size_t P = M4 / 2;
  if (M4 % 8) {
    std::fprintf(stderr, "M4 must be a multiple of 8 (rows of a multiple of 4 bytes)\n");
    return 2;
  }
  auto c8b = read_file("codes8.bin"), c4b = read_file("codes4.bin"), l8b = read_file("luts8.bin"),
       l4b = read_file("luts4.bin"), nlb = read_file("nlists.bin"), lsb = read_file("lists.bin"),
       ofb = read_file("offsets.bin"), lib = read_file("list_ids.bin");
  auto c8 = reinterpret_cast<const uint8_t*>(c8b.data()), c4 = reinterpret_cast<const uint8_t*>(c4b.data());
  auto l8 = reinterpret_cast<const float*>(l8b.data()), l4 = reinterpret_cast<const float*>(l4b.data());
  auto nl = reinterpret_cast<const int64_t*>(nlb.data()), off = reinterpret_cast<const int64_t*>(ofb.data());
  auto ls = reinterpret_cast<const int32_t*>(lsb.data());
  auto lid = reinterpret_cast<const uint32_t*>(lib.data());
  std::vector<size_t> first(Q + 1, 0);
  for (size_t i = 0; i < Q; ++i) first[i + 1] = first[i] + size_t(nl[i]);

  // pq4-lists' layout: each list's codes in blocks of 32, by column
  std::vector<int64_t> boff(C + 1, 0);
  for (size_t c = 0; c < C; ++c) boff[c + 1] = boff[c] + (off[c + 1] - off[c] + 31) / 32;
  std::vector<uint8_t> blocks(size_t(boff[C]) * P * kBlock, 0);
  for (size_t c = 0; c < C; ++c)
    for (int64_t p = off[c]; p < off[c + 1]; ++p) {
      size_t r = size_t(p - off[c]), blk = size_t(boff[c]) + r / kBlock, v = r % kBlock;
      for (size_t b = 0; b < P; ++b) blocks[(blk * P + b) * kBlock + v] = c4[size_t(lid[p]) * P + b];
    }

  const char* names[] = {"pq8", "pq4", "pq4-scalar", "pq4-lists", "select", "pq4-rows"};
  constexpr size_t kVariants = 6;
  std::vector<uint64_t> seen((N + 63) / 64, 0);
  std::vector<uint32_t> unique;
  std::vector<uint64_t> keys;
  std::vector<uint8_t> q8(M4 * K4), cols(P * kBlock);
  uint16_t sums[kBlock];
  std::vector<std::vector<uint32_t>> best(kVariants, std::vector<uint32_t>(Q * n));
  std::vector<double> fastest(kVariants, 1e30);
  double gathered = 0, uniques = 0;
  for (size_t rep = 0; rep < repeats; ++rep)
    for (size_t v = 0; v < kVariants; ++v) {
      auto start = Clock::now();
      for (size_t i = 0; i < Q; ++i) {
        unique.clear();
        keys.clear();
        if (v != 3) {  // the probed lists' ids, de-duplicated
          for (size_t j = first[i]; j < first[i + 1]; ++j)
            for (int64_t p = off[ls[j]]; p < off[ls[j] + 1]; ++p) {
              uint32_t id = lid[p];
              uint64_t& word = seen[id >> 6];
              uint64_t bit = uint64_t(1) << (id & 63);
              if (word & bit) continue;
              word |= bit;
              unique.push_back(id);
            }
          for (uint32_t id : unique) seen[id >> 6] = 0;
          if (rep == 0 && v == 0) {
            uniques += double(unique.size());
            for (size_t j = first[i]; j < first[i + 1]; ++j) gathered += double(off[ls[j] + 1] - off[ls[j]]);
          }
        }
        const size_t u = unique.size();
        if (v == 0) {
          const float* lut = l8 + i * M8 * K8;
          keys.resize(u);
          for (size_t j = 0; j < u; ++j) {
            if (j + 16 < u) __builtin_prefetch(c8 + size_t(unique[j + 16]) * M8);
            keys[j] = float_key(adc(lut, c8 + size_t(unique[j]) * M8, M8), unique[j]);
          }
        } else {
          quantize(l4 + i * M4 * K4, M4, q8.data());
          if (v == 1 || v == 2 || v == 5) {
            keys.resize(u);
            for (size_t j0 = 0; j0 < u; j0 += kBlock) {
              size_t count = std::min(kBlock, u - j0);
              if (v == 5) {
                for (size_t w = j0 + kBlock; w < std::min(u, j0 + 2 * kBlock); ++w)
                  __builtin_prefetch(c4 + size_t(unique[w]) * P);
                scan_rows(c4, P, &unique[j0], count, q8.data(), sums);
              } else if (v == 1) {
                // the next block's rows, fetched while this one is scanned (a random row of a large array)
                for (size_t w = j0 + kBlock; w < std::min(u, j0 + 2 * kBlock); ++w)
                  __builtin_prefetch(c4 + size_t(unique[w]) * P);
                scan_gathered(c4, P, &unique[j0], count, q8.data(), sums);
              } else {
                for (size_t w = 0; w < count; ++w)
                  for (size_t b = 0; b < P; ++b) cols[b * kBlock + w] = c4[size_t(unique[j0 + w]) * P + b];
                scan_columns(cols.data(), P, q8.data(), sums);
              }
              for (size_t w = 0; w < count; ++w) keys[j0 + w] = (uint64_t(sums[w]) << 32) | unique[j0 + w];
            }
          } else if (v == 3) {
            for (size_t j = first[i]; j < first[i + 1]; ++j) {
              int32_t c = ls[j];
              size_t len = size_t(off[c + 1] - off[c]);
              for (int64_t blk = boff[c]; blk < boff[c + 1]; ++blk) {
                scan_columns(&blocks[size_t(blk) * P * kBlock], P, q8.data(), sums);
                size_t r0 = size_t(blk - boff[c]) * kBlock;
                for (size_t w = 0; w < kBlock && r0 + w < len; ++w)
                  keys.push_back((uint64_t(sums[w]) << 32) | lid[off[c] + r0 + w]);
              }
            }
          } else {
            keys.resize(u);
            for (size_t j = 0; j < u; ++j) keys[j] = (uint64_t(unique[j] * 2654435761u) << 32) | unique[j];
          }
        }
        // the n best; pq4-lists keeps 3n (duplicates among them) and drops repeated ids
        size_t keep = std::min(v == 3 ? 3 * n : n, keys.size());
        std::nth_element(keys.begin(), keys.begin() + keep, keys.end());
        std::sort(keys.begin(), keys.begin() + keep);
        if (v == 3) keys.erase(std::unique(keys.begin(), keys.begin() + keep), keys.begin() + keep);
        for (size_t j = 0; j < n; ++j) best[v][i * n + j] = j < keys.size() ? uint32_t(keys[j]) : ~0u;
      }
      double us = std::chrono::duration<double>(Clock::now() - start).count() / double(Q) * 1e6;
      fastest[v] = std::min(fastest[v], us);
    }
  auto same = [&](size_t a, size_t b) {
    size_t s = 0;
    for (size_t j = 0; j < Q * n; ++j) s += best[a][j] == best[b][j];
    return double(s) / double(Q * n);
  };
  std::printf("{\"n\": %zu, \"queries\": %zu, \"gathered\": %.1f, \"unique\": %.1f, \"us\": {", n, Q, gathered / Q,
              uniques / Q);
  for (size_t v = 0; v < kVariants; ++v) std::printf("%s\"%s\": %.2f", v ? ", " : "", names[v], fastest[v]);
  std::printf("}, \"pq4_equals_scalar\": %.4f, \"rows_equal_scalar\": %.4f, \"pq4_equals_lists\": %.4f, "
              "\"list_block_bytes\": %zu, "
              "\"pq4_bytes\": %zu, \"pq8_bytes\": %zu}\n",
              same(1, 2), same(5, 2), same(1, 3), blocks.size(), N * P, N * M8);
  return 0;
}
