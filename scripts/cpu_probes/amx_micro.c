/* Each AMX tile operation timed alone, tiles of M rows (amx_micro M), and what the AMX variant of the tile
 * kernel (amx_tile.c) pays around them.
 *
 * Session 32's version stored the sums into 64 slots at a 1 KB stride (at 8 rows 32 KB, all in half of
 * this CPU's 48 KB L1's sets, more lines than they hold; at 16 rows 64 KB, past L1) and put a TILESTORED
 * of 8 rows at ~10 ns; into a ring that stays in L1 it takes ~5 ns, for 8 rows as for 16 (the last two
 * lines show both). The costs that do decide (amx_parts.c): the tile operations of a 32-column block take
 * ~9-10 ns for 4 to 16 rows, and the float epilogue overlaps them little. */
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include "amx.h"
static double now(){struct timespec t; clock_gettime(CLOCK_MONOTONIC,&t); return t.tv_sec+t.tv_nsec*1e-9;}
#define RING 16 /* 16 slots of sums at a 1 KB stride: in L1 */
int8_t A[16*64*16] __attribute__((aligned(64))); uint8_t B[64*512] __attribute__((aligned(64))); int32_t C[64][256] __attribute__((aligned(64)));
#define N 1000000
__attribute__((target("amx-tile,amx-int8,avx512f"))) int main(int argc,char**argv){
  if (argc < 2) { fprintf(stderr, "usage: %s ROWS (1..16)\n", argv[0]); return 2; }
  if (!amx_init()) { fprintf(stderr, "no AMX tile state from the kernel\n"); return 1; }
  int M = atoi(argv[1]);
  if (M < 1 || M > 16) { fprintf(stderr, "ROWS must be 1..16\n"); return 2; }
  amx_config(M); /* tiles 0, 4: A (M x 32); 1, 5: B (8 x 64); 2, 3, 6, 7: sums (M x 64) */
  double t;
  const int R = RING - 1;
  printf("# %d rows\n", M);
  t=now(); for(int i=0;i<N;i+=2){ _tile_dpbsud(2,0,1); _tile_dpbsud(3,4,5);} t=now()-t; printf("dp only (2 chains): %.2f ns/op\n", t/N*1e9);
  t=now(); for(int i=0;i<N;i+=4){ _tile_dpbsud(2,0,1); _tile_dpbsud(3,4,5);_tile_dpbsud(6,0,1); _tile_dpbsud(7,4,5);} t=now()-t; printf("dp only (4 chains): %.2f ns/op\n", t/N*1e9);
  t=now(); for(int i=0;i<N;i+=2){ _tile_loadd(1,B+(i&63)*512,64); _tile_loadd(0,A,64); _tile_dpbsud(2,0,1); _tile_loadd(5,B+((i+1)&63)*512,64); _tile_loadd(4,A,64);_tile_dpbsud(3,4,5);} t=now()-t; printf("load+dp: %.2f ns/op\n", t/N*1e9);
  t=now(); for(int i=0;i<N;i+=2){ _tile_loadd(1,B+(i&63)*512,64); _tile_loadd(0,A,64); _tile_zero(2); _tile_dpbsud(2,0,1); _tile_stored(2,C[i&R],64); _tile_loadd(5,B+((i+1)&63)*512,64); _tile_loadd(4,A,64);_tile_zero(3); _tile_dpbsud(3,4,5); _tile_stored(3,C[(i+1)&R],64);} t=now()-t; printf("load+zero+dp+store: %.2f ns/op\n", t/N*1e9);
  t=now(); for(int i=0;i<N;i+=2){ _tile_zero(2); _tile_stored(2,C[i&R],64); _tile_zero(3); _tile_stored(3,C[(i+1)&R],64);} t=now()-t; printf("zero+store: %.2f ns/op\n", t/N*1e9);
  t=now(); for(int i=0;i<N;i+=2){ _tile_loadd(1,B+(i&63)*512,64); _tile_loadd(5,B+((i+1)&63)*512,64);} t=now()-t; printf("loadB: %.2f ns/op\n", t/N*1e9);
  __m512i s=_mm512_setzero_si512();
  t=now(); for(int i=0;i<N;i++){ _tile_zero(2); _tile_dpbsud(2,0,1); _tile_stored(2,C[i&R],64); for(int m=0;m<M;m++) s=_mm512_add_epi32(s,_mm512_load_si512(C[(i-8)&R]+16*m));} t=now()-t; printf("zero+dp+store+read8back: %.2f ns/op\n", t/N*1e9);
  t=now(); for(int i=0;i<N;i++){ for(int j=0;j<8;j++) _mm512_store_si512(B+(i&63)*512+64*j, s); _tile_loadd(1,B+((i-8)&63)*512,64);} t=now()-t; printf("store8+tileload(8 back): %.2f ns/op\n", t/N*1e9);
  t=now(); for(int i=0;i<N;i++){ for(int j=0;j<8;j++) _mm512_store_si512(B+(i&63)*512+64*j, s); _tile_loadd(1,B+(i&63)*512,64);} t=now()-t; printf("store8+tileload(the same bytes): %.2f ns/op\n", t/N*1e9);
  t=now(); for(int i=0;i<N;i+=2){ _tile_zero(2); _tile_zero(3);} t=now()-t; printf("zero only: %.2f ns/op\n", t/N*1e9);
  t=now(); for(int i=0;i<N;i+=2){ _tile_loadd(2,C[i&R],64); _tile_dpbsud(2,0,1); _tile_loadd(3,C[(i+1)&R],64); _tile_dpbsud(3,4,5);} t=now()-t; printf("loadC+dp: %.2f ns/op\n", t/N*1e9);
  t=now(); for(int i=0;i<N;i+=2){ _tile_stored(2,C[i&R],64); _tile_stored(3,C[(i+1)&R],64);} t=now()-t; printf("store only, a 16 KB ring (L1): %.2f ns/op\n", t/N*1e9);
  t=now(); for(int i=0;i<N;i+=2){ _tile_stored(2,C[i&63],64); _tile_stored(3,C[(i+1)&63],64);} t=now()-t; printf("store only, a 64 KB ring (past L1; session 32's): %.2f ns/op\n", t/N*1e9);
  _tile_release();
  printf("(checksum %d)\n", _mm512_reduce_add_epi32(s));
}
