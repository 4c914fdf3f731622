// The multi-pass LayerNorm launchers (layer_norm_multipass.cu) that the fused
// entry points in layer_norm.cu fall back to, instantiated for float,
// __nv_bfloat16 and __half. Same contracts as layer_norm_fwd / layer_norm_bwd in
// ops.h; `vec`: rows may be read in 16-byte vectors. The
// backward writes dx and the (chunks, cols) fp32 partial sums part_w / part_b of
// dweight / dbias over row chunks of per_chunk rows; the caller adds them up.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "ops.h"

namespace hybrid {

template <typename T>
void layer_norm_fwd_multipass(const T* x, const T* w, const T* b, T* y, float* mean,
                              float* rstd, int64_t rows, int cols, float eps, bool vec,
                              cudaStream_t stream);

template <typename T>
void layer_norm_bwd_multipass(const T* dy, const T* x, const T* w, const float* mean,
                              const float* rstd, T* dx, float* part_w, float* part_b,
                              int64_t rows, int cols, int64_t chunks, int64_t per_chunk,
                              bool vec, cudaStream_t stream);

}  // namespace hybrid
