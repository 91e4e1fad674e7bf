// What every AMX kernel needs: the compile-time gate, the tile configuration operand and the process's permission.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__AVX512BW__) && \
    defined(__linux__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define PAGEDSERVE_AMX 1
#endif

namespace pagedserve_native {

#if defined(PAGEDSERVE_AMX)

// The LDTILECFG operand (palette 1).
struct alignas(64) TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// LDTILECFG of `config`. GCC's _tile_loadconfig tells the compiler it reads only the operand's first 8 bytes, so
// without the empty asm reading the whole struct the stores of rows and colsb may be dropped as dead (seen with
// GCC 12: the tiles stayed unconfigured and the first tile load raised SIGILL).
inline void load_tile_config(const TileConfig& config) {
  __asm__ volatile("" : : "m"(config));
  _tile_loadconfig(&config);
}

// Loads a configuration of 8 tiles, tile t with rows[t] rows of 64 bytes.
inline void configure_tile_rows(const uint8_t (&rows)[8]) {
  TileConfig config;
  std::memset(&config, 0, sizeof(config));
  config.palette_id = 1;
  for (int tile = 0; tile < 8; ++tile) {
    config.rows[tile] = rows[tile];
    config.colsb[tile] = 64;
  }
  load_tile_config(config);
}

#endif  // PAGEDSERVE_AMX

// True when this build has AMX-BF16 and Linux granted the process the tile state: Linux hands it out only to
// processes that ask (arch_prctl ARCH_REQ_XCOMP_PERM). Asked once per process (an inline function's static is
// shared by every source of the library).
inline bool is_amx_usable() {
#if defined(PAGEDSERVE_AMX)
  static const bool granted = [] {
    constexpr int kArchRequestPermission = 0x1023;
    constexpr int kTileDataFeature = 18;
    return syscall(SYS_arch_prctl, kArchRequestPermission, kTileDataFeature) == 0;
  }();
  return granted;
#else
  return false;
#endif
}

}  // namespace pagedserve_native
