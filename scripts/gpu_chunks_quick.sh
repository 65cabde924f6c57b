#!/usr/bin/env bash
# A quick look at chunks on one GPU (emulated EP 8 over 100 GB/s, dropless, the peer's shape):
#     ROWS="fxoverlap:1 fxoverlap:2 backend:4 fxoverlap:2:4" OUT=$OUT bash scripts/gpu_chunks_quick.sh
# One process per row (mode:chunks[:microbatches]); scripts/emulated_table.py $OUT makes the table.
set -u
PY=${PY:-python3}
OUT=${OUT:-bench_out/gpu_chunks}
ROWS=${ROWS:-"fxoverlap:1 fxoverlap:2 backend:2 fwd_fxoverlap:2"}
MBS=${MBS:-8}
LINK=${LINK:---link-gbps 100}
ROUTING=${ROUTING:-dropless}
EXTRA=${EXTRA:-}
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/fxoverlap_inductor_cache}
mkdir -p "$OUT"
for row in $ROWS; do
  IFS=: read -r mode c mbs <<< "$row"
  mbs=${mbs:-$MBS}
  name="ep8_${ROUTING}_mb${mbs}_${mode}_c${c}"
  timeout 150 torchrun --standalone --nproc-per-node 1 -m fxoverlap.bench --out "$OUT" --name "$name" \
    --emulate-ep 8 $LINK --routing "$ROUTING" --microbatches "$mbs" --modes "$mode" --warmup 1 --iters 3 \
    --no-stage-timing --no-grad-check --overlap-config "chunks=$c${EXTRA:+,$EXTRA}" >"$OUT/$name.log" 2>&1
  echo "$name rc=$? $(grep -A3 '^mode (emulated)' "$OUT/$name.log" | tail -1)"
done
