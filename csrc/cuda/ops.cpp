// Python bindings of hybrid_cuda_ops: shape/dtype checks, output allocation and
// the current CUDA stream; the kernels themselves live in the .cu files (ops.h).
// c10/cuda/CUDAStream.h gives c10::cuda::getCurrentCUDAStream, the function that
// at::cuda::getCurrentCUDAStream names (ATen/cuda/CUDAContext.h re-exports it but
// also pulls in cuBLAS/cuSPARSE headers that a minimal CUDA install lacks).
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include <cmath>
#include <optional>

#include "ops.h"

namespace {

using hybrid::DType;

DType dtype_of(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return DType::kFloat;
    case at::kBFloat16: return DType::kBFloat16;
    case at::kHalf: return DType::kHalf;
    default: TORCH_CHECK(false, "hybrid_cuda_ops: unsupported dtype ", t.scalar_type());
  }
  return DType::kFloat;  // unreachable
}

void check_cuda(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_cuda(), "hybrid_cuda_ops: ", name, " must be a CUDA tensor");
  TORCH_CHECK(t.is_contiguous(), "hybrid_cuda_ops: ", name, " must be contiguous");
}

void check_same(const at::Tensor& a, const at::Tensor& b, const char* name) {
  check_cuda(b, name);
  TORCH_CHECK(b.scalar_type() == a.scalar_type(), "hybrid_cuda_ops: ", name, " dtype ",
              b.scalar_type(), " != ", a.scalar_type());
  TORCH_CHECK(b.device() == a.device(), "hybrid_cuda_ops: ", name, " is on another device");
}

cudaStream_t stream() { return c10::cuda::getCurrentCUDAStream().stream(); }

void check_launch() { C10_CUDA_KERNEL_LAUNCH_CHECK(); }

// ---- LayerNorm: x (..., C), weight/bias (C,) of x's dtype ----
std::vector<at::Tensor> layer_norm_fwd(const at::Tensor& x, const at::Tensor& w,
                                       const at::Tensor& b, double eps) {
  check_cuda(x, "x");
  check_same(x, w, "weight");
  check_same(x, b, "bias");
  const int64_t cols = x.size(-1);
  TORCH_CHECK(w.numel() == cols && b.numel() == cols, "layer_norm: weight/bias size != ", cols);
  const int64_t rows = cols ? x.numel() / cols : 0;
  c10::cuda::CUDAGuard guard(x.device());
  auto y = at::empty_like(x);
  auto f32 = x.options().dtype(at::kFloat);
  auto mean = at::empty({rows}, f32), rstd = at::empty({rows}, f32);
  hybrid::layer_norm_fwd(x.data_ptr(), w.data_ptr(), b.data_ptr(), y.data_ptr(),
                         mean.data_ptr<float>(), rstd.data_ptr<float>(), rows, cols,
                         static_cast<float>(eps), dtype_of(x), stream());
  check_launch();
  return {y, mean, rstd};
}

std::vector<at::Tensor> layer_norm_bwd(const at::Tensor& dy, const at::Tensor& x,
                                       const at::Tensor& w, const at::Tensor& mean,
                                       const at::Tensor& rstd) {
  check_cuda(x, "x");
  check_same(x, dy, "grad_output");
  check_same(x, w, "weight");
  check_cuda(mean, "mean");
  check_cuda(rstd, "rstd");
  TORCH_CHECK(dy.sizes() == x.sizes(), "layer_norm_bwd: grad shape != x shape");
  const int64_t cols = x.size(-1);
  const int64_t rows = cols ? x.numel() / cols : 0;
  TORCH_CHECK(mean.scalar_type() == at::kFloat && rstd.scalar_type() == at::kFloat &&
                  mean.numel() == rows && rstd.numel() == rows,
              "layer_norm_bwd: mean/rstd must be fp32 (rows,)");
  c10::cuda::CUDAGuard guard(x.device());
  auto dx = at::empty_like(x);
  auto dw = at::empty_like(w), db = at::empty_like(w);
  const int64_t chunks = hybrid::layer_norm_bwd_chunks(rows, cols);
  auto ws = at::empty({2 * chunks * cols}, x.options().dtype(at::kFloat));
  hybrid::layer_norm_bwd(dy.data_ptr(), x.data_ptr(), w.data_ptr(), mean.data_ptr<float>(),
                         rstd.data_ptr<float>(), dx.data_ptr(), dw.data_ptr(), db.data_ptr(),
                         ws.data_ptr<float>(), rows, cols, dtype_of(x), stream());
  check_launch();
  return {dx, dw, db};
}

// ---- bias GELU: x (..., C), bias (C,) ----
at::Tensor bias_gelu_fwd(const at::Tensor& x, const at::Tensor& bias, bool use_tanh) {
  check_cuda(x, "x");
  check_same(x, bias, "bias");
  const int64_t cols = x.size(-1);
  TORCH_CHECK(bias.numel() == cols, "bias_gelu: bias size != ", cols);
  c10::cuda::CUDAGuard guard(x.device());
  auto y = at::empty_like(x);
  hybrid::bias_gelu_fwd(x.data_ptr(), bias.data_ptr(), y.data_ptr(), cols ? x.numel() / cols : 0,
                        cols, use_tanh, dtype_of(x), stream());
  check_launch();
  return y;
}

