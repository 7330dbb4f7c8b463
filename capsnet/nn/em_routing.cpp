#include "capsnet/nn/em_routing.h"

#include <fmt/format.h>

#include <cmath>
#include <stdexcept>
#include <string>
#include <tuple>

#include "capsnet/ops/em.h"

namespace capsnet {
namespace {

std::string shape_string(const torch::Tensor& t) {
  std::string s = "[";
  for (int64_t d = 0; d < t.dim(); ++d) s += (d ? ", " : "") + std::to_string(t.size(d));
  return s + "]";
}

// beta: [J] or one element -> [J] (a view; broadcasts the shared value).
torch::Tensor per_parent(const torch::Tensor& beta, int64_t J) {
  return beta.numel() == 1 ? beta.reshape({1}).expand({J}) : beta.reshape({J});
}

}  // namespace

std::vector<double> inverse_temperature_schedule(int64_t iterations, double first, double last) {
  if (iterations < 1) throw std::invalid_argument(fmt::format("iterations must be >= 1, got {}", iterations));
  if (!(first > 0) || !(last > 0))
    throw std::invalid_argument(fmt::format("inverse temperatures must be > 0, got {} and {}", first, last));
  std::vector<double> out(static_cast<size_t>(iterations));
  for (int64_t t = 0; t < iterations; ++t)
    out[static_cast<size_t>(t)] = iterations == 1 ? first : first + (last - first) * t / double(iterations - 1);
  return out;
}

std::vector<double> paper_inverse_temperature_schedule(int64_t iterations, double base) {
  if (iterations < 1) throw std::invalid_argument(fmt::format("iterations must be >= 1, got {}", iterations));
  if (!(base > 0)) throw std::invalid_argument(fmt::format("the inverse temperature base must be > 0, got {}", base));
  std::vector<double> out(static_cast<size_t>(iterations));
  for (int64_t t = 0; t < iterations; ++t)
    out[static_cast<size_t>(t)] = base * (1.0 - std::pow(0.95, double(t + 1)));
  return out;
}

namespace detail {

double inverse_temperature_at(const EmRoutingOptions& options, int64_t t) {
  if (options.inverse_temperature.empty()) return kPaperLambdaBase * (1.0 - std::pow(0.95, double(t + 1)));
  return options.inverse_temperature[static_cast<size_t>(t)];
}

void check_em_routing_args(const torch::Tensor& votes, const torch::Tensor& activations_in,
                           const torch::Tensor& beta_u, const torch::Tensor& beta_a,
                           const EmRoutingOptions& options) {
  if (!votes.defined() || votes.dim() != 4)
    throw std::invalid_argument("em_routing: votes must be [B, I, J, D], got " +
                                (votes.defined() ? shape_string(votes) : std::string("undefined")));
  if (!votes.is_floating_point()) throw std::invalid_argument("em_routing: votes must be floating point");
  const auto B = votes.size(0), I = votes.size(1), J = votes.size(2), D = votes.size(3);
  if (I < 1 || J < 1 || D < 1)
    throw std::invalid_argument("em_routing: votes needs I, J, D >= 1, got " + shape_string(votes));
  if (!activations_in.defined() || activations_in.dim() != 2 || activations_in.size(0) != B ||
      activations_in.size(1) != I)
    throw std::invalid_argument(fmt::format("em_routing: activations_in must be [B, I] = [{}, {}], got {}", B, I,
                                            activations_in.defined() ? shape_string(activations_in) : "undefined"));
  if (activations_in.scalar_type() != votes.scalar_type())
    throw std::invalid_argument("em_routing: activations_in must have the dtype of votes");
  for (const auto& [name, beta] : {std::pair<const char*, const torch::Tensor&>{"beta_u", beta_u}, {"beta_a", beta_a}}) {
    if (!beta.defined() || !(beta.numel() == 1 || (beta.dim() == 1 && beta.size(0) == J)))
      throw std::invalid_argument(fmt::format("em_routing: {} must be [J] = [{}] or one element, got {}", name, J,
                                              beta.defined() ? shape_string(beta) : "undefined"));
    if (beta.scalar_type() != votes.scalar_type())
      throw std::invalid_argument(fmt::format("em_routing: {} must have the dtype of votes", name));
  }
  if (options.iterations < 1)
    throw std::invalid_argument(fmt::format("em_routing: iterations must be >= 1, got {}", options.iterations));
  if (!options.inverse_temperature.empty() &&
      static_cast<int64_t>(options.inverse_temperature.size()) != options.iterations)
    throw std::invalid_argument(fmt::format("em_routing: inverse_temperature has {} entries, iterations is {}",
                                            options.inverse_temperature.size(), options.iterations));
  if (!(options.variance_eps > 0))
    throw std::invalid_argument(fmt::format("em_routing: variance_eps must be > 0, got {}", options.variance_eps));
  if (!(options.mass_eps > 0))
    throw std::invalid_argument(fmt::format("em_routing: mass_eps must be > 0, got {}", options.mass_eps));
  if (!(options.cost_std_eps > 0))
    throw std::invalid_argument(fmt::format("em_routing: cost_std_eps must be > 0, got {}", options.cost_std_eps));
}

torch::Tensor standardize_over_parents(const torch::Tensor& cost, double eps) {
  const auto centred = cost - cost.mean(1, /*keepdim=*/true);                // [B, J]
  return centred / torch::sqrt(centred.pow(2).mean(1, /*keepdim=*/true) + eps);  // [B, J]
}

std::vector<torch::Tensor> reference_standardize(const std::vector<torch::Tensor>& cost, double eps) {
  const double J = double(cost.size());
  auto mean = torch::zeros_like(cost[0]);
  for (const auto& c : cost) mean = mean + c / J;
  auto variance = torch::zeros_like(cost[0]);
  for (const auto& c : cost) variance = variance + (c - mean).pow(2) / J;
  std::vector<torch::Tensor> out;
  for (const auto& c : cost) out.push_back((c - mean) / torch::sqrt(variance + eps));
  return out;
}

EmRoutingResult reference_em_routing(const torch::Tensor& votes, const torch::Tensor& activations_in,
                                     const torch::Tensor& beta_u_in, const torch::Tensor& beta_a_in,
                                     const EmRoutingOptions& options) {
  check_em_routing_args(votes, activations_in, beta_u_in, beta_a_in, options);
  if (options.child_log_total)
    throw std::invalid_argument(
        "reference_em_routing: options.child_log_total is set; the per-problem reference normalises over j only");
  const auto B = votes.size(0), I = votes.size(1), J = votes.size(2), D = votes.size(3);
  const auto beta_u = per_parent(beta_u_in, J), beta_a = per_parent(beta_a_in, J);
  const double mass_scale = options.normalize_cost ? double(J) / double(I) : 1.0;
  const auto zero = torch::zeros({}, votes.options());
  using Row = std::vector<torch::Tensor>;

  std::vector<torch::Tensor> poses_b, acts_b;
  for (int64_t b = 0; b < B; ++b) {
    std::vector<Row> R(I, Row(J));
    for (int64_t i = 0; i < I; ++i)
      for (int64_t j = 0; j < J; ++j) R[i][j] = torch::full({}, 1.0 / J, votes.options());
    std::vector<Row> mu(J, Row(D)), var(J, Row(D));
    Row a(J);
    for (int64_t t = 0; t < options.iterations; ++t) {
      const double lambda = inverse_temperature_at(options, t);
      // M-step, one parent at a time.
      Row cost(J, zero);
      for (int64_t j = 0; j < J; ++j) {
        Row Ra(I);
        auto sum_R = zero;
        for (int64_t i = 0; i < I; ++i) {
          Ra[i] = R[i][j] * activations_in[b][i];
          sum_R = sum_R + Ra[i];
        }
        for (int64_t h = 0; h < D; ++h) {
          auto num = zero;
          for (int64_t i = 0; i < I; ++i) num = num + Ra[i] * votes[b][i][j][h];
          mu[j][h] = num / (sum_R + options.mass_eps);
          auto sq = zero;
          for (int64_t i = 0; i < I; ++i) sq = sq + Ra[i] * (votes[b][i][j][h] - mu[j][h]).pow(2);
          var[j][h] = sq / (sum_R + options.mass_eps) + options.variance_eps;
          const auto log_sigma = 0.5 * torch::log(var[j][h]);
          cost[j] = cost[j] + (beta_u[j] + log_sigma) * sum_R * mass_scale;
        }
      }
      if (options.standardize_cost) cost = reference_standardize(cost, options.cost_std_eps);
      for (int64_t j = 0; j < J; ++j)
        a[j] = options.logit_offset_outside_lambda ? torch::sigmoid(beta_a[j] - lambda * cost[j])
                                                   : torch::sigmoid(lambda * (beta_a[j] - cost[j]));
      if (t == options.iterations - 1) break;
      // E-step, one child at a time.
      for (int64_t i = 0; i < I; ++i) {
        Row ap(J);
        auto total = zero;
        for (int64_t j = 0; j < J; ++j) {
          auto exponent = zero;
          auto norm = torch::ones({}, votes.options());
          for (int64_t h = 0; h < D; ++h) {
            exponent = exponent - (votes[b][i][j][h] - mu[j][h]).pow(2) / (2 * var[j][h]);
            norm = norm * (2 * M_PI * var[j][h]);
          }
          const auto p = torch::exp(exponent) / torch::sqrt(norm);
          ap[j] = a[j] * p;
          total = total + ap[j];
        }
        for (int64_t j = 0; j < J; ++j) R[i][j] = ap[j] / total;
      }
    }
    Row pose_rows;
    for (int64_t j = 0; j < J; ++j) pose_rows.push_back(torch::stack(mu[j]));
    poses_b.push_back(torch::stack(pose_rows));  // [J, D]
    acts_b.push_back(torch::stack(a));           // [J]
  }
  return {torch::stack(poses_b), torch::stack(acts_b)};
}

}  // namespace detail

EmRoutingResult em_routing(const torch::Tensor& votes, const torch::Tensor& activations_in,
                           const torch::Tensor& beta_u_in, const torch::Tensor& beta_a_in,
                           const EmRoutingOptions& options) {
  detail::check_em_routing_args(votes, activations_in, beta_u_in, beta_a_in, options);
  const auto B = votes.size(0), I = votes.size(1), J = votes.size(2);
  const auto beta_u = per_parent(beta_u_in, J).view({1, J, 1});  // [1, J, 1]
  const auto beta_a = per_parent(beta_a_in, J).view({1, J});     // [1, J]
  const double mass_scale = options.normalize_cost ? double(J) / double(I) : 1.0;
  const auto a_in = activations_in.unsqueeze(2);  // [B, I, 1]

  // The fused vote passes read the votes once each; the composite form below makes several passes and
  // temporaries of the votes' size per iteration (docs/em.md).
  const bool fused = options.fused_vote_passes && votes.device().is_cpu() &&
                     (votes.scalar_type() == torch::kFloat || votes.scalar_type() == torch::kDouble);
  const auto V = fused ? votes.contiguous() : votes;  // [B, I, J, D], made contiguous once for every pass

  // R: [B, I, J], uniform over all of each child's parents.
  auto R = options.child_log_total ? torch::exp(-options.child_log_total(torch::zeros({B, I, J}, votes.options())))
                                         .expand({B, I, J})
                                   : torch::full({B, I, J}, 1.0 / J, votes.options());
  torch::Tensor mu, var, logit, sq;
  for (int64_t t = 0; t < options.iterations; ++t) {
    const double lambda = detail::inverse_temperature_at(options, t);
    // M-step.
    const auto Ra = R * a_in;                                                 // [B, I, J]
    const auto mass = Ra.sum(1);                                              // sum_i R_ij: [B, J]
    const auto weights = Ra / (mass.unsqueeze(1) + options.mass_eps);         // [B, I, J]
    if (fused) {
      torch::Tensor spread;
      std::tie(mu, spread) = ops::em_weighted_moments(weights, V);            // mu, sum_i w (V - mu)^2: [B, J, D]
      var = spread + options.variance_eps;                                    // sigma^2: [B, J, D]
    } else {
      mu = (weights.unsqueeze(3) * V).sum(1);                                 // mu: [B, J, D]
      sq = (V - mu.unsqueeze(1)).pow(2);                                      // (V - mu)^2: [B, I, J, D], the E-step's too
      var = (weights.unsqueeze(3) * sq).sum(1) + options.variance_eps;        // sigma^2: [B, J, D]
    }
    auto cost = ((beta_u + 0.5 * torch::log(var)) * (mass * mass_scale).unsqueeze(2)).sum(2);  // [B, J]
    if (options.standardize_cost) cost = detail::standardize_over_parents(cost, options.cost_std_eps);
    // Offset outside lambda: beta_a stays a logit of its own, so Adam's steps on it are not scaled by lambda.
    logit = options.logit_offset_outside_lambda ? beta_a - lambda * cost : lambda * (beta_a - cost);  // [B, J]
    if (t == options.iterations - 1) break;
    // E-step in log space: log(a_j p_ij) = logsigmoid(logit_j) + log N(V_ij; mu_j, sigma_j^2). The
    // log(2 pi sigma^2) term does not depend on i: summed over d on [B, J, D], not on [B, I, J, D].
    const auto distance = fused ? ops::em_scaled_distance(V, mu, var) : (sq / var.unsqueeze(1)).sum(3);  // [B, I, J]
    const auto log_p = -0.5 * (distance + torch::log(2 * M_PI * var).sum(2).unsqueeze(1));
    const auto log_weights = torch::log_sigmoid(logit).unsqueeze(1) + log_p;  // [B, I, J]
    R = options.child_log_total ? torch::exp(log_weights - options.child_log_total(log_weights))
                                : torch::softmax(log_weights, 2);  // [B, I, J]
  }
  return {mu, torch::sigmoid(logit)};
}

double spread_margin(int64_t step, int64_t total_steps, double m_start, double m_end) {
  if (total_steps < 1) throw std::invalid_argument(fmt::format("spread_margin: total_steps must be >= 1, got {}", total_steps));
  if (total_steps == 1 || step >= total_steps - 1) return m_end;
  if (step <= 0) return m_start;
  return m_start + (m_end - m_start) * double(step) / double(total_steps - 1);
}

torch::Tensor spread_loss(const torch::Tensor& activations, const torch::Tensor& labels, double margin) {
  if (!activations.defined() || activations.dim() != 2 || activations.size(1) < 2)
    throw std::invalid_argument("spread_loss: activations must be [B, K] with K >= 2, got " +
                                (activations.defined() ? shape_string(activations) : std::string("undefined")));
  if (!labels.defined() || labels.dim() != 1 || labels.size(0) != activations.size(0) ||
      labels.scalar_type() != torch::kLong)
    throw std::invalid_argument(fmt::format("spread_loss: labels must be int64 [B] = [{}]", activations.size(0)));
  if (labels.numel() > 0 && (labels.min().item<int64_t>() < 0 || labels.max().item<int64_t>() >= activations.size(1)))
    throw std::invalid_argument(fmt::format("spread_loss: labels must be in [0, {})", activations.size(1)));
  if (!(margin >= 0)) throw std::invalid_argument(fmt::format("spread_loss: margin must be >= 0, got {}", margin));
  const auto a_t = activations.gather(1, labels.unsqueeze(1));                 // [B, 1]
  const auto per_class = torch::relu(margin - (a_t - activations)).pow(2);     // [B, K]
  // The target class contributes max(0, m)^2 = m^2 to the sum above; i != t excludes it.
  const auto not_target = torch::ones_like(activations).scatter_(1, labels.unsqueeze(1), 0.0);
  return (per_class * not_target).sum(1).mean();
}

}  // namespace capsnet
