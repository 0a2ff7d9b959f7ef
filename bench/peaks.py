"""The machine's measured peaks: gem_kernels.testing.peaks (in the package, because model/train.py
measures its MFU roof with it too and bench/ imports model/)."""

from gem_kernels.testing.peaks import gather_gbps, matmul_peak_tflops, measure_peaks, measure_peaks_again

__all__ = ["gather_gbps", "matmul_peak_tflops", "measure_peaks", "measure_peaks_again"]
