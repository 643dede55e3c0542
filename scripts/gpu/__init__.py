"""The GPU checks and timings behind ``scripts/gpu_check``: ``check`` (the entry point),
``checks`` (kernels and graphs against their references), ``timing`` (decode steps) and
``steps`` (the step grid for ``weir calibrate``). Torch, triton and numpy only."""
