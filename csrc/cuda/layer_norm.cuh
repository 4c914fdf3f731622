// The multi-pass LayerNorm launchers (layer_norm_multipass.cu) that the fused
// entry points in layer_norm.cu fall back to. Same contracts as layer_norm_fwd /
// layer_norm_bwd in ops.h; `vec`: rows may be read in 16-byte vectors. The
// backward writes dx and the (chunks, cols) fp32 partial sums part_w / part_b of
// dweight / dbias over row chunks of per_chunk rows; the caller adds them up.
#pragma once

#include "ops.h"

namespace hybrid {

void layer_norm_fwd_multipass(const void* x, const void* w, const void* b, void* y,
                              float* mean, float* rstd, int64_t rows, int64_t cols, float eps,
                              bool vec, DType dt, cudaStream_t stream);

void layer_norm_bwd_multipass(const void* dy, const void* x, const void* w, const float* mean,
                              const float* rstd, void* dx, float* part_w, float* part_b,
                              int64_t rows, int64_t cols, int64_t chunks, int64_t per_chunk,
                              bool vec, DType dt, cudaStream_t stream);

}  // namespace hybrid
