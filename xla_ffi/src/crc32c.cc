// crc32c (Castagnoli, reflected polynomial 0x82F63B78), as used by iSCSI,
// ext4 and RocksDB. The SSE4.2 crc32 instruction when the CPU has it, else a
// table-driven slicing-by-8 implementation.
#include <cstdlib>
#include <cstring>

#include "engine.h"

#if defined(__x86_64__)
#include <nmmintrin.h>
#endif

namespace ssdtrain {
namespace {

struct Tables {
  uint32_t t[8][256];
  Tables() {
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c >> 1) ^ (0x82F63B78u & (0u - (c & 1u)));
      t[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; ++i)
      for (int s = 1; s < 8; ++s) t[s][i] = (t[s - 1][i] >> 8) ^ t[0][t[s - 1][i] & 0xFF];
  }
};

const Tables& T() {
  static const Tables tables;
  return tables;
}

uint32_t Software(uint32_t crc, const unsigned char* p, uint64_t len) {
  const Tables& tb = T();
  while (len && (reinterpret_cast<uintptr_t>(p) & 7)) {
    crc = (crc >> 8) ^ tb.t[0][(crc ^ *p++) & 0xFF];
    --len;
  }
  while (len >= 8) {
    uint64_t w;
    memcpy(&w, p, 8);  // little-endian hosts only (x86-64, aarch64)
    uint32_t lo = static_cast<uint32_t>(w) ^ crc, hi = static_cast<uint32_t>(w >> 32);
    crc = tb.t[7][lo & 0xFF] ^ tb.t[6][(lo >> 8) & 0xFF] ^ tb.t[5][(lo >> 16) & 0xFF] ^
          tb.t[4][lo >> 24] ^ tb.t[3][hi & 0xFF] ^ tb.t[2][(hi >> 8) & 0xFF] ^
          tb.t[1][(hi >> 16) & 0xFF] ^ tb.t[0][hi >> 24];
    p += 8;
    len -= 8;
  }
  while (len--) crc = (crc >> 8) ^ tb.t[0][(crc ^ *p++) & 0xFF];
  return crc;
}

#if defined(__x86_64__)
__attribute__((target("sse4.2"))) uint32_t Hardware(uint32_t crc, const unsigned char* p,
                                                    uint64_t len) {
  uint64_t c = crc;
  while (len && (reinterpret_cast<uintptr_t>(p) & 7)) {
    c = _mm_crc32_u8(static_cast<uint32_t>(c), *p++);
    --len;
  }
  while (len >= 8) {
    uint64_t w;
    memcpy(&w, p, 8);
    c = _mm_crc32_u64(c, w);
    p += 8;
    len -= 8;
  }
  while (len--) c = _mm_crc32_u8(static_cast<uint32_t>(c), *p++);
  return static_cast<uint32_t>(c);
}

bool HaveSse42() {
  static const bool have = __builtin_cpu_supports("sse4.2");
  return have;
}
#endif

}  // namespace

uint32_t Crc32c(uint32_t crc, const void* data, uint64_t len) {
  const unsigned char* p = static_cast<const unsigned char*>(data);
  crc = ~crc;
#if defined(__x86_64__)
  static const bool hw = HaveSse42() && !getenv("SSDTRAIN_CRC_SOFTWARE");
  if (hw) return ~Hardware(crc, p, len);
#endif
  return ~Software(crc, p, len);
}

}  // namespace ssdtrain
