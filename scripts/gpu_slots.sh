#!/usr/bin/env bash
# Issue 24 item 3 on ONE GPU: where the merged steps F(i+1) x B(i) lose the link's time, and the
# schedule candidate, at the peer's shape (4 MoE layers, hidden 4096, 32 experts top-8 folded onto
# 4 local experts, seq 4096, bf16, dropless), emulated EP 8 over 100 GB/s (all figures emulated):
#
#     OUT=$OUT bash scripts/gpu_slots.sh          # ~7-8 min of one H200 (BUDGET_S=450)
#     python scripts/emulated_table.py $OUT       # the table again
#
# One process per row, each under `timeout`; a row starts only if it fits in BUDGET_S (the log says
# which were skipped). Rows "name microbatches overlap-config stage-timing(1/0)", in order:
#   base8_st      8 microbatches, chunks=1                               + stage timing
#   wg8_st        8, chunks=1, delay_wgrad=1                             + stage timing (the wgrad parts' times)
#   wg8_slot2     8, chunks=1, delay_wgrad=1, expert_wgrad_slot=2        (the candidate)
#   base16        16, chunks=1
#   wg16          16, chunks=1, delay_wgrad=1
#   wg16_slot2    16, chunks=1, delay_wgrad=1, expert_wgrad_slot=2
#   c2wg8         8, chunks=2 (the CUDA default), delay_wgrad=1
#   c2wg8_slot2   8, chunks=2, delay_wgrad=1, expert_wgrad_slot=2
# Each row times optimize without the link (T_compute) and with it (T_step, T_comm); the stage-timed
# rows also time every stage alone with the link (stage_timing, with each call's slot and hold), and
# then scripts/slot_balance.py runs on them (their own program, and the 16-microbatch program and the
# candidate replayed from the same stage times): $OUT/slot_balance_*.txt. Logs and JSON go to $OUT.
set -u
export PYTHONUNBUFFERED=1
PY=${PY:-python3}
OUT=${OUT:-bench_out/gpu_slots}
BUDGET_S=${BUDGET_S:-450}
EST_S=${EST_S:-45}          # a row's expected time: a row starts only if it fits in BUDGET_S
STEP_TIMEOUT=${STEP_TIMEOUT:-150}
LINK=${LINK:---link-gbps 100}
INSTALL=${INSTALL:-1}
ROWS=${ROWS:-"base8_st:8:chunks=1:1 wg8_st:8:chunks=1,delay_wgrad=1:1 wg8_slot2:8:chunks=1,delay_wgrad=1,expert_wgrad_slot=2:0
base16:16:chunks=1:0 wg16:16:chunks=1,delay_wgrad=1:0 wg16_slot2:16:chunks=1,delay_wgrad=1,expert_wgrad_slot=2:0
c2wg8:8:chunks=2,delay_wgrad=1:0 c2wg8_slot2:8:chunks=2,delay_wgrad=1,expert_wgrad_slot=2:0"}
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/fxoverlap_inductor_cache}
# shellcheck source=scripts/gpu_lib.sh
source "$(dirname "$0")/gpu_lib.sh"
gpu_setup gpu_slots
say "commit $(git rev-parse --short HEAD 2>/dev/null || echo "${FXOVERLAP_COMMIT:-unknown}")"
for row in $ROWS; do
  IFS=: read -r name mbs oc st <<< "$row"
  used=$(( $(date +%s) - T0 ))
  if [ $(( used + EST_S )) -gt "$BUDGET_S" ]; then
    say "skip $name (budget: ${used}s used of ${BUDGET_S}s)"
    continue
  fi
  stflags="--no-stage-timing"
  [ "$st" = 1 ] && stflags="--stage-reps 1 --no-trace"
  say "row $name: $mbs microbatches, $oc, stage timing $st"
  timeout "$STEP_TIMEOUT" torchrun --standalone --nproc-per-node 1 -m fxoverlap.bench --out "$OUT" \
    --name "ep8_gbps100_dropless_mb${mbs}_fxoverlap_$name" --emulate-ep 8 $LINK --routing dropless \
    --microbatches "$mbs" --modes fxoverlap --warmup 1 --iters 3 --no-grad-check $stflags \
    --overlap-config "$oc" >"$OUT/$name.log" 2>&1
  rc=$?
  grep -A3 "^mode (emulated)" "$OUT/$name.log" | tail -1 | tee -a "$LOG"
  grep -E "Error|error:" "$OUT/$name.log" | tail -3 | cut -c1-300 | tee -a "$LOG"
  [ $rc = 0 ] || say "row $name failed (rc $rc); see $name.log"
done
# the analysis of the stage-timed rows (CPU; the 16-microbatch and candidate replays rebuild the
# program on CPU at a tiny shape, a few seconds each)
for name in base8_st wg8_st; do
  j="$OUT/ep8_gbps100_dropless_mb8_fxoverlap_$name.json"
  [ -f "$j" ] && grep -q '"stage_timing"' "$j" || { say "no stage timing for $name"; continue; }
  extra=""
  [ "$name" = wg8_st ] && extra="delay_wgrad=1,"
  {
    timeout 60 $PY scripts/slot_balance.py "$j" --json-out "$OUT/slot_balance_${name}.json"
    echo; echo "=== replayed at 16 microbatches"
    timeout 60 $PY scripts/slot_balance.py "$j" --microbatches 16
    if [ "$name" = wg8_st ]; then
      for m in 8 16; do
        echo; echo "=== replayed at $m microbatches with expert_wgrad_slot=2"
        timeout 60 $PY scripts/slot_balance.py "$j" --microbatches $m --overlap-config "${extra}expert_wgrad_slot=2"
      done
    fi
  } >"$OUT/slot_balance_${name}.txt" 2>&1
  say "slot balance $name: $(grep -m1 '^Replay' "$OUT/slot_balance_${name}.txt" | cut -c1-200)"
done
$PY scripts/emulated_table.py "$OUT" --out "$OUT/emulated_table.md" >/dev/null 2>&1 && say "table: $OUT/emulated_table.md"
say "done"
