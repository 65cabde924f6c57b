#!/usr/bin/env bash
# fxoverlap benchmark and the Megatron-Core peer, side by side, in one GPU session.
#
# Run from the repository root on a machine with 2 GPUs (e.g. the lent 2 x H200):
#
#     bash scripts/gpu_bench.sh
#
# Needs, prepared on a machine with internet (the GPU machine has none):
#     pip download --no-deps --python-version 3.12 --only-binary=:all: megatron-core==0.19.2 -d .peer/
#     cp ../shared/peer/peer_megatron.py .peer/
# (.peer/ is git-ignored: name it in the device tool's `carry`.) Megatron-Core
# 0.19.2 needs torch, numpy, packaging and triton at import; the GPU image has them.
#
# For each regime in $REGIMES (nvlink; p2poff = NCCL_P2P_DISABLE=1, which emulates
# inter-node bandwidth) and each routing in $ROUTINGS (default "dropless dedup"; capacity = factor 1.0;
# dedup = dropless with each token sent once per rank, which the peer has no
# counterpart for, so its peer steps are skipped):
#   [small shape, see SMALL]     python -m fxoverlap.bench (eager + fxoverlap)
#   the peer's shape             python -m fxoverlap.bench (eager + fxoverlap)
#   the peer, PEER=1             peer_megatron.py --overlap 0, then --overlap 1
# every step under `timeout`; a failed step is logged and the script goes on. With
# BUDGET_S set, a step that would not finish before BUDGET_S seconds (less 30 s for
# the summary) gets a shorter timeout, or is skipped.
# Outputs go to $WORK, then to $OUT (default bench_out/gpu): gpu_bench.log (all
# output), summary.md (the table), results.tar.gz (JSON, PNG timelines, per-step
# logs) and the Chrome trace of each regime's peer-shape run.
#
# Knobs (environment): REGIMES, ROUTINGS, SMALL (0, 1 = every regime, or a list
# of regimes), PEER, WARMUP, ITERS, STAGE_REPS, STEP_TIMEOUT (seconds per step),
# BUDGET_S (seconds for the whole script), BENCH_ARGS (extra fxoverlap.bench flags),
# SMALL_ARGS (the small shape), PY, BENCH_NPROC (ranks, default 2), INSTALL (0: skip the pip installs).
# The log is appended to, so several invocations with one OUT and WORK add up.
set -u
set -o pipefail

# NVLink multicast stays off on the shared hosts, for us and for the peer.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1

PY=${PY:-python3}
NPROC=${BENCH_NPROC:-2}
REGIMES=${REGIMES:-"nvlink p2poff"}
ROUTINGS=${ROUTINGS:-"dropless dedup"}
SMALL=${SMALL:-0}
PEER=${PEER:-1}
WARMUP=${WARMUP:-2}
ITERS=${ITERS:-5}
STAGE_REPS=${STAGE_REPS:-2}
STEP_TIMEOUT=${STEP_TIMEOUT:-200}
BUDGET_S=${BUDGET_S:-0}
BENCH_ARGS=${BENCH_ARGS:-}
SMALL_ARGS=${SMALL_ARGS:-"--layers 2 --dim 1024 --heads 8 --experts 8 --top-k 2 --expert-dim 512 --vocab 8192 --seq 1024 --microbatches 4"}
INSTALL=${INSTALL:-1}
OUT=${OUT:-bench_out/gpu}
WORK=${WORK:-/tmp/fxoverlap_gpu_bench}
PEER_DIR=${PEER_DIR:-.peer}
PEER_SITE=${PEER_SITE:-/tmp/peer}

mkdir -p "$OUT" "$WORK"
LOG="$OUT/gpu_bench.log"
FAILED=()

say() { echo "[gpu_bench] $*" | tee -a "$LOG"; }

# step NAME CMD...: run under timeout, output to $WORK/NAME.log and the main log.
step() {
    local name=$1; shift
    local limit=$STEP_TIMEOUT
    if [ "$BUDGET_S" -gt 0 ]; then
        local left=$((BUDGET_S - SECONDS - 30))
        if [ $left -lt 45 ]; then
            say "--- $name: skipped, ${left}s left of BUDGET_S=$BUDGET_S"
            FAILED+=("$name(skipped)")
            return 0
        fi
        [ $left -lt "$limit" ] && limit=$left
    fi
    say "--- $name (timeout ${limit}s): $* ($(date -u +%H:%M:%S))"
    local t0=$SECONDS
    timeout -k 15 "$limit" "$@" 2>&1 | tee "$WORK/$name.log" >> "$LOG"
    local rc=$?
    say "--- $name: rc=$rc after $((SECONDS - t0)) s"
    [ $rc -eq 0 ] || FAILED+=("$name(rc=$rc)")
    return 0
}

