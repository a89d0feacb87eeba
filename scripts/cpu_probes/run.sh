#!/bin/sh
# Probes of the CPU tile kernel (issue #15): the AMX variant (amx_tile.c, amx_parts.c, amx_micro.c), the VNNI kernel's
# instruction-mix bound (vnni_mix.c), float16 against float32 scales (scale_bytes.c), the read bandwidth (stream.c), a step's attention
# alone (attn_step.c). Builds them and
# prints their timings.
#   sh scripts/cpu_probes/run.sh [amx|mix|scales|stream|attn ...]   (default: all; amx needs a CPU with AMX-INT8,
#                                                         the others AVX-512 VNNI; gcc >= 12)
set -e
cd "$(dirname "$0")"
out=${TMPDIR:-/tmp}/lmserve-probes
parts=${*:-amx mix scales stream attn}
mkdir -p "$out"
cc=${CC:-gcc}
flags="-O3 -fopenmp -fno-trapping-math -ffp-contract=off -std=gnu11"
for part in $parts; do
  case $part in
    amx)
      $cc $flags amx_tile.c -o "$out/amx_tile" -lm
      $cc $flags amx_parts.c -o "$out/amx_parts" -lm
      $cc -O2 amx_micro.c -o "$out/amx_micro"
      echo "# AMX against VNNI: the 3072 x 576 int4 layer (Q4_1: mins), then int8 (Q8_0), one thread; int4 on two; time a call"
      OMP_NUM_THREADS=1 "$out/amx_tile" 3072 576 4 1 300
      OMP_NUM_THREADS=1 "$out/amx_tile" 3072 576 8 1 300
      OMP_NUM_THREADS=2 "$out/amx_tile" 3072 576 4 2 300
      echo "# the AMX variant's parts, one tile in L1"
      for rows in 4 8 16; do "$out/amx_parts" $rows; done
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
    stream)
      $cc $flags stream.c -o "$out/stream"
      echo "# read bandwidth: about the default model's tiles' size (96 MiB), then past the last-level cache (1 GiB)"
      for mb in 96 1024; do "$out/stream" 2 20 $mb; "$out/stream" 1 20 $mb; done ;;
    attn)
      $cc $flags attn_step.c -o "$out/attn_step" -lm
      echo "# a decode step's attention alone, 2 threads: 1 and 8 sequences of 100 and 500 keys"
      for b in 1 8; do for l in 100 500; do OMP_NUM_THREADS=2 "$out/attn_step" $b $l; done; done
      OMP_NUM_THREADS=2 "$out/attn_step" 8 100 2 ;;
    *) echo "unknown part $part (amx, mix, scales, stream, attn)" >&2; exit 2 ;;
  esac
done
