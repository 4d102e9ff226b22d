#!/usr/bin/env bash
# One short lease on a lent NVIDIA GPU: what the machine has, then tools/gpu_check.py (correctness of every kernel
# family against the float64 reference, then timings against torch SDPA). Everything lands under $OUT.
#   OUT=/tmp/gpu bash tools/gpu_session.sh [correctness-budget-seconds] [extra gpu_check.py arguments]
# The image's python3 (with torch) runs it. numba-cuda: the image's own, unless it differs from the version the
# project was last tested with and a wheel of that version was carried in .whl/ (see the device tool's README).
set -u
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
BUDGET=${1:-200}
shift || true
export PYTHONUNBUFFERED=1 NUMBA_FLASH_QUIET=1
[ -d /usr/local/cuda ] && export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
want=0.30.4
have=$(python3 -c "import numba_cuda; print(numba_cuda.__version__)" 2>/dev/null)
if [ "$have" != "$want" ] && ls .whl/numba_cuda-"$want"-*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/numba_cuda-*.whl \
    && export PYTHONPATH=/tmp/site
fi
{
  date -u; nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv
  python3 -V; nproc
  python3 -c "
import numba, numpy, torch, numba_cuda
print('numba', numba.__version__, 'numba_cuda', numba_cuda.__version__, numba_cuda.__file__)
print('numpy', numpy.__version__, 'torch', torch.__version__, torch.version.cuda)
from numba import cuda
d = cuda.get_current_device(); print(d.name, d.compute_capability, 'SMs', d.MULTIPROCESSOR_COUNT)
from numba.cuda.cudadrv import nvvm; print('nvvm', nvvm.NVVM().get_version())
print('driver', cuda.cudadrv.driver.driver.get_version())
"
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
python3 tools/gpu_check.py --out "$OUT" --budget "$BUDGET" "$@"