# (an array, not a function: `timeout` runs programs, not shell functions)
TORCHRUN=("$PY" -m torch.distributed.run --standalone --nproc-per-node "$NPROC")

# A copy of the tree without .git (the lent GPU machine's): pass FXOVERLAP_COMMIT=<hash>.
export FXOVERLAP_COMMIT=${FXOVERLAP_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo '?')}
say "start $(date -u +%Y-%m-%dT%H:%M:%SZ); commit $FXOVERLAP_COMMIT"
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader 2>&1 | tee -a "$LOG"
nvidia-smi topo -m 2>&1 | head -5 >> "$LOG"
"$PY" -c 'import torch; print("torch", torch.__version__, "nccl", torch.cuda.nccl.version(), "gpus", torch.cuda.device_count())' 2>&1 | tee -a "$LOG"

if [ "$INSTALL" = 1 ]; then
    step install_fxoverlap "$PY" -m pip install -q --no-deps --no-build-isolation -e .
    if [ "$PEER" = 1 ]; then
        step install_peer "$PY" -m pip install -q --no-deps --no-index --upgrade --target "$PEER_SITE" \
            $(ls "$PEER_DIR"/megatron_core*.whl 2>/dev/null | head -1)
    fi
fi
if [ "$PEER" = 1 ] && [ ! -f "$PEER_DIR/peer_megatron.py" ]; then
    say "no $PEER_DIR/peer_megatron.py: skipping the peer (copy ../shared/peer/peer_megatron.py there)"
    PEER=0
fi

for regime in $REGIMES; do
    case $regime in
        nvlink) unset NCCL_P2P_DISABLE ;;
        p2poff) export NCCL_P2P_DISABLE=1 ;;
        *) say "unknown regime $regime (nvlink, p2poff)"; continue ;;
    esac
    for routing in $ROUTINGS; do
        case $routing in
            dropless) ours_r="--routing dropless"; peer_r="" ;;
            capacity) ours_r="--routing capacity --capacity-factor 1.0"; peer_r="--capacity-factor 1.0" ;;
            dedup) ours_r="--routing dedup"; peer_r="SKIP" ;;
            *) say "unknown routing $routing (dropless, capacity, dedup)"; continue ;;
        esac
        tag="${regime}_${routing}"
        if [ "$SMALL" = 1 ] || [[ " $SMALL " == *" $regime "* ]]; then
            step "fx_small_$tag" "${TORCHRUN[@]}" -m fxoverlap.bench $SMALL_ARGS $ours_r --warmup "$WARMUP" \
                --iters "$ITERS" --stage-reps "$STAGE_REPS" --out "$WORK" --name "fx_small_$tag" --no-trace
        fi
        step "fx_$tag" "${TORCHRUN[@]}" -m fxoverlap.bench $ours_r --warmup "$WARMUP" --iters "$ITERS" \
            --stage-reps "$STAGE_REPS" --out "$WORK" --name "fx_$tag" $BENCH_ARGS
        if [ "$PEER" = 1 ] && [ "$peer_r" != SKIP ]; then
            for ov in 0 1; do
                PYTHONPATH="$PEER_SITE${PYTHONPATH:+:$PYTHONPATH}" step "peer_${tag}_overlap$ov" \
                    "${TORCHRUN[@]}" "$PEER_DIR/peer_megatron.py" --overlap $ov --warmup "$WARMUP" --iters "$ITERS" $peer_r
            done
        fi
    done
done
unset NCCL_P2P_DISABLE

"$PY" scripts/bench_summary.py "$WORK" > "$OUT/summary.md" 2>> "$LOG" || say "summary failed"
cat "$OUT/summary.md" | tee -a "$LOG"
cp "$OUT/summary.md" "$WORK/" 2>/dev/null
for t in "$WORK"/fx_*_trace.json.gz; do
    [ -f "$t" ] && cp "$t" "$OUT/"
done
tar czf "$OUT/results.tar.gz" -C "$WORK" --exclude='*_trace.json.gz' . 2>> "$LOG"
say "end $(date -u +%Y-%m-%dT%H:%M:%SZ); failed steps: ${FAILED[*]:-none}"
[ ${#FAILED[@]} -eq 0 ]
