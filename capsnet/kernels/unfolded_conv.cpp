#include "capsnet/kernels/unfolded_conv.h"

#include "capsnet/kernels/gemm.h"
#include "capsnet/kernels/saved_pairs.h"

#include <algorithm>

namespace capsnet::kernels {
namespace {

using detail::as_array;
using detail::as_vector;

// The products' sums: fp32 for bf16 operands (gemm.h), else the operands' own dtype.
torch::ScalarType sum_dtype(torch::ScalarType operands) {
  return operands == torch::kBFloat16 ? torch::kFloat : operands;
}

class UnfoldedConvFunction : public torch::autograd::Function<UnfoldedConvFunction> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x, const torch::Tensor& w,
                               const torch::Tensor& b, std::array<int64_t, 2> stride, std::array<int64_t, 2> padding) {
    const int64_t N = x.size(0), O = w.size(0), K = w.size(1) * w.size(2) * w.size(3);
    const std::array<int64_t, 2> kernel{w.size(2), w.size(3)};
    const int64_t P = (x.size(2) + 2 * padding[0] - kernel[0]) / stride[0] + 1;
    const int64_t Q = (x.size(3) + 2 * padding[1] - kernel[1]) / stride[1] + 1;
    // The weight and bias side by side in x's dtype: wa: [O, K + 1].
    auto wa = torch::empty({O, K + 1}, x.options());
    wa.narrow(1, 0, K).copy_(w.reshape({O, K}));
    wa.select(1, K).copy_(b);
    auto y = torch::empty({N, O, P, Q}, x.options());  // y: [N, O, P, Q]
    const auto y3 = y.view({N, O, P * Q});
    // The patches a chunk of images at a time.
    const int64_t chunk = std::max<int64_t>(1, kUnfoldedChunkBytes / (wa.size(1) * P * Q * x.element_size()));
    for (int64_t n0 = 0; n0 < N; n0 += chunk) {
      const int64_t n = std::min(chunk, N - n0);
      const auto cols = unfolded_patches(x.narrow(0, n0, n), kernel, stride, padding, true);  // [n, K + 1, L]
      auto yn = y3.narrow(0, n0, n);
      batched_gemm_into(yn, wa.unsqueeze(0), cols);
    }
    // x (0.16 MB for Conv1 in bf16) rather than its patches (6.6 MB): the backward gathers them again, a
    // chunk of images at a time.
    ctx->save_for_backward({x, wa});
    ctx->saved_data["kernel"] = as_vector(kernel);
    ctx->saved_data["stride"] = as_vector(stride);
    ctx->saved_data["padding"] = as_vector(padding);
    ctx->saved_data["w_dtype"] = w.scalar_type();
    ctx->saved_data["b_dtype"] = b.scalar_type();
    return y;
  }

  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                               torch::autograd::tensor_list grads) {
    // create_graph: the gradient would be built from kernels autograd cannot see through, so
    // differentiating it again would be silently wrong. Refused, as the registered ops refuse it.
    TORCH_CHECK(!torch::GradMode::is_enabled(),
                "conv2d_unfolded: double backward (create_graph, "
                "differentiating the gradient) is not implemented");
    const auto saved = ctx->get_saved_variables();
    const auto& x = saved[0];   // x: [N, C, H, W]
    const auto& wa = saved[1];  // wa: [O, K + 1]
    const auto kernel = as_array(ctx->saved_data["kernel"]);
    const auto stride = as_array(ctx->saved_data["stride"]);
    const auto padding = as_array(ctx->saved_data["padding"]);
    const int64_t N = x.size(0), O = wa.size(0), C = x.size(1), K = C * kernel[0] * kernel[1];
    const auto dy = grads[0].to(x.scalar_type()).contiguous().view({N, O, -1});  // dy: [N, O, L]
    const int64_t L = dy.size(2);
    const auto acc = x.options().dtype(sum_dtype(x.scalar_type()));
    torch::Tensor dx, dw, db;
    if (ctx->needs_input_grad(1) || ctx->needs_input_grad(2)) {
      // One product per image (dy_n cols_n^T), summed over the batch: [dw | db]: [O, K + 1]. The patches and
      // the per-image products exist a chunk of images at a time. (The product per image measured against
      // the transposed product cols_n dy_n^T, a contiguous copy of cols^T, and one accumulating product
      // per image: as fast, 1.2x and 1.4x slower; docs/kernels.md.)
      const int64_t per_image = wa.size(1) * (L * x.element_size() + O * static_cast<int64_t>(sizeof(float)));
      const int64_t chunk = std::max<int64_t>(1, kUnfoldedChunkBytes / per_image);
      auto dwa = torch::zeros({O, wa.size(1)}, acc);
      for (int64_t n0 = 0; n0 < N; n0 += chunk) {
        const int64_t n = std::min(chunk, N - n0);
        const auto cols = unfolded_patches(x.narrow(0, n0, n), kernel, stride, padding, true);  // [n, K + 1, L]
        auto parts = torch::empty({n, O, wa.size(1)}, acc);
        batched_gemm_into(parts, dy.narrow(0, n0, n), cols.transpose(1, 2));
        dwa += parts.sum(0);
      }
      if (ctx->needs_input_grad(1))
        dw = dwa.narrow(1, 0, K).reshape({O, C, kernel[0], kernel[1]}).to(ctx->saved_data["w_dtype"].toScalarType());
      if (ctx->needs_input_grad(2)) db = dwa.select(1, K).to(ctx->saved_data["b_dtype"].toScalarType());
    }
    if (ctx->needs_input_grad(0)) {
      // The patches' gradient w^T dy_n, folded back onto the image (overlaps summed).
      auto dcols = torch::empty({N, K, L}, acc);  // dcols: [N, K, L]
      batched_gemm_into(dcols, wa.narrow(1, 0, K).t().unsqueeze(0), dy);
      dx = at::col2im(dcols, {x.size(2), x.size(3)}, as_vector(kernel), {1, 1}, as_vector(padding), as_vector(stride))
               .to(x.scalar_type());
    }
    return {dx, dw, db, torch::Tensor(), torch::Tensor()};
  }
};

}  // namespace

