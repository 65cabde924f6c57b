#!/usr/bin/env bash
# GPU checks (numerics, memory, recompute, CSAN) and overlap tuning variants, one GPU session.
#
#     bash scripts/gpu_tune.sh          # on a 2-GPU machine; outputs under $OUT
#
# 1. scripts/gpu_checks.py: bf16 numerics, peak memory ratio, mHC recompute memory
# 2. the program under CSAN (torch.cuda._sanitizer, enabled after capture)
# 3. python -m fxoverlap.bench at the peer's shape, NVLink and NCCL_P2P_DISABLE=1,
#    for each variant in $VARIANTS ("name|bench flags"), one JSON line each
set -u
set -o pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-bench_out/tune}
mkdir -p "$OUT"
LOG="$OUT/tune.log"
CHECKS=${CHECKS:-1}
CSAN=${CSAN:-1}
REGIMES=${REGIMES:-"nvlink p2poff"}
ITERS=${ITERS:-4}
run() {  # run NAME TIMEOUT CMD...
    local name=$1 limit=$2; shift 2
    echo "=== $name ($(date -u +%H:%M:%S), timeout ${limit}s): $*" | tee -a "$LOG"
    timeout -k 10 "$limit" "$@" 2>&1 | tee "$OUT/$name.log" | grep -E "CHECK|RESULT|Error|error|rc=|bench\]" | tail -20 | tee -a "$LOG"
    echo "=== $name rc=${PIPESTATUS[0]}" | tee -a "$LOG"
}
TR="torchrun --standalone --nproc-per-node 2"
if [ "$CHECKS" = 1 ]; then
    run checks 240 $TR scripts/gpu_checks.py --checks numerics,memory,recompute --out "$OUT/checks.jsonl"
fi
if [ "$CSAN" = 1 ]; then
    run csan 150 $TR scripts/gpu_checks.py --checks csan --out "$OUT/checks.jsonl"
fi
VARIANTS=${VARIANTS:-"hp0|--nccl-high-priority 0;hp1|--nccl-high-priority 1;hp1_wgrad|--nccl-high-priority 1 --overlap-config delay_wgrad=1"}
IFS=';' read -ra VARS <<< "$VARIANTS"
for regime in $REGIMES; do
    for v in "${VARS[@]}"; do
        name=${v%%|*}; flags=${v#*|}
        env_p2p=""; [ "$regime" = p2poff ] && env_p2p="NCCL_P2P_DISABLE=1"
        run "bench_${regime}_${name}" 150 env $env_p2p $TR -m fxoverlap.bench --warmup 2 --iters "$ITERS" \
            --stage-reps 2 --no-trace --no-timeline --quiet --out "$OUT" --name "${regime}_${name}" $flags
    done
done
ls -la "$OUT" >> "$LOG"
