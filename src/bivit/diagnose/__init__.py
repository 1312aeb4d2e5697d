"""Is this machine right, are these bits right: `doctor` (what runs here), `verify` (invariance),
`golden` (committed rows, golden.json), `divergence` (the first op that differs) and `gpu_build`
(compiling the GPU kernels for an architecture without a GPU).
"""
