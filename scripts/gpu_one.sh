#!/usr/bin/env bash
# The one-GPU benchmark (EP = 1) of fxoverlap against eager and torch.compile(model), and
# the GPU checks of Inductor stages and CUDA graphs, in one lease of the lent machine.
#
#     PARTS="peer small checks" ROUTINGS="dropless capacity dedup" OUT=$OUT bash scripts/gpu_one.sh
#
# smoke:  a tiny shape through every mode (stops the script if fxoverlap or the backend fails).
# peer:   the Megatron peer's shape on one rank; per routing one process runs the modes
#         eager, compile (torch.compile(model)), backend (torch.compile(..., backend="fxoverlap"))
#         and fxoverlap (optimize; Inductor stages by default on CUDA), each timed after warm-up.
#         With WARM=1, one more fxoverlap process for the first routing shows the first step
#         with Inductor's on-disk caches warm.
# small:  a host-bound shape (2 layers, dim 1024, 8 experts top-2, seq 1024, 4 microbatches)
#         with CUDA graphs on: eager, compile, fxoverlap.
# checks: scripts/gpu_checks.py numerics (both stage compilers vs eager and torch.compile)
#         and scripts/gpu_cudagraph_check.py (graphs over Inductor stages, teardown).
# Every step runs under `timeout`; logs and JSON go to $OUT (default bench_out/gpu_one).
set -u
set -o pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
PY=${PY:-python3}
PARTS=${PARTS:-"peer small checks"}
ROUTINGS=${ROUTINGS:-"dropless capacity dedup"}
SMALL_ROUTINGS=${SMALL_ROUTINGS:-"capacity dropless"}
SMALL_MODES=${SMALL_MODES:-eager,compile,fxoverlap}
CHECK_ROUTINGS=${CHECK_ROUTINGS:-dropless,capacity,dedup}
OUT=${OUT:-bench_out/gpu_one}
WARM=${WARM:-1}
MODES=${MODES:-eager,compile,backend,fxoverlap}
ITERS=${ITERS:-5}
WARMUP=${WARMUP:-2}
STEP_TIMEOUT=${STEP_TIMEOUT:-300}
INSTALL=${INSTALL:-1}
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/fxoverlap_inductor_cache}
mkdir -p "$OUT"
LOG="$OUT/gpu_one.log"
say() { echo "[gpu_one $(date +%H:%M:%S)] $*" | tee -a "$LOG"; }
if [ "$INSTALL" = 1 ]; then
  $PY -m pip install -q --no-deps --no-build-isolation -e . >>"$LOG" 2>&1 || say "pip install failed"
fi
say "torch $($PY -c 'import torch; print(torch.__version__, torch.cuda.get_device_name(0))' 2>&1 | tail -1)"
bench() {  # name, timeout, bench args...
  local name=$1 t=$2; shift 2
  say "step $name"
  timeout "$t" torchrun --standalone --nproc-per-node 1 -m fxoverlap.bench --out "$OUT" --name "$name" \
    --no-stage-timing --warmup "$WARMUP" --iters "$ITERS" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  grep -E "^(mode|eager|compile|backend|fxoverlap) |numerics|Error|error:" "$OUT/$name.log" | grep -v Warning | tail -12 | tee -a "$LOG"
  [ $rc = 0 ] || say "step $name failed (rc $rc); see $name.log"
}
for part in $PARTS; do
  case $part in
    smoke)  # a tiny shape through every mode: stop here (rc 2) if it fails
      bench smoke 240 --tiny --modes eager,backend,fxoverlap --iters 1 --warmup 1 --routing dropless
      grep -q "^fxoverlap " "$OUT/smoke.log" || { say "smoke failed: stopping"; exit 2; }
      grep -q "falling back\|FallbackWarning\|running this graph as plain" "$OUT/smoke.log" && \
        { grep -m3 "running this graph as plain" "$OUT/smoke.log" | cut -c1-400 | tee -a "$LOG"; say "backend fell back: stopping"; exit 2; } ;;
    peer)
      first=""
      for r in $ROUTINGS; do
        # the first routing runs every mode; later ones MODES (default: every mode)
        modes=$MODES; [ -z "$first" ] && modes=eager,compile,backend,fxoverlap
        bench "peer_$r" "$STEP_TIMEOUT" --routing "$r" --modes "$modes"
        [ -z "$first" ] && first=$r
      done
      if [ "$WARM" = 1 ] && [ -n "$first" ]; then
        bench "peer_${first}_warm" 150 --routing "$first" --modes fxoverlap --warmup 1 --iters 3
      fi ;;
    small)
      for r in $SMALL_ROUTINGS; do
        bench "small_$r" 200 --routing "$r" --modes "$SMALL_MODES" --iters 20 \
          --layers 2 --dim 1024 --heads 8 --experts 8 --top-k 2 --expert-dim 512 --vocab 8192 --seq 1024 \
          --microbatches 4 --overlap-config cuda_graphs=1
      done ;;
    checks)
      say "step gpu_checks numerics"
      timeout 300 torchrun --standalone --nproc-per-node 1 scripts/gpu_checks.py --checks numerics --small \
        --routings "$CHECK_ROUTINGS" \
        --out "$OUT/gpu_checks.jsonl" >"$OUT/gpu_checks.log" 2>&1 || say "gpu_checks failed (rc $?)"
      grep "^CHECK" "$OUT/gpu_checks.log" | cut -c1-400 | tee -a "$LOG"
      say "step gpu_cudagraph_check"
      timeout 240 torchrun --standalone --nproc-per-node 1 scripts/gpu_cudagraph_check.py \
        --out "$OUT/cudagraph.jsonl" >"$OUT/cudagraph.log" 2>&1 || say "gpu_cudagraph_check failed (rc $?)"
      grep -E "^CUDAGRAPH|TEARDOWN|Error" "$OUT/cudagraph.log" | cut -c1-600 | tee -a "$LOG" ;;
  esac
done
say "done"
