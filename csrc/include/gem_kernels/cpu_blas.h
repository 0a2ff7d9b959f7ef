// Row-major sgemm on the BLAS that libtorch links (MKL on x86, else OpenBLAS), for CPU kernels that
// multiply their own tiles inside a parallel region (no ATen dispatch per call: a few microseconds
// each, as much as a small tile's product).
#pragma once

#include <algorithm>
#include <cstdint>

// Fortran BLAS sgemm, exported by libtorch_cpu (MKL or OpenBLAS, whichever torch was built with).
extern "C" void sgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k,
                       const float* alpha, const float* a, const int* lda, const float* b, const int* ldb,
                       const float* beta, float* c, const int* ldc);
// MKL's per-thread thread count, C interface (mkl_service.h maps mkl_set_num_threads_local to it;
// the lower-case symbol is the Fortran one, taking a pointer). Weak: absent with another BLAS.
extern "C" __attribute__((weak)) int MKL_Set_Num_Threads_Local(int nthreads);

namespace gem_kernels {

// Row-major C[m x n] = alpha * op(A) op(B) + beta * C, on column-major BLAS: C^T = op(B)^T op(A)^T.
inline void mm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda,
               const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  if (m == 0 || n == 0) return;
  const char ta = trans_b ? 'T' : 'N';
  const char tb = trans_a ? 'T' : 'N';
  const int mi = static_cast<int>(n), ni = static_cast<int>(m), ki = static_cast<int>(k);
  // BLAS wants every leading dimension >= max(1, its extent): an empty extent (k = 0: a zero-width
  // operand, e.g. the low-rank cross layer at N = 0) gives ld 0, which MKL rejects with a printed error.
  const int la = static_cast<int>(std::max<int64_t>(ldb, 1)), lb = static_cast<int>(std::max<int64_t>(lda, 1)),
            lc = static_cast<int>(std::max<int64_t>(ldc, 1));
  sgemm_(&ta, &tb, &mi, &ni, &ki, &alpha, b, &la, a, &lb, &beta, c, &lc);
}

// For its lifetime, this thread's BLAS calls run on this thread only. A worker of a parallel region
// already owns a core: a BLAS call that forked threads of its own would oversubscribe them
// (measured in the attention kernels: 1.6x slower fwd+bwd on 2 cores).
class SingleThreadBlas {
 public:
  SingleThreadBlas() : previous_(MKL_Set_Num_Threads_Local != nullptr ? MKL_Set_Num_Threads_Local(1) : 0) {}
  ~SingleThreadBlas() {
    if (MKL_Set_Num_Threads_Local != nullptr) MKL_Set_Num_Threads_Local(previous_);
  }
  SingleThreadBlas(const SingleThreadBlas&) = delete;
  SingleThreadBlas& operator=(const SingleThreadBlas&) = delete;

 private:
  int previous_;
};

}  // namespace gem_kernels
