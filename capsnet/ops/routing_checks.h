#pragma once
// Argument checks shared by the autograd kernels and every device kernel of the routing operators
// (device kernels can be reached without autograd, e.g. under torch::NoGradGuard / InferenceMode).
// All failures are c10::Error (RuntimeError in Python) naming the operator and the offending argument.

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cstdint>

namespace capsnet::ops::detail {

/// float32 / float64 on every device; CUDA kernels also take float16 / bfloat16 (fp32 accumulation).
inline void check_dtype(const char* op, const char* name, const at::Tensor& t) {
  const auto s = t.scalar_type();
  if (t.is_cuda()) {
    TORCH_CHECK(s == at::kFloat || s == at::kDouble || s == at::kHalf || s == at::kBFloat16, op, ": ", name,
                " must be float32, float64, float16 or bfloat16 on CUDA, got ", s);
    return;
  }
  TORCH_CHECK(s == at::kFloat || s == at::kDouble, op, ": ", name, " must be float32 or float64 on the CPU, got ", s,
              s == at::kHalf || s == at::kBFloat16 ? " (float16 / bfloat16 run on CUDA tensors only)" : "");
}

/// Dtype of the routing state s_all: the input's, except float32 for float16 / bfloat16 inputs (the CUDA
/// kernels accumulate and keep the state in float32).
inline at::ScalarType state_dtype(at::ScalarType input) {
  return input == at::kHalf || input == at::kBFloat16 ? at::kFloat : input;
}

inline void check_iterations(const char* op, int64_t iterations) {
  TORCH_CHECK(iterations >= 1, op, ": iterations must be >= 1, got ", iterations);
}

/// u: [B, I, Din], W: [I, J, D, Din].
inline void check_capsule_routing_inputs(const char* op, const at::Tensor& u, const at::Tensor& W) {
  TORCH_CHECK(u.defined() && W.defined(), op, ": u and W must be defined tensors");
  TORCH_CHECK(u.dim() == 3, op, ": u must be [B, I, Din] (3 dims), got ", u.sizes());
  TORCH_CHECK(W.dim() == 4, op, ": W must be [I, J, D, Din] (4 dims), got ", W.sizes());
  TORCH_CHECK(u.size(1) == W.size(0), op, ": u has I = ", u.size(1), " input capsules but W has I = ", W.size(0),
              " (u: ", u.sizes(), ", W: ", W.sizes(), ")");
  TORCH_CHECK(u.size(2) == W.size(3), op, ": u has Din = ", u.size(2), " but W has Din = ", W.size(3),
              " (u: ", u.sizes(), ", W: ", W.sizes(), ")");
  check_dtype(op, "u", u);
  check_dtype(op, "W", W);
  TORCH_CHECK(u.scalar_type() == W.scalar_type(), op, ": u and W must have the same dtype, got ", u.scalar_type(),
              " and ", W.scalar_type());
  TORCH_CHECK(u.device() == W.device(), op, ": u and W must be on the same device, got ", u.device(), " and ",
              W.device());
}

/// u_hat: [B, I, J, D].
inline void check_predictions_input(const char* op, const at::Tensor& u_hat) {
  TORCH_CHECK(u_hat.defined(), op, ": u_hat must be a defined tensor");
  TORCH_CHECK(u_hat.dim() == 4, op, ": u_hat must be [B, I, J, D] (4 dims), got ", u_hat.sizes());
  check_dtype(op, "u_hat", u_hat);
}

/// grad_v: [B, J, D] and s_all: [B, r, J, D] (r >= 1) as produced by the forward kernel.
inline void check_backward_state(const char* op, const at::Tensor& grad_v, const at::Tensor& s_all, int64_t B,
                                 int64_t J, int64_t D, const at::Tensor& like) {
  TORCH_CHECK(
      grad_v.defined() && grad_v.dim() == 3 && grad_v.size(0) == B && grad_v.size(1) == J && grad_v.size(2) == D, op,
      ": grad_v must be [", B, ", ", J, ", ", D, "], got ", grad_v.sizes());
  TORCH_CHECK(s_all.defined() && s_all.dim() == 4 && s_all.size(0) == B && s_all.size(1) >= 1 && s_all.size(2) == J &&
                  s_all.size(3) == D,
              op, ": s_all must be [", B, ", r >= 1, ", J, ", ", D, "], got ", s_all.sizes());
  TORCH_CHECK(grad_v.scalar_type() == like.scalar_type() && s_all.scalar_type() == state_dtype(like.scalar_type()),
              op, ": grad_v and s_all must have dtypes ", like.scalar_type(), " and ", state_dtype(like.scalar_type()),
              ", got ", grad_v.scalar_type(), " and ", s_all.scalar_type());
  TORCH_CHECK(grad_v.device() == like.device() && s_all.device() == like.device(), op, ": grad_v and s_all must be on ",
              like.device());
}

}  // namespace capsnet::ops::detail
