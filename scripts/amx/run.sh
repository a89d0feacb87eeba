#!/bin/sh
# The AMX probe of issue #15 (see amx_tile.c) and the VNNI kernel's instruction-mix bound (vnni_mix.c):
# builds the three programs and prints their timings.
#   sh scripts/amx/run.sh            (needs gcc >= 11 and a CPU with AMX-INT8)
set -e
cd "$(dirname "$0")"
out=${TMPDIR:-/tmp}/lmserve-amx
mkdir -p "$out"
cc=${CC:-gcc}
$cc -O3 -fopenmp -fno-trapping-math -ffp-contract=off -std=gnu11 amx_tile.c -o "$out/amx_tile" -lm
$cc -O2 amx_micro.c -o "$out/amx_micro"
$cc -O3 vnni_mix.c -o "$out/vnni_mix"
echo "# one thread, the 3072 x 576 int4 layer (Q4_1: mins), then int8 (Q8_0); time per call"
OMP_NUM_THREADS=1 "$out/amx_tile" 3072 576 4 1 500
OMP_NUM_THREADS=1 "$out/amx_tile" 3072 576 8 1 500
echo "# the VNNI kernel's instruction mix in registers (8 rows, a 32-column sub-block)"
"$out/vnni_mix"
echo "# tile operations alone, 8 and 16 rows"
"$out/amx_micro" 8
"$out/amx_micro" 16
