# Shared start of the GPU scripts (sourced): `gpu_setup NAME` writes $OUT/NAME.log, defines
# `say` (a timestamped line to it and stdout, seconds since the start), links the git-ignored
# fxoverlap/kernels and fxoverlap/passes in a copied tree, installs the package unless
# INSTALL=0 or DRY=1, and logs torch, triton and the GPU. Needs PY and OUT.
gpu_setup() {
  local name=$1
  mkdir -p "$OUT"
  LOG="$OUT/$name.log"
  T0=$(date +%s)
  eval "say() { echo \"[$name \$(date +%H:%M:%S) +\$(( \$(date +%s) - T0 ))s] \$*\" | tee -a \"\$LOG\"; }"
  [ -e fxoverlap/kernels ] || ln -s ../kernels fxoverlap/kernels
  [ -e fxoverlap/passes ] || ln -s ../passes fxoverlap/passes
  if [ "${INSTALL:-1}" = 1 ] && [ "${DRY:-0}" != 1 ]; then
    $PY -m pip install -q --no-deps --no-build-isolation -e . >>"$LOG" 2>&1 || say "pip install failed (running from the tree)"
  fi
  say "torch $($PY -c 'import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name(0))' 2>&1 | tail -1)"
}
