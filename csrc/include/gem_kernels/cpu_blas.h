// Row-major sgemm on the BLAS that libtorch links (MKL on x86, else OpenBLAS), for CPU kernels that
// multiply their own tiles inside a parallel region (no ATen dispatch per call: a few microseconds
// each, as much as a small tile's product).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

// Fortran BLAS sgemm, exported by libtorch_cpu (MKL or OpenBLAS, whichever torch was built with).
extern "C" void sgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k,
                       const float* alpha, const float* a, const int* lda, const float* b, const int* ldb,
                       const float* beta, float* c, const int* ldc);
// MKL's per-thread thread count, C interface (mkl_service.h maps mkl_set_num_threads_local to it;
// the lower-case symbol is the Fortran one, taking a pointer). Weak: absent with another BLAS.
extern "C" __attribute__((weak)) int MKL_Set_Num_Threads_Local(int nthreads);
// MKL's packed-operand GEMM (CBLAS interface; row-major = 101, no-transpose = 111, transpose = 112,
// packed = 151, B matrix = 162). Weak: absent with another BLAS, where PackedB falls back to sgemm_.
extern "C" __attribute__((weak)) size_t cblas_sgemm_pack_get_size(int identifier, int m, int n, int k);
extern "C" __attribute__((weak)) void cblas_sgemm_pack(int layout, int identifier, int trans, int m, int n, int k,
                                                       float alpha, const float* src, int ld, float* dest);
extern "C" __attribute__((weak)) void cblas_sgemm_compute(int layout, int transa, int transb, int m, int n, int k,
                                                          const float* a, int lda, const float* b, int ldb, float beta,
                                                          float* c, int ldc);

namespace gem_kernels {

// Row-major C[m x n] = alpha * op(A) op(B) + beta * C, on column-major BLAS: C^T = op(B)^T op(A)^T.
inline void mm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda,
               const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  if (m == 0 || n == 0) return;
  const char ta = trans_b ? 'T' : 'N';
  const char tb = trans_a ? 'T' : 'N';
  const int mi = static_cast<int>(n), ni = static_cast<int>(m), ki = static_cast<int>(k);
  const int la = static_cast<int>(ldb), lb = static_cast<int>(lda), lc = static_cast<int>(ldc);
  sgemm_(&ta, &tb, &mi, &ni, &ki, &alpha, b, &la, a, &lb, &beta, c, &lc);
}

// The B operand of many row-major products C[m x n] = A[m x k] op(B) that share it, packed once in
// MKL's internal layout: a product over a block of rows otherwise repacks all of B on every call
// (a 512 x 512 W per 128-row block made the cross layer's blocked NT GEMM ~20% slower on one core).
// Products of exactly `m` rows use the packed copy (MKL requires the packing's m); others, and
// every product without MKL, call sgemm on B itself. Read-only after construction: workers share it.
class PackedB {
 public:
  PackedB(bool trans_b, int64_t m, int64_t n, int64_t k, const float* b, int64_t ldb)
      : trans_b_(trans_b), m_(m), n_(n), k_(k), b_(b), ldb_(ldb) {
    if (cblas_sgemm_pack_get_size == nullptr || cblas_sgemm_pack == nullptr || cblas_sgemm_compute == nullptr ||
        m == 0 || n == 0 || k == 0)
      return;
    // 64-byte aligned (MKL's advice for packed buffers): 15 spare floats to align the start.
    storage_.resize((cblas_sgemm_pack_get_size(kB, static_cast<int>(m), static_cast<int>(n), static_cast<int>(k)) +
                     sizeof(float) - 1) / sizeof(float) + 15);
    packed_ = storage_.data() + (-reinterpret_cast<uintptr_t>(storage_.data()) / sizeof(float) & 15);
    cblas_sgemm_pack(kRowMajor, kB, trans_b ? kTrans : kNoTrans, static_cast<int>(m), static_cast<int>(n),
                     static_cast<int>(k), 1.0f, b, static_cast<int>(ldb), packed_);
  }

  // C[m x n] = A[m x k] op(B) + beta * C.
  void multiply(int64_t m, const float* a, int64_t lda, float beta, float* c, int64_t ldc) const {
    if (m == m_ && packed_ != nullptr)
      cblas_sgemm_compute(kRowMajor, kNoTrans, kPacked, static_cast<int>(m), static_cast<int>(n_), static_cast<int>(k_),
                          a, static_cast<int>(lda), packed_, static_cast<int>(ldb_), beta, c,
                          static_cast<int>(ldc));
    else
      mm(false, trans_b_, m, n_, k_, 1.0f, a, lda, b_, ldb_, beta, c, ldc);
  }

 private:
  static constexpr int kRowMajor = 101, kNoTrans = 111, kTrans = 112, kPacked = 151, kB = 162;
  bool trans_b_;
  int64_t m_, n_, k_;
  const float* b_;
  int64_t ldb_;
  std::vector<float> storage_;
  float* packed_ = nullptr;
};

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
