/* What the AMX probes share (amx_tile.c, amx_parts.c, amx_micro.c): the tile configuration's layout, the
 * permission Linux wants before a process uses tiles, the AMX variant's tile operations for one 32-column
 * block, and the int4 unpack into a B tile's bytes. */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <unistd.h>
#include <sys/syscall.h>

#define TARGET_AMX __attribute__((target("avx512f,avx512bw,amx-tile,amx-int8")))
typedef struct { uint8_t palette, start; uint8_t r[14]; uint16_t colsb[16]; uint8_t rows[16]; } tilecfg_t;

/* Linux hands a process the tile state only when asked (ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) */
static inline int amx_init(void) { return syscall(SYS_arch_prctl, 0x1023, 18) == 0; }

/* The variant's tiles for mc rows of x: 0 and 4 x rows (mc x 32 int8); 1 and 5 a block's weights (8 x 64
 * bytes: 32 columns of 16 weight rows, 4 a dword); 2, 3, 6, 7 int32 sums (mc x 16), used in turn. */
TARGET_AMX static inline void amx_config(int mc) {
  tilecfg_t c;
  memset(&c, 0, sizeof c);
  c.palette = 1;
  for (int t = 0; t < 8; t++) c.rows[t] = mc, c.colsb[t] = 64;
  c.colsb[0] = c.colsb[4] = 32;
  c.rows[1] = c.rows[5] = 8;
  _tile_loadconfig(&c);
}

/* Block s's tile operations: x rows a (row stride lda) times the block's weights b (B-tile bytes), x signed
 * and weights unsigned, into sums tile s % 4, stored at c (mc rows of 64 bytes). Tiles are not renamed, so
 * consecutive blocks take other tiles. */
TARGET_AMX static inline __attribute__((always_inline)) void amx_block(int64_t s, const void *a, int64_t lda,
                                                                       const void *b, int32_t *c) {
#define AMX_STEP(A, B, C) _tile_loadd(B, b, 64); _tile_loadd(A, a, lda); _tile_zero(C); _tile_dpbsud(C, A, B); _tile_stored(C, c, 64);
  switch (s & 3) {
    case 0: AMX_STEP(0, 1, 2) break;
    case 1: AMX_STEP(4, 5, 3) break;
    case 2: AMX_STEP(0, 1, 6) break;
    default: AMX_STEP(4, 5, 7) break;
  }
#undef AMX_STEP
}

/* A 32-column block of int4 tiles (4 x 64 bytes, qtile.c's layout: the low nibbles of load j columns 8j ..
 * 8j + 3, the high ones 8j + 4 .. 8j + 7) as B-tile rows of bytes (8 x 64). */
TARGET_AMX static inline __attribute__((always_inline)) void unpack_int4_block(const uint8_t *w, uint8_t *dst) {
  const __m512i lo4 = _mm512_set1_epi8(15);
  for (int j = 0; j < 4; j++) {
    const __m512i v = _mm512_loadu_si512((const void *)(w + 64 * j));
    _mm512_store_si512((void *)(dst + 128 * j), _mm512_and_si512(v, lo4));
    _mm512_store_si512((void *)(dst + 128 * j + 64), _mm512_and_si512(_mm512_srli_epi16(v, 4), lo4));
  }
}
