#!/usr/bin/env bash
# A quick look at chunks on one GPU (emulated EP 8 over 100 GB/s, dropless, the peer's shape):
#     ROWS="fxoverlap:1 fxoverlap:2 backend:4 fxoverlap:2:4" OUT=$OUT bash scripts/gpu_chunks_quick.sh
# One process per row (mode:chunks[:microbatches]), run by scripts/gpu_rows.sh; scripts/emulated_table.py $OUT
# makes the table again.
set -u
PY=${PY:-python3}
OUT=${OUT:-bench_out/gpu_chunks}
ROWS=${ROWS:-"fxoverlap:1 fxoverlap:2 backend:2 fwd_fxoverlap:2"}
MBS=${MBS:-8}
LINK=${LINK:---link-gbps 100}
ROUTING=${ROUTING:-dropless}
EXTRA=${EXTRA:-}
# the rows as scripts/gpu_rows.sh takes them (one process per row, the same bench flags)
rows=""
for row in $ROWS; do
  IFS=: read -r mode c mbs <<< "$row"
  mbs=${mbs:-$MBS}
  rows+="ep8_${ROUTING}_mb${mbs}_${mode}_c${c}|$mode|$mbs|chunks=$c${EXTRA:+,$EXTRA}|--emulate-ep 8 $LINK --routing $ROUTING|;"
done
ROWS="$rows" OUT="$OUT" PY="$PY" INSTALL=${INSTALL:-0} BUDGET_S=${BUDGET_S:-100000} bash "$(dirname "$0")/gpu_rows.sh"
