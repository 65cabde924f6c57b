#!/usr/bin/env bash
# Bench rows on ONE GPU, one process per row, at the peer's shape with an emulated EP link (all
# figures emulated). Each row is "name|modes|microbatches|overlap-config|bench flags|env", e.g.
#
#     ROWS="opt|fxoverlap|8|| |
#           carve16|fxoverlap|8|sm_carveout=16||
#           lt16|fxoverlap|8|sm_carveout=16||TORCH_BLAS_PREFER_CUBLASLT=1
#           ep2|fxoverlap|8|delay_wgrad=0|--emulate-ep 2 --link nvlink|" OUT=$OUT bash scripts/gpu_rows.sh
#
# A row's bench flags replace the default ones (--emulate-ep 8 --link-gbps 100 --routing dropless);
# 1 warm-up and 3 timed steps, no stage timing, no gradient check. PROBE=1 first runs
# scripts/gpu_carveout_probe.py ($OUT/carveout_probe.jsonl). A row starts only if it fits in BUDGET_S.
set -u
export PYTHONUNBUFFERED=1
PY=${PY:-python3}
OUT=${OUT:-bench_out/gpu_rows}
BUDGET_S=${BUDGET_S:-540}
EST_S=${EST_S:-45}
STEP_TIMEOUT=${STEP_TIMEOUT:-150}
ROWS=${ROWS:-"opt|fxoverlap|8|||"}
DEFAULT_FLAGS=${DEFAULT_FLAGS:---emulate-ep 8 --link-gbps 100 --routing dropless}
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/fxoverlap_inductor_cache}
# shellcheck source=scripts/gpu_lib.sh
source "$(dirname "$0")/gpu_lib.sh"
gpu_setup gpu_rows
if [ "${PROBE:-0}" = 1 ]; then
  say "carveout probe"
  timeout 120 env PYTHONPATH=. $PY scripts/gpu_carveout_probe.py >"$OUT/carveout_probe.jsonl" 2>"$OUT/carveout_probe.err"
  say "probe rc=$? ($(wc -l <"$OUT/carveout_probe.jsonl") rows)"
fi
while IFS='|' read -r name modes mbs oc flags envs; do
  name=$(echo "$name" | tr -d ' '); flags=$(echo "$flags" | sed 's/^ *//;s/ *$//')
  [ -n "$name" ] || continue
  used=$(( $(date +%s) - T0 ))
  if [ $(( used + EST_S )) -gt "$BUDGET_S" ]; then
    say "skip $name (budget: ${used}s used of ${BUDGET_S}s)"
    continue
  fi
  say "row $name: modes $modes, $mbs microbatches, config '$oc', flags '$flags', env '$envs'"
  # shellcheck disable=SC2086
  timeout "$STEP_TIMEOUT" env $envs torchrun --standalone --nproc-per-node 1 -m fxoverlap.bench --out "$OUT" \
    --name "$name" ${flags:-$DEFAULT_FLAGS} --microbatches "$mbs" \
    --modes "$modes" --warmup 1 --iters 3 --no-stage-timing --no-grad-check \
    ${oc:+--overlap-config "$oc"} >"$OUT/$name.log" 2>&1
  rc=$?
  grep -A8 "^mode (emulated)" "$OUT/$name.log" | tee -a "$LOG"
  grep -E "Error|error:" "$OUT/$name.log" | tail -3 | cut -c1-300 | tee -a "$LOG"
  [ $rc = 0 ] || say "row $name failed (rc $rc); see $name.log"
done <<< "$(echo "$ROWS" | tr ';' '\n')"
$PY scripts/emulated_table.py "$OUT" --out "$OUT/emulated_table.md" >/dev/null 2>&1 && say "table: $OUT/emulated_table.md"
say "done"
