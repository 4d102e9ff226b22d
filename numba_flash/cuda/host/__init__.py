"""Host side of the CUDA kernels: what a tile config is (config.py) and which one a call gets (picker.py), the GPU
table (gpus.py), the launches (launch.py, launch_dbias.py, launch_decode.py) and the shared-memory opt-in past
48 KiB (smem.py). Nothing here imports ``numba.cuda`` at module level."""
