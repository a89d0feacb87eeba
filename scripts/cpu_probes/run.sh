#!/bin/sh
# Probes of the CPU tile kernel (issue #15): the AMX variant (amx_tile.c, amx_micro.c), the VNNI kernel's
# instruction-mix bound (vnni_mix.c), float16 against float32 scales (scale_bytes.c). Builds them and
# prints their timings.
#   sh scripts/cpu_probes/run.sh [amx|mix|scales ...]   (default: all; amx needs a CPU with AMX-INT8,
#                                                         the others AVX-512 VNNI; gcc >= 12)
set -e
cd "$(dirname "$0")"
out=${TMPDIR:-/tmp}/lmserve-probes
parts=${*:-amx mix scales}
mkdir -p "$out"
cc=${CC:-gcc}
flags="-O3 -fopenmp -fno-trapping-math -ffp-contract=off -std=gnu11"
for part in $parts; do
  case $part in
    amx)
      $cc $flags amx_tile.c -o "$out/amx_tile" -lm
      $cc -O2 amx_micro.c -o "$out/amx_micro"
      echo "# AMX against VNNI: one thread, the 3072 x 576 int4 layer (Q4_1: mins), then int8 (Q8_0); time a call"
      OMP_NUM_THREADS=1 "$out/amx_tile" 3072 576 4 1 500
      OMP_NUM_THREADS=1 "$out/amx_tile" 3072 576 8 1 500
      echo "# tile operations alone, 8 and 16 rows"
      "$out/amx_micro" 8
      "$out/amx_micro" 16 ;;
    mix)
      $cc -O3 vnni_mix.c -o "$out/vnni_mix"
      echo "# the VNNI kernel's instruction mix in registers (8 rows, a 32-column sub-block)"
      "$out/vnni_mix" ;;
    scales)
      $cc $flags scale_bytes.c -o "$out/scale_bytes" -lm
      echo "# the default model's 121 linears, 2 threads: float32 against float16 scales"
      OMP_NUM_THREADS=2 "$out/scale_bytes" 2 40 ;;
    *) echo "unknown part $part (amx, mix, scales)" >&2; exit 2 ;;
  esac
done