std::vector<at::Tensor> bias_gelu_bwd(const at::Tensor& dy, const at::Tensor& x,
                                      const at::Tensor& bias, bool use_tanh) {
  check_cuda(x, "x");
  check_same(x, dy, "grad_output");
  check_same(x, bias, "bias");
  TORCH_CHECK(dy.sizes() == x.sizes(), "bias_gelu_bwd: grad shape != x shape");
  const int64_t cols = x.size(-1);
  const int64_t rows = cols ? x.numel() / cols : 0;
  c10::cuda::CUDAGuard guard(x.device());
  auto dx = at::empty_like(x);
  auto db = at::empty_like(bias);
  const int64_t chunks = hybrid::bias_gelu_bwd_chunks(rows, cols);
  auto ws = at::empty({chunks * cols}, x.options().dtype(at::kFloat));
  hybrid::bias_gelu_bwd(dy.data_ptr(), x.data_ptr(), bias.data_ptr(), dx.data_ptr(),
                        db.data_ptr(), ws.data_ptr<float>(), rows, cols, use_tanh,
                        dtype_of(x), stream());
  check_launch();
  return {dx, db};
}

// ---- cross-entropy: logits (N, V_local), target int64 (N,) ----
std::vector<at::Tensor> ce_stats(const at::Tensor& logits, const at::Tensor& target,
                                 int64_t vocab_start, int64_t valid) {
  check_cuda(logits, "logits");
  check_cuda(target, "target");
  TORCH_CHECK(logits.dim() == 2, "ce_stats: logits must be (N, V_local)");
  TORCH_CHECK(target.scalar_type() == at::kLong && target.numel() == logits.size(0),
              "ce_stats: target must be int64 (N,)");
  const int64_t rows = logits.size(0), cols = logits.size(1);
  c10::cuda::CUDAGuard guard(logits.device());
  auto f32 = logits.options().dtype(at::kFloat);
  auto mx = at::empty({rows}, f32), se = at::empty({rows}, f32), tl = at::empty({rows}, f32);
  hybrid::ce_stats(logits.data_ptr(), target.data_ptr<int64_t>(), mx.data_ptr<float>(),
                   se.data_ptr<float>(), tl.data_ptr<float>(), rows, cols, vocab_start, valid,
                   dtype_of(logits), stream());
  check_launch();
  return {mx, se, tl};
}

at::Tensor ce_grad(const at::Tensor& logits, const at::Tensor& target, const at::Tensor& M,
                   const at::Tensor& S, const at::Tensor& grad_loss, int64_t vocab_start,
                   int64_t valid) {
  check_cuda(logits, "logits");
  check_cuda(target, "target");
  TORCH_CHECK(logits.dim() == 2, "ce_grad: logits must be (N, V_local)");
  const int64_t rows = logits.size(0), cols = logits.size(1);
  TORCH_CHECK(target.scalar_type() == at::kLong && target.numel() == rows,
              "ce_grad: target must be int64 (N,)");
  for (const at::Tensor* t : {&M, &S, &grad_loss}) {
    check_cuda(*t, "M/S/grad_loss");
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->numel() == rows,
                "ce_grad: M, S, grad_loss must be fp32 (N,)");
  }
  c10::cuda::CUDAGuard guard(logits.device());
  auto grad = at::empty_like(logits);
  hybrid::ce_grad(logits.data_ptr(), target.data_ptr<int64_t>(), M.data_ptr<float>(),
                  S.data_ptr<float>(), grad_loss.data_ptr<float>(), grad.data_ptr(), rows, cols,
                  vocab_start, valid, dtype_of(logits), stream());
  check_launch();
  return grad;
}

