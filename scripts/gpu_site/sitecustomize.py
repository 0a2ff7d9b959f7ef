"""Python runs this at start-up when scripts/gpu_site is on PYTHONPATH (scripts/gpu_check.sh's
TorchRec steps, torchrun's workers too): CUDA kernels for the FBGEMM index ops that the CPU build
of fbgemm-gpu lacks (gk_fbgemm_cuda.py). Without FBGEMM there is nothing to add."""

try:
    import fbgemm_gpu  # noqa: F401
except ImportError:
    pass
else:
    import gk_fbgemm_cuda

    gk_fbgemm_cuda.register()
