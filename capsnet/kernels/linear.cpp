#include "capsnet/kernels/linear.h"

#include "capsnet/kernels/gemm.h"

namespace capsnet::kernels {
namespace {

class LinearGemmFunction : public torch::autograd::Function<LinearGemmFunction> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x_in,
                               const torch::Tensor& w_in, const torch::Tensor& b) {
    const auto x = x_in.contiguous(), w = w_in.contiguous();
    // y starts as the bias on every row and takes the product on top (beta 1): no second pass.
    // (A copy, never contiguous()'s view of b itself: at N = 1 the product would land in the bias.)
    auto y = torch::empty({x.size(0), w.size(0)}, w.options());  // y: [N, O]
    y.copy_(b.view({1, -1}).expand_as(y));
    gemm_into(y, x, w.t(), 1.0, 1.0);
    ctx->save_for_backward({x, w});
    return y;
  }

  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                               torch::autograd::tensor_list grads) {
    // create_graph: the gradient would be built from kernels autograd cannot see through, so
    // differentiating it again would be silently wrong. Refused, as the registered ops refuse it.
    TORCH_CHECK(!torch::GradMode::is_enabled(), "linear_gemm: double backward (create_graph, "
                "differentiating the gradient) is not implemented");
    const auto saved = ctx->get_saved_variables();
    const auto& x = saved[0];
    const auto& w = saved[1];
    const auto dy = grads[0].contiguous();  // dy: [N, O]
    torch::Tensor dx, dw, db;
    if (ctx->needs_input_grad(0)) {
      dx = torch::empty(x.sizes(), x.options());  // dx: [N, I] = dy w
      gemm_into(dx, dy, w);
    }
    if (ctx->needs_input_grad(1)) {
      dw = torch::empty(w.sizes(), w.options());  // dw: [O, I] = dy^T x
      gemm_into(dw, dy.t(), x);
    }
    if (ctx->needs_input_grad(2)) db = dy.sum(0);
    return {dx, dw, db};
  }
};

}  // namespace

torch::Tensor linear_gemm(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& b) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1),
              "linear_gemm: x [N, I] and w [O, I] must share I, got ", x.sizes(), " and ", w.sizes());
  TORCH_CHECK(!b.defined() || (b.dim() == 1 && b.size(0) == w.size(0)), "linear_gemm: b must be [O] = [", w.size(0),
              "], got ", b.sizes());
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu() && x.is_floating_point() &&
                  x.scalar_type() == w.scalar_type() && (!b.defined() || b.scalar_type() == w.scalar_type()),
              "linear_gemm: CPU tensors of one floating dtype, got ", x.scalar_type(), " and ", w.scalar_type());
  // Custom autograd functions take no undefined inputs: a missing bias is a zero one that needs no gradient.
  return LinearGemmFunction::apply(x, w, b.defined() ? b : torch::zeros({w.size(0)}, w.options()));
}

}  // namespace capsnet::kernels