// ---- AdamW (contract: hybrid/kernels/adam.py) ----
void adam_step(at::Tensor master, const at::Tensor& grad, at::Tensor exp_avg,
               at::Tensor exp_avg_sq, const std::optional<at::Tensor>& out,
               const at::Tensor& seg_bounds, const at::Tensor& seg_decay, double lr,
               double beta1, double beta2, double eps, double weight_decay, int64_t step,
               double grad_scale, at::Tensor found_inf,
               const std::optional<at::Tensor>& scalars) {
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&master, &exp_avg, &exp_avg_sq}) {
    check_cuda(*t, "master/exp_avg/exp_avg_sq");
    TORCH_CHECK(t->scalar_type() == at::kFloat, "adam_step: master and moments must be fp32");
  }
  const int64_t n = master.numel();
  check_cuda(grad, "grad");
  TORCH_CHECK(grad.numel() == n && exp_avg.numel() == n && exp_avg_sq.numel() == n,
              "adam_step: grad/exp_avg/exp_avg_sq must have master's ", n, " elements");
  const bool has_out = out.has_value() && out->defined();
  if (has_out) {
    check_cuda(*out, "out");
    TORCH_CHECK(out->numel() == n, "adam_step: out must have ", n, " elements");
  }
  check_cuda(seg_bounds, "seg_bounds");
  check_cuda(seg_decay, "seg_decay");
  TORCH_CHECK(seg_bounds.scalar_type() == at::kLong && seg_decay.scalar_type() == at::kByte &&
                  seg_bounds.numel() == seg_decay.numel() + 1,
              "adam_step: seg_bounds int64 (S+1,), seg_decay uint8 (S,)");
  check_cuda(found_inf, "found_inf");
  TORCH_CHECK(found_inf.scalar_type() == at::kFloat && found_inf.numel() == 1,
              "adam_step: found_inf must be fp32 (1,)");
  // scalars: fp64 [grad_scale, step, skip] on the device, overriding grad_scale and
  // step (the ZeRO engine's clip coefficient and skip flag never reach the host)
  const bool dev_scalars = scalars.has_value() && scalars->defined();
  if (dev_scalars) {
    check_cuda(*scalars, "scalars");
    TORCH_CHECK(scalars->scalar_type() == at::kDouble && scalars->numel() == 3 &&
                    scalars->device() == master.device(),
                "adam_step: scalars must be fp64 (3,) [grad_scale, step, skip] on master's "
                "device");
  } else {
    TORCH_CHECK(step >= 1, "adam_step: step counts from 1");
  }
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{
           &grad, &exp_avg, &exp_avg_sq, &seg_bounds, &seg_decay, &found_inf})
    TORCH_CHECK(t->device() == master.device(), "adam_step: all tensors on master's device");

  hybrid::AdamScalars s;  // in double on the host, rounded once (like torch's scalars)
  s.beta1 = static_cast<float>(beta1);
  s.one_minus_beta1 = static_cast<float>(1.0 - beta1);
  s.beta2 = static_cast<float>(beta2);
  s.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  s.eps = static_cast<float>(eps);
  s.decay_factor = static_cast<float>(1.0 - lr * weight_decay);
  s.step_size = static_cast<float>(lr / (1.0 - std::pow(beta1, static_cast<double>(step))));
  s.bias2_sqrt = static_cast<float>(std::sqrt(1.0 - std::pow(beta2, static_cast<double>(step))));
  s.grad_scale = static_cast<float>(grad_scale);
  s.skip = 0;

  c10::cuda::CUDAGuard guard(master.device());
  at::Tensor workspace;  // the derived scalars, written and read on the device
  if (dev_scalars)
    workspace = at::empty({static_cast<int64_t>(sizeof(hybrid::AdamScalars))},
                          master.options().dtype(at::kByte));
  hybrid::adam_step(master.data_ptr<float>(), grad.data_ptr(), dtype_of(grad),
                    exp_avg.data_ptr<float>(), exp_avg_sq.data_ptr<float>(),
                    has_out ? out->data_ptr() : nullptr,
                    has_out ? dtype_of(*out) : DType::kFloat, has_out,
                    seg_bounds.data_ptr<int64_t>(), seg_decay.data_ptr<uint8_t>(),
                    seg_decay.numel(), n, s, found_inf.data_ptr<float>(),
                    dev_scalars ? scalars->data_ptr<double>() : nullptr, lr, beta1, beta2,
                    dev_scalars ? reinterpret_cast<hybrid::AdamScalars*>(workspace.data_ptr())
                                : nullptr,
                    stream());
  check_launch();
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "hybrid fused CUDA kernels (LayerNorm, bias-GELU, vocab-parallel CE, AdamW)";
  m.def("layer_norm_fwd", &layer_norm_fwd, "LayerNorm forward -> (y, mean fp32, rstd fp32)");
  m.def("layer_norm_bwd", &layer_norm_bwd, "LayerNorm backward -> (dx, dweight, dbias)");
  m.def("bias_gelu_fwd", &bias_gelu_fwd, "gelu(x + bias): tanh approximation or exact");
  m.def("bias_gelu_bwd", &bias_gelu_bwd, "bias-GELU backward -> (dx, dbias)");
  m.def("ce_stats", &ce_stats, "local (max, sumexp, target_logit) per row, fp32");
  m.def("ce_grad", &ce_grad, "(softmax - onehot) * grad_loss in the logits dtype");
  m.def("adam_step", &adam_step, "fused AdamW step over a flat fp32 shard", py::arg("master"),
        py::arg("grad"), py::arg("exp_avg"), py::arg("exp_avg_sq"), py::arg("out"),
        py::arg("seg_bounds"), py::arg("seg_decay"), py::arg("lr"), py::arg("beta1"),
        py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"), py::arg("step"),
        py::arg("grad_scale"), py::arg("found_inf"), py::arg("scalars") = py::none());
}
