// CRC32C (Castagnoli), the checksum of every page-file block. SSE4.2 has an
// instruction for it; elsewhere a slicing-by-8 table keeps verification well
// below the cost of the 4 KiB read it guards.
#pragma once
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__) || defined(__i386__)
#include <nmmintrin.h>
#define FUSIONRAG_CRC32C_X86 1
#endif

namespace fusionrag {

namespace crc32c_detail {

using Tables = std::array<std::array<uint32_t, 256>, 8>;

constexpr Tables make_tables() {
  Tables t{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c >> 1) ^ (0x82F63B78u & (0u - (c & 1)));
    t[0][i] = c;
  }
  for (size_t s = 1; s < 8; ++s)
    for (size_t i = 0; i < 256; ++i) t[s][i] = (t[s - 1][i] >> 8) ^ t[0][t[s - 1][i] & 0xFF];
  return t;
}

inline constexpr Tables kTables = make_tables();

inline uint32_t software(uint32_t crc, const uint8_t* p, size_t n) {
  const auto& t = kTables;
  for (; n >= 8; n -= 8, p += 8) {
    uint64_t w;
    std::memcpy(&w, p, 8);  // little-endian load, as slicing-by-8 assumes
    w ^= crc;
    crc = t[7][w & 0xFF] ^ t[6][(w >> 8) & 0xFF] ^ t[5][(w >> 16) & 0xFF] ^ t[4][(w >> 24) & 0xFF] ^
          t[3][(w >> 32) & 0xFF] ^ t[2][(w >> 40) & 0xFF] ^ t[1][(w >> 48) & 0xFF] ^ t[0][w >> 56];
  }
  for (; n; --n, ++p) crc = (crc >> 8) ^ t[0][(crc ^ *p) & 0xFF];
  return crc;
}

#ifdef FUSIONRAG_CRC32C_X86
__attribute__((target("sse4.2"))) inline uint32_t hardware(uint32_t crc, const uint8_t* p, size_t n) {
#ifdef __x86_64__
  uint64_t c = crc;
  for (; n >= 8; n -= 8, p += 8) {
    uint64_t w;
    std::memcpy(&w, p, 8);
    c = _mm_crc32_u64(c, w);
  }
  crc = static_cast<uint32_t>(c);
#endif
  for (; n; --n, ++p) crc = _mm_crc32_u8(crc, *p);
  return crc;
}

inline bool has_hardware() {
  static const bool yes = __builtin_cpu_supports("sse4.2");
  return yes;
}
#endif

}  // namespace crc32c_detail

// The standard CRC32C: crc32c("123456789") == 0xE3069283.
inline uint32_t crc32c(const void* data, size_t n, bool force_software = false) {
  auto p = static_cast<const uint8_t*>(data);
#ifdef FUSIONRAG_CRC32C_X86
  if (!force_software && crc32c_detail::has_hardware()) return ~crc32c_detail::hardware(~0u, p, n);
#else
  (void)force_software;
#endif
  return ~crc32c_detail::software(~0u, p, n);
}

}  // namespace fusionrag
