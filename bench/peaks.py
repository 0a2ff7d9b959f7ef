"""The machine's measured peaks: gem_kernels.testing.peaks (in the package, because model/train.py
measures its MFU roof with it too and bench/ imports model/)."""

from gem_kernels.testing.peaks import (PREFETCH_DISTANCES, gather_gbps, gather_roof, gather_roof_call, matmul_peak_tflops,
                                      measure_peaks, measure_peaks_again, prefetched_gather_gbps)

__all__ = ["PREFETCH_DISTANCES", "gather_gbps", "gather_roof", "gather_roof_call", "matmul_peak_tflops", "measure_peaks",
           "measure_peaks_again", "prefetched_gather_gbps"]
