// The BLAS torch's x86 wheels already carry (MKL's Fortran symbols in libtorch_cpu), for qkv's CPU kernels.
// Column-major, as BLAS is: a row-major (r x c) buffer with row stride ld is the column-major (c x r) matrix
// with leading dimension ld, its transpose.
#pragma once

extern "C" {
void sgemm_(const char*, const char*, const int*, const int*, const int*, const float*, const float*, const int*,
            const float*, const int*, const float*, float*, const int*);
void dgemm_(const char*, const char*, const int*, const int*, const int*, const double*, const double*,
            const int*, const double*, const int*, const double*, double*, const int*);
void strsm_(const char*, const char*, const char*, const char*, const int*, const int*, const float*, const float*,
            const int*, float*, const int*);
void dtrsm_(const char*, const char*, const char*, const char*, const int*, const int*, const double*,
            const double*, const int*, double*, const int*);
int MKL_Set_Num_Threads_Local(int);
}

namespace qkv_blas {

// C (m x n) = alpha op(A) op(B) + beta C.
inline void gemm(char ta, char tb, int m, int n, int k, float alpha, const float* a, int lda, const float* b,
                 int ldb, float beta, float* c, int ldc) {
  sgemm_(&ta, &tb, &m, &n, &k, &alpha, a, &lda, b, &ldb, &beta, c, &ldc);
}
inline void gemm(char ta, char tb, int m, int n, int k, double alpha, const double* a, int lda, const double* b,
                 int ldb, double beta, double* c, int ldc) {
  dgemm_(&ta, &tb, &m, &n, &k, &alpha, a, &lda, b, &ldb, &beta, c, &ldc);
}

// Solve X op(A) = alpha B (side 'R') or op(A) X = alpha B (side 'L') for X in place of B (m x n), A triangular.
inline void trsm(char side, char uplo, char ta, char diag, int m, int n, float alpha, const float* a, int lda,
                 float* b, int ldb) {
  strsm_(&side, &uplo, &ta, &diag, &m, &n, &alpha, a, &lda, b, &ldb);
}
inline void trsm(char side, char uplo, char ta, char diag, int m, int n, double alpha, const double* a, int lda,
                 double* b, int ldb) {
  dtrsm_(&side, &uplo, &ta, &diag, &m, &n, &alpha, a, &lda, b, &ldb);
}

// For the scope of one worker of a parallel loop (at::parallel_for, OpenMP: the kernels are built with -fopenmp and
// share torch's runtime): the BLAS calls it makes run on this thread alone rather than starting a team of their own.
class SequentialBlas {
 public:
  SequentialBlas() : previous_(MKL_Set_Num_Threads_Local(1)) {}
  ~SequentialBlas() { MKL_Set_Num_Threads_Local(previous_); }
  SequentialBlas(const SequentialBlas&) = delete;
  SequentialBlas& operator=(const SequentialBlas&) = delete;

 private:
  int previous_;
};

}  // namespace qkv_blas
