// Launchers of the hybrid_cuda_ops kernels: raw pointers, a DType code, a stream.
// Shared by the .cu files (which never include torch) and ops.cpp (the only file
// that sees at::Tensor). All arrays are contiguous; "rows x cols" is row-major.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

namespace hybrid {

enum class DType : int { kFloat = 0, kBFloat16 = 1, kHalf = 2 };

// ---- LayerNorm over the last dim (layer_norm.cu) ----
// x, w, b, y: T; w, b of length cols. mean, rstd: fp32 (rows,).
void layer_norm_fwd(const void* x, const void* w, const void* b, void* y, float* mean,
                    float* rstd, int64_t rows, int64_t cols, float eps, DType dt,
                    cudaStream_t stream);
// Row chunks of the dweight/dbias partial sums; the caller passes a workspace of
// 2 * chunks * cols floats.
int64_t layer_norm_bwd_chunks(int64_t rows, int64_t cols);
void layer_norm_bwd(const void* dy, const void* x, const void* w, const float* mean,
                    const float* rstd, void* dx, void* dw, void* db, float* workspace,
                    int64_t rows, int64_t cols, DType dt, cudaStream_t stream);

// ---- y = gelu(x + bias), bias broadcast over rows (bias_gelu.cu); use_tanh: the
// tanh approximation, else the exact (erf) GELU ----
void bias_gelu_fwd(const void* x, const void* bias, void* y, int64_t rows, int64_t cols,
                   bool use_tanh, DType dt, cudaStream_t stream);
// Workspace: chunks * cols floats.
int64_t bias_gelu_bwd_chunks(int64_t rows, int64_t cols);
void bias_gelu_bwd(const void* dy, const void* x, const void* bias, void* dx, void* dbias,
                   float* workspace, int64_t rows, int64_t cols, bool use_tanh, DType dt,
                   cudaStream_t stream);

// ---- vocab-parallel cross-entropy pieces (cross_entropy.cu) ----
// logits (rows, cols) T; columns >= valid are padding (-inf). target int64 (rows,)
// of global ids. Per row fp32: max, sum exp(x - max), target logit (0 off-rank).
void ce_stats(const void* logits, const int64_t* target, float* max, float* sumexp,
              float* target_logit, int64_t rows, int64_t cols, int64_t vocab_start,
              int64_t valid, DType dt, cudaStream_t stream);
// grad (rows, cols) T = (exp(x - M) / S - onehot(target)) * grad_loss; 0 on padding.
void ce_grad(const void* logits, const int64_t* target, const float* M, const float* S,
             const float* grad_loss, void* grad, int64_t rows, int64_t cols,
             int64_t vocab_start, int64_t valid, DType dt, cudaStream_t stream);

// ---- AdamW over a flat fp32 shard (fused_adam.cu) ----
// out may be null (has_out false). Scalars precomputed on the host in double.
struct AdamScalars {
  float beta1, one_minus_beta1, beta2, one_minus_beta2, eps;
  float decay_factor;  // 1 - lr * weight_decay
  float step_size;     // lr / (1 - beta1^step)
  float bias2_sqrt;    // sqrt(1 - beta2^step)
  float grad_scale;
  int skip;            // nonzero: leave every buffer untouched
};
// dev_scalars: null, or fp64 [grad_scale, step, skip] in device memory. Then a
// one-thread kernel derives grad_scale, step_size, bias2_sqrt and skip from them
// into `workspace` (sizeof(AdamScalars) bytes of device memory) with the host's
// double formulas, and the update reads them there: no value crosses to the host.
// lr, beta1, beta2 are what `s` was built from.
void adam_step(float* p, const void* g, DType g_dt, float* m, float* v, void* out,
               DType out_dt, bool has_out, const int64_t* seg_bounds, const uint8_t* seg_decay,
               int64_t num_segments, int64_t n, const AdamScalars& s, float* found_inf,
               const double* dev_scalars, double lr, double beta1, double beta2,
               AdamScalars* workspace, cudaStream_t stream);

}  // namespace hybrid
