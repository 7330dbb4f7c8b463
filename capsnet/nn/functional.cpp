#include "capsnet/nn/functional.h"

namespace capsnet {

torch::Tensor squash(const torch::Tensor& s, int64_t dim, double eps) {
  auto sq_norm = s.pow(2).sum(dim, /*keepdim=*/true);
  // eps inside the sqrt: the gradient of |s| is undefined at 0, this one is 0.
  return s * (sq_norm / (1 + sq_norm)) / torch::sqrt(sq_norm + eps);
}

torch::Tensor capsule_length(const torch::Tensor& v, int64_t dim, double eps) {
  return torch::sqrt(v.pow(2).sum(dim) + eps);
}

namespace {
torch::Tensor margin_terms(const torch::Tensor& lengths, const torch::Tensor& targets,
                           const MarginLossOptions& o) {
  auto present = torch::relu(o.m_plus - lengths).pow(2);
  auto absent = torch::relu(lengths - o.m_minus).pow(2);
  return (targets * present + o.lambda * (1 - targets) * absent).sum(1).mean();
}
}  // namespace

torch::Tensor margin_loss(const torch::Tensor& lengths, const torch::Tensor& labels,
                          const MarginLossOptions& options) {
  TORCH_CHECK(lengths.dim() == 2, "margin_loss: lengths must be [B, K], got ", lengths.sizes());
  TORCH_CHECK(labels.dim() == 1 && labels.size(0) == lengths.size(0),
              "margin_loss: labels must be [B] with B = ", lengths.size(0), ", got ", labels.sizes());
  auto targets = torch::one_hot(labels.to(torch::kLong), lengths.size(1)).to(lengths.dtype());
  return margin_terms(lengths, targets, options);
}

torch::Tensor margin_loss_multi(const torch::Tensor& lengths, const torch::Tensor& targets,
                                const MarginLossOptions& options) {
  TORCH_CHECK(lengths.dim() == 2 && targets.sizes() == lengths.sizes(),
              "margin_loss_multi: lengths and targets must both be [B, K], got ", lengths.sizes(),
              " and ", targets.sizes());
  return margin_terms(lengths, targets.to(lengths.dtype()), options);
}

torch::Tensor mask(const torch::Tensor& v, const torch::Tensor& index) {
  TORCH_CHECK(v.dim() == 3, "mask: v must be [B, J, D], got ", v.sizes());
  TORCH_CHECK(index.dim() == 1 && index.size(0) == v.size(0),
              "mask: index must be [B] with B = ", v.size(0), ", got ", index.sizes());
  auto keep = torch::one_hot(index.to(torch::kLong), v.size(1)).to(v.dtype()).unsqueeze(-1);
  return (v * keep).flatten(1);  // [B, J * D]
}

torch::Tensor reconstruction_loss(const torch::Tensor& reconstruction, const torch::Tensor& target,
                                  double scale) {
  auto t = target.reshape({target.size(0), -1}).to(reconstruction.dtype());
  TORCH_CHECK(t.sizes() == reconstruction.sizes(), "reconstruction_loss: reconstruction ",
              reconstruction.sizes(), " does not match target ", target.sizes());
  return scale * (reconstruction - t).pow(2).sum(1).mean();
}

namespace detail {
void check_routing_args(const torch::Tensor& u_hat, const RoutingOptions& options) {
  TORCH_CHECK(u_hat.dim() == 4, "dynamic routing: u_hat must be [B, I, J, D], got ", u_hat.sizes());
  TORCH_CHECK(u_hat.is_floating_point(), "dynamic routing: u_hat must be floating point, got ",
              u_hat.scalar_type());
  options.validate();
}
}  // namespace detail

void RoutingOptions::validate() const {
  if (iterations < 1)
    throw std::invalid_argument("routing iterations must be >= 1, got " + std::to_string(iterations));
}

namespace detail {

torch::Tensor reference_routing(const torch::Tensor& u_hat, const RoutingOptions& options) {
  check_routing_args(u_hat, options);
  // The stop-gradient variant routes on detached predictions; only the final s_j sees u_hat.
  auto u_route = options.grad_through_routing ? u_hat : u_hat.detach();
  auto b = torch::zeros({u_hat.size(0), u_hat.size(1), u_hat.size(2)}, u_hat.options());  // [B, I, J]
  torch::Tensor v;                                                                           // [B, J, D]
  for (int64_t t = 0; t < options.iterations; ++t) {
    const bool last = t + 1 == options.iterations;
    auto c = torch::softmax(b, /*dim=*/2);                                   // c_i = softmax_j(b_i)
    auto s = (c.unsqueeze(-1) * (last ? u_hat : u_route)).sum(1);            // s_j = sum_i c_ij u_hat_{j|i}
    v = squash(s);                                                           // v_j = squash(s_j)
    if (!last) {
      auto v_route = options.grad_through_routing ? v : v.detach();
      b = b + (u_route * v_route.unsqueeze(1)).sum(-1);                      // b_ij += u_hat_{j|i} . v_j
    }
  }
  return v;
}
}  // namespace detail

torch::Tensor dynamic_routing(const torch::Tensor& u_hat, const RoutingOptions& options) {
  detail::check_routing_args(u_hat, options);
  const auto B = u_hat.size(0), I = u_hat.size(1), J = u_hat.size(2), D = u_hat.size(3);
  // Parent-major layout so that every sum over i or d is one batched matmul.
  auto u_jid = u_hat.permute({0, 2, 1, 3}).contiguous().view({B * J, I, D});  // [B*J, I, D]
  auto u_route = options.grad_through_routing ? u_jid : u_jid.detach();

  auto logits = torch::zeros({B, J, I}, u_hat.options());  // b_ij, parent-major
  torch::Tensor v;                                          // [B, J, D]
  for (int64_t t = 0; t < options.iterations; ++t) {
    const bool last = t + 1 == options.iterations;
    auto c = torch::softmax(logits, /*dim=*/1).view({B * J, 1, I});        // over parents j
    auto s = torch::bmm(c, last ? u_jid : u_route).view({B, J, D});        // s_j = sum_i c_ij u_hat
    v = squash(s);
    if (!last) {
      auto v_route = options.grad_through_routing ? v : v.detach();
      // agreement u_hat_{j|i} . v_j: [B*J, I, D] x [B*J, D, 1]
      logits = logits + torch::bmm(u_route, v_route.reshape({B * J, D, 1})).view({B, J, I});
    }
  }
  return v;
}

}  // namespace capsnet
