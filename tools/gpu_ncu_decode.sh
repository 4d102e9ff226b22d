#!/usr/bin/env bash
# Nsight Compute on the main kernels (tools/gpu_profile.py: one forward and backward each, float16 D = 128 and
# float32 D = 64, S = 4096), then the decode bench against torch SDPA. Everything under $OUT. Run as
#   OUT=/tmp/gpu bash tools/gpu_ncu_decode.sh
set -u
OUT=${OUT:-/tmp/gpu-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NUMBA_FLASH_QUIET=1
[ -d /usr/local/cuda ] && export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
NUMBA_FLASH_SELFCHECK=0 timeout 200 ncu --clock-control none -k regex:flash_ -c 10 \
  --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
  --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables --section SchedulerStats \
  python3 tools/gpu_profile.py float16:128 float32:64 > "$OUT/ncu.txt" 2>&1
echo "ncu rc=$?"
timeout 120 python3 -m numba_flash.bench --decode --backend cuda --compare torch --cache-lens 4096,32768,65536 \
  --dtype fp16 --repeats 20 > "$OUT/decode.txt" 2>&1
echo "decode rc=$?"
