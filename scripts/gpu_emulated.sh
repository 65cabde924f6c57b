#!/usr/bin/env bash
# The emulated-EP table on ONE GPU: one EP-N rank's work at the Megatron peer's shape, every
# dispatch/combine holding its stream as the emulated link would (fxoverlap/kernels/emulated_link.py).
#
#     OUT=$OUT bash scripts/gpu_emulated.sh                 # the default table, ~8 min of one H200
#     TIERS="1 2 3" BUDGET_S=1500 OUT=$OUT bash scripts/gpu_emulated.sh   # more of it
#
# One process per (configuration, mode), as gpu_one.sh runs one per routing: modes never share
# a process (no compile caches, allocator pools or CUDA graphs of another mode). Each process
# times its mode twice, without the link (T_compute) and with it (T_step, T_comm), under `timeout`.
# Rows, in order (a later row is skipped once BUDGET_S would be passed; the log says which):
#   check:  scripts/gpu_emulated_check.py (the hold kernel's duration alone and beside GEMMs)
#   tier 1: dropless, 8 microbatches, EP 2/4/8 over NVLink and EP 16/32 over 400 Gb/s IB:
#           compile and fxoverlap; at EP 8 also eager, backend and the forward-only modes
#   tier 2: capacity, 8 microbatches, the same EPs: compile and fxoverlap
#   tier 3: dropless and capacity, 4 microbatches, the same EPs: compile and fxoverlap
#   tier 4: chunks at EP 8, 100 GB/s, dropless, 8 microbatches: compile; fxoverlap, backend and the
#           forward-only modes with chunks 1, 2, 4
#   tier 5: chunks at 4 microbatches, capacity routing, 300 GB/s and no link
# Then scripts/emulated_table.py writes $OUT/emulated_table.md. Logs and JSON go to $OUT.
set -u
set -o pipefail
export PYTHONUNBUFFERED=1
PY=${PY:-python3}
OUT=${OUT:-bench_out/gpu_emulated}
TIERS=${TIERS:-"1 2"}
BUDGET_S=${BUDGET_S:-480}
ITERS=${ITERS:-3}
WARMUP=${WARMUP:-1}
STEP_TIMEOUT=${STEP_TIMEOUT:-150}
EST_S=${EST_S:-30}          # a process's expected time: a row starts only if it fits in BUDGET_S
SKEW=${SKEW:-1.0}
EXTRA=${EXTRA:-}           # more bench flags for every row, e.g. "--overlap-config dispatcher=padded"
INSTALL=${INSTALL:-1}
DRY=${DRY:-0}              # 1: print the commands only
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/fxoverlap_inductor_cache}
# shellcheck source=scripts/gpu_lib.sh
source "$(dirname "$0")/gpu_lib.sh"
gpu_setup gpu_emulated
say "step check"
[ "$DRY" = 1 ] || timeout 120 $PY scripts/gpu_emulated_check.py --out "$OUT/emucheck.jsonl" >"$OUT/emucheck.log" 2>&1 || say "check failed (rc $?)"
grep "^EMUCHECK" "$OUT/emucheck.log" | cut -c1-300 | tee -a "$LOG"

one() {  # ep link routing microbatches mode [chunks]   (link: a preset, or gbpsN for --link-gbps N)
  local ep=$1 link=$2 routing=$3 mbs=$4 mode=$5 chunks=${6:-}
  local name="ep${ep}_${link}_${routing}_mb${mbs}_${mode}${chunks:+_c$chunks}"
  local linkflag="--link $link"
  case $link in gbps*) linkflag="--link-gbps ${link#gbps}" ;; esac
  local cflag=""
  [ -n "$chunks" ] && cflag="--overlap-config chunks=$chunks"
  local used=$(( $(date +%s) - T0 ))
  if [ $(( used + EST_S )) -gt "$BUDGET_S" ]; then
    say "skip $name (budget: ${used}s used of ${BUDGET_S}s)"
    return
  fi
  say "step $name"
  if [ "$DRY" = 1 ]; then
    echo "timeout $STEP_TIMEOUT torchrun ... --emulate-ep $ep $linkflag --routing $routing --microbatches $mbs --modes $mode $cflag"
    return
  fi
  timeout "$STEP_TIMEOUT" torchrun --standalone --nproc-per-node 1 -m fxoverlap.bench --out "$OUT" --name "$name" \
    --emulate-ep "$ep" $linkflag --skew "$SKEW" --routing "$routing" --microbatches "$mbs" --modes "$mode" \
    --warmup "$WARMUP" --iters "$ITERS" --no-stage-timing --no-grad-check $cflag $EXTRA >"$OUT/$name.log" 2>&1
  local rc=$?
  grep -A8 "^mode (emulated)" "$OUT/$name.log" | grep -v "^mode" | head -2 | tee -a "$LOG"
  grep -E "Error|error:" "$OUT/$name.log" | tail -3 | cut -c1-300 | tee -a "$LOG"
  [ $rc = 0 ] || say "step $name failed (rc $rc); see $name.log"
}
EPS="2:nvlink 4:nvlink 8:nvlink 16:ib400 32:ib400"
for tier in $TIERS; do
  case $tier in
    1) for e in $EPS; do
         for mode in compile fxoverlap; do one "${e%%:*}" "${e##*:}" dropless 8 $mode; done
       done
       for mode in eager backend fwd_compile fwd_fxoverlap; do one 8 nvlink dropless 8 $mode; done ;;
    2) for e in $EPS; do
         for mode in compile fxoverlap; do one "${e%%:*}" "${e##*:}" capacity 8 $mode; done
       done ;;
    3) for r in dropless capacity; do
         for e in $EPS; do
           for mode in compile fxoverlap; do one "${e%%:*}" "${e##*:}" $r 4 $mode; done
         done
       done ;;
    # chunks (OverlapConfig(chunks=K)) at the issue's point: EP 8, 100 GB/s, the peer's shape
    4) for mode in compile fwd_compile; do one 8 gbps100 dropless 8 $mode; done
       for c in 1 2 4; do
         for mode in fxoverlap backend fwd_fxoverlap fwd_backend; do one 8 gbps100 dropless 8 $mode $c; done
       done ;;
    5) one 8 gbps100 dropless 4 compile
       for c in 1 2 4; do one 8 gbps100 dropless 4 fxoverlap $c; done
       one 8 gbps100 capacity 8 compile
       for c in 1 2; do one 8 gbps100 capacity 8 fxoverlap $c; one 8 gbps100 capacity 8 backend $c; done
       for c in 1 2; do one 8 gbps300 dropless 8 fxoverlap $c; done
       for c in 1 2; do one 8 none dropless 8 fxoverlap $c; done
       one 8 none dropless 8 compile ;;
  esac
done
$PY scripts/emulated_table.py "$OUT" --out "$OUT/emulated_table.md" | tee -a "$LOG"
say "done"
