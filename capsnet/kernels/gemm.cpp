#include "capsnet/kernels/gemm.h"

#include <oneapi/dnnl/dnnl.h>
#include <oneapi/dnnl/dnnl.hpp>

#include <cstring>
#include <map>
#include <mutex>
#include <vector>

namespace capsnet::kernels {
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

// bf16 operands: oneDNN's matmul primitive (bf16 x bf16, fp32 accumulation, out fp32 or bf16), any strides,
// a leading batch axis or none. A primitive is built per shape, strides, dtypes, alpha and beta (0.05-2 ms)
// and kept: the spectral convolution asks for the same few dozen every step.
dnnl::memory::desc matmul_operand(const torch::Tensor& t) {
  const dnnl::memory::dims dims(t.sizes().begin(), t.sizes().end()), strides(t.strides().begin(), t.strides().end());
  return {dims, t.scalar_type() == torch::kBFloat16 ? dnnl::memory::data_type::bf16 : dnnl::memory::data_type::f32,
          strides};
}

const dnnl::engine& cpu_engine() {
  static const dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  return engine;
}

const dnnl::matmul& bf16_matmul_primitive(const torch::Tensor& out, const torch::Tensor& a, const torch::Tensor& b,
                                          float alpha, float beta) {
  std::vector<int64_t> key{out.scalar_type() == torch::kBFloat16, static_cast<int64_t>(out.dim())};
  for (const auto* t : {&out, &a, &b}) {
    key.insert(key.end(), t->sizes().begin(), t->sizes().end());
    key.insert(key.end(), t->strides().begin(), t->strides().end());
  }
  for (const float f : {alpha, beta}) {
    int32_t bits = 0;
    std::memcpy(&bits, &f, sizeof bits);
    key.push_back(bits);
  }
  static std::mutex mutex;
  static std::map<std::vector<int64_t>, dnnl::matmul> primitives;
  const std::lock_guard<std::mutex> lock(mutex);
  const auto found = primitives.find(key);
  if (found != primitives.end()) return found->second;
  dnnl::primitive_attr attr;
  if (alpha != 1.0f) attr.set_output_scales(0, {alpha});
  if (beta != 0.0f) {
    dnnl::post_ops sum;
    sum.append_sum(beta);
    attr.set_post_ops(sum);
  }
  const dnnl::matmul::primitive_desc pd(
      dnnl::matmul::desc(matmul_operand(a), matmul_operand(b), matmul_operand(out)), attr, cpu_engine());
  return primitives.emplace(std::move(key), dnnl::matmul(pd)).first->second;
}

void bf16_matmul(torch::Tensor& out, const torch::Tensor& a, const torch::Tensor& b, double alpha, double beta) {
  if (out.numel() == 0) return;
  if (a.size(-1) == 0) {  // an empty sum: beta * out (beta 0 ignores out's contents, NaN included)
    beta == 0.0 ? out.zero_() : out.mul_(beta);
    return;
  }
  const auto& primitive = bf16_matmul_primitive(out, a, b, static_cast<float>(alpha), static_cast<float>(beta));
  const auto& engine = cpu_engine();
  dnnl::stream stream(engine);
  primitive.execute(stream, {{DNNL_ARG_SRC, dnnl::memory(matmul_operand(a), engine, a.data_ptr())},
                             {DNNL_ARG_WEIGHTS, dnnl::memory(matmul_operand(b), engine, b.data_ptr())},
                             {DNNL_ARG_DST, dnnl::memory(matmul_operand(out), engine, out.data_ptr())}});
  stream.wait();
}

bool is_bf16_product(const torch::Tensor& a) {
  return a.scalar_type() == torch::kBFloat16 && a.device().is_cpu();
}

void check_shapes(const char* who, const torch::Tensor& out, const torch::Tensor& a, const torch::Tensor& b,
                  int64_t dims) {
  TORCH_CHECK(a.dim() == dims && b.dim() == dims && out.dim() == dims, who, ": expected ", dims,
              "-D operands, got a ", a.sizes(), ", b ", b.sizes(), ", out ", out.sizes());
  const int64_t m = dims - 2;
  // A batch axis of a or b may have size 1 (broadcast over out's).
  bool batches_match = true;
  for (int64_t d = 0; d < m; ++d)
    batches_match =
        batches_match && (a.size(d) == out.size(d) || a.size(d) == 1) && (b.size(d) == out.size(d) || b.size(d) == 1);
  TORCH_CHECK(a.size(m + 1) == b.size(m) && out.size(m) == a.size(m) && out.size(m + 1) == b.size(m + 1) &&
                  batches_match,
              who, ": shapes do not chain: a ", a.sizes(), ", b ", b.sizes(), ", out ", out.sizes());
  TORCH_CHECK(a.scalar_type() == b.scalar_type() &&
                  (a.scalar_type() == out.scalar_type() ||
                   (a.scalar_type() == torch::kBFloat16 && out.scalar_type() == torch::kFloat)),
              who, ": a and b must share one dtype, and out have it too (or float32 for bfloat16 operands); got ",
              a.scalar_type(), ", ", b.scalar_type(), ", ", out.scalar_type());
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
  if (is_bf16_product(a)) return bf16_matmul(out, a, b, alpha, beta);
  product_into(out, a, b, alpha, beta);
}

void batched_gemm_into(torch::Tensor& out, const torch::Tensor& a, const torch::Tensor& b, double alpha,
                       double beta) {
  TORCH_CHECK(a.dim() >= 3 && a.dim() <= 8, "batched_gemm_into: expected 3-D to 8-D operands, got a ", a.sizes());
  check_shapes("batched_gemm_into", out, a, b, a.dim());
  if (is_bf16_product(a)) return bf16_matmul(out, a, b, alpha, beta);
  // The f-th matrix of an operand along its leading axis (the only one where that axis is broadcast).
  const auto at = [](const torch::Tensor& t, int64_t f) { return t[t.size(0) == 1 ? 0 : f]; };
  if (a.dim() > 3) {  // one leading axis at a time
    for (int64_t f = 0; f < out.size(0); ++f) {
      auto o = out[f];
      batched_gemm_into(o, at(a, f), at(b, f), alpha, beta);
    }
    return;
  }
  // oneDNN threads each product itself (measured as fast as one thread per product: docs/kernels.md).
  if (out.scalar_type() == torch::kFloat && out.device().is_cpu()) {
    for (int64_t f = 0; f < out.size(0); ++f) {
      auto o = out[f];
      product_into(o, at(a, f), at(b, f), alpha, beta);
    }
    return;
  }
  const auto ae = a.expand({out.size(0), a.size(1), a.size(2)}), be = b.expand({out.size(0), b.size(1), b.size(2)});
  if (beta == 0.0)
    out.copy_(torch::bmm(ae, be).mul_(alpha));
  else
    out.baddbmm_(ae, be, beta, alpha);
}

}  // namespace capsnet::kernels