torch::Tensor unfolded_patches(const torch::Tensor& x, std::array<int64_t, 2> kernel, std::array<int64_t, 2> stride,
                               std::array<int64_t, 2> padding, bool ones_row) {
  TORCH_CHECK(x.dim() == 4, "unfolded_patches: expected x [N, C, H, W], got ", x.sizes());
  auto xp = x.contiguous();
  if (padding[0] > 0 || padding[1] > 0) xp = at::constant_pad_nd(xp, {padding[1], padding[1], padding[0], padding[0]});
  const int64_t N = xp.size(0), C = xp.size(1), H = xp.size(2), W = xp.size(3);
  TORCH_CHECK(H >= kernel[0] && W >= kernel[1], "unfolded_patches: the kernel ", kernel[0], "x", kernel[1],
              " does not fit the padded input ", H, "x", W);
  const int64_t P = (H - kernel[0]) / stride[0] + 1, Q = (W - kernel[1]) / stride[1] + 1;
  const int64_t K = C * kernel[0] * kernel[1];
  auto cols = torch::empty({N, K + (ones_row ? 1 : 0), P * Q}, xp.options());
  // One strided copy: patch element (c, i, j) at output (p, q) is xp[n, c, s0 p + i, s1 q + j].
  cols.narrow(1, 0, K)
      .view({N, C, kernel[0], kernel[1], P, Q})
      .copy_(xp.as_strided({N, C, kernel[0], kernel[1], P, Q}, {C * H * W, H * W, W, 1, W * stride[0], stride[1]}));
  if (ones_row) cols.select(1, K).fill_(1);
  return cols;
}

torch::Tensor conv2d_unfolded(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& b,
                              std::array<int64_t, 2> stride, std::array<int64_t, 2> padding) {
  TORCH_CHECK(x.dim() == 4 && w.dim() == 4 && x.size(1) == w.size(1),
              "conv2d_unfolded: expected x [N, C, H, W] and w [O, C, k0, k1], got ", x.sizes(), " and ", w.sizes());
  TORCH_CHECK(!b.defined() || (b.dim() == 1 && b.size(0) == w.size(0)), "conv2d_unfolded: expected b [", w.size(0),
              "], got ", b.sizes());
  TORCH_CHECK(stride[0] > 0 && stride[1] > 0 && padding[0] >= 0 && padding[1] >= 0,
              "conv2d_unfolded: stride must be positive and padding non-negative");
  TORCH_CHECK(x.size(2) + 2 * padding[0] >= w.size(2) && x.size(3) + 2 * padding[1] >= w.size(3),
              "conv2d_unfolded: the kernel ", w.size(2), "x", w.size(3), " does not fit the padded input ",
              x.size(2) + 2 * padding[0], "x", x.size(3) + 2 * padding[1]);
  // Custom autograd functions take no undefined inputs: a missing bias is a zero one that needs no gradient.
  return UnfoldedConvFunction::apply(x, w, b.defined() ? b : torch::zeros({w.size(0)}, w.options()), stride, padding);
}

}  // namespace capsnet::kernels
