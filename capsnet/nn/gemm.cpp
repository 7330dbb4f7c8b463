#include "capsnet/nn/gemm.h"

#include <oneapi/dnnl/dnnl.h>

namespace capsnet::nn {
namespace {

// A matrix's BLAS form: 'N' for row-major with leading dimension ld, 'T' for column-major.
struct BlasOperand {
  char trans;
  int64_t ld;
};

bool blas_operand(const torch::Tensor& m, BlasOperand* op) {
  // A size-1 axis may carry any stride: the leading dimension only has to be at least the row length.
  if (m.stride(1) == 1 || m.size(1) == 1) {
    *op = {'N', std::max<int64_t>({m.stride(0), m.size(1), 1})};
    return m.size(0) == 1 || m.stride(0) >= m.size(1);
  }
  if (m.stride(0) == 1 || m.size(0) == 1) {
    *op = {'T', std::max<int64_t>({m.stride(1), m.size(0), 1})};
    return m.size(1) == 1 || m.stride(1) >= m.size(0);
  }
  return false;
}

bool sgemm(torch::Tensor& out, const torch::Tensor& a, const torch::Tensor& b, double alpha, double beta) {
  if (out.scalar_type() != torch::kFloat || !out.device().is_cpu()) return false;
  BlasOperand oa{}, ob{}, oc{};
  if (!blas_operand(a, &oa) || !blas_operand(b, &ob) || !blas_operand(out, &oc) || oc.trans != 'N') return false;
  const int64_t M = out.size(0), N = out.size(1), K = a.size(1);
  if (M == 0 || N == 0) return true;
  const auto status = dnnl_sgemm(oa.trans, ob.trans, M, N, K, static_cast<float>(alpha), a.data_ptr<float>(), oa.ld,
                                 b.data_ptr<float>(), ob.ld, static_cast<float>(beta), out.data_ptr<float>(), oc.ld);
  TORCH_CHECK(status == dnnl_success, "gemm_into: dnnl_sgemm failed with status ", static_cast<int>(status));
  return true;
}

void check_shapes(const char* who, const torch::Tensor& out, const torch::Tensor& a, const torch::Tensor& b,
                  int64_t dims) {
  TORCH_CHECK(a.dim() == dims && b.dim() == dims && out.dim() == dims, who, ": expected ", dims,
              "-D operands, got a ", a.sizes(), ", b ", b.sizes(), ", out ", out.sizes());
  const int64_t m = dims - 2;
  TORCH_CHECK(a.size(m + 1) == b.size(m) && out.size(m) == a.size(m) && out.size(m + 1) == b.size(m + 1) &&
                  (dims == 2 || (a.size(0) == b.size(0) && out.size(0) == a.size(0))),
              who, ": shapes do not chain: a ", a.sizes(), ", b ", b.sizes(), ", out ", out.sizes());
  TORCH_CHECK(a.scalar_type() == out.scalar_type() && b.scalar_type() == out.scalar_type(), who,
              ": operands must share one dtype");
}

void aten_gemm(torch::Tensor& out, const torch::Tensor& a, const torch::Tensor& b, double alpha, double beta) {
  if (beta == 0.0)
    out.copy_(torch::mm(a, b).mul_(alpha));
  else
    out.addmm_(a, b, beta, alpha);
}

// One 2-D product: oneDNN where the layouts allow, else ATen.
void product_into(torch::Tensor& out, const torch::Tensor& a, const torch::Tensor& b, double alpha, double beta) {
  if (!sgemm(out, a, b, alpha, beta)) aten_gemm(out, a, b, alpha, beta);
}

}  // namespace

void gemm_into(torch::Tensor& out, const torch::Tensor& a, const torch::Tensor& b, double alpha, double beta) {
  check_shapes("gemm_into", out, a, b, 2);
  product_into(out, a, b, alpha, beta);
}

void batched_gemm_into(torch::Tensor& out, const torch::Tensor& a, const torch::Tensor& b, double alpha,
                       double beta) {
  check_shapes("batched_gemm_into", out, a, b, 3);
  // oneDNN threads each product itself (measured as fast as one thread per product: docs/kernels.md).
  if (out.scalar_type() == torch::kFloat && out.device().is_cpu()) {
    for (int64_t f = 0; f < out.size(0); ++f) {
      auto o = out[f];
      product_into(o, a[f], b[f], alpha, beta);
    }
    return;
  }
  if (beta == 0.0)
    out.copy_(torch::bmm(a, b).mul_(alpha));
  else
    out.baddbmm_(a, b, beta, alpha);
}

}  // namespace capsnet::nn
