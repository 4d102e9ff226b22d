"""Device helpers the kernels are built from: tile moves between global and shared memory, masks and the score
pipeline, packed-sequence lookup, dtype loads and stores, the user's mods as device functions, and the warp-level
primitives of the tensor-core kernels (inline PTX in warp_ptx.py; their simulator emulation, with the PTX ISA's
fragment layouts, in warp_sim.py)."""
