#pragma once
// EM routing between matrix capsules (Hinton, Sabour & Frosst, "Matrix capsules with EM routing",
// ICLR 2018), as free functions on tensors.
// Paper symbol -> code: V_ij = votes[b, i, j, :]; a_i = activations_in; beta_u, beta_a = beta_u, beta_a;
// lambda_t = EmRoutingOptions::inverse_temperature (default: the authors' schedule
// lambda_t = 0.01 (1 - 0.95^(t+1)), paper_inverse_temperature_schedule); R_ij = assignment probabilities
// (internal; EmRoutingOptions::child_log_total says over which parents a child's R sums to 1);
// mu_j, a_j = EmRoutingResult::poses, ::activations; Procedure 1 = em_routing (fast) /
// detail::reference_em_routing (oracle). Spread loss (Sec. 3.1) = spread_loss, margin schedule = spread_margin.

#include <torch/torch.h>

#include <functional>
#include <vector>

namespace capsnet {

/// lambda_0 of the authors' inverse-temperature schedule (their review answers: "final lambda" 0.01).
inline constexpr double kPaperLambdaBase = 0.01;

/// Options of EM routing (Procedure 1).
struct EmRoutingOptions {
  /// Routing iterations t (the paper uses 3). Each runs an M-step; all but the last are followed by an
  /// E-step (an E-step after the final M-step would not change mu or a, which are returned).
  int64_t iterations = 3;
  /// Inverse temperature lambda_t of the logistic, one per iteration. Empty: the authors' schedule
  /// paper_inverse_temperature_schedule(iterations, kPaperLambdaBase), i.e. 0.01 (1 - 0.95^(t+1)).
  /// (Older checkpoints: empty meant lambda = 1, the regime in which training collapsed.)
  std::vector<double> inverse_temperature;
  /// true: a_j = logistic(beta_a - lambda_t sum_h cost^h): beta_a is a logit offset that Adam moves at
  /// its own scale. false (the earlier routing): a_j = logistic(lambda_t (beta_a - sum_h cost^h)), where a
  /// small lambda also shrinks beta_a's effect and its gradient.
  bool logit_offset_outside_lambda = true;
  /// Over which parents a child's R sums to 1 in the E-step. Given log_weights = log(a_j p_ij):
  /// [B, I, J], returns log of each child's total over all its parents, broadcastable to [B, I, J]
  /// (e.g. [B, I, 1]); R_ij = exp(log_weights - child_log_total(log_weights)). The initial R is
  /// exp(-child_log_total(zeros)): uniform over all of the child's parents. Empty: the J parents of
  /// its own routing problem (logsumexp over j, R_ij = 1/J at first). A convolutional layer passes a
  /// fold over overlapping windows (nn::ConvMatrixCaps) so that a child splits its unit of vote over
  /// every parent of every window that contains it.
  std::function<torch::Tensor(const torch::Tensor&)> child_log_total;
  /// Added to every variance (sigma_j^h)^2 before its log and before dividing by it: keeps cost, the
  /// Gaussian log-likelihood and their gradients finite when the votes of a parent coincide.
  double variance_eps = 1e-4;
  /// Added to sum_i R_ij before dividing by it (a parent that received no mass).
  double mass_eps = 1e-8;
  /// false (paper): cost^h = (beta_u + log sigma_j^h) * sum_i R_ij. true: sum_i R_ij is multiplied by
  /// J / I (its value relative to a uniform share), so the cost does not grow with the number of
  /// children I and the logistic does not saturate in wide layers. Not in the paper.
  bool normalize_cost = false;
  /// true: before the logistic, each problem's costs c_j = sum_h cost^h are standardised over its J
  /// parents, c_j <- (c_j - mean_k c_k) / sqrt(var_k c_k + cost_std_eps), so a_j depends on how well
  /// parent j's votes agree relative to its rivals and the logit's range does not depend on the layer's
  /// width, the pose scale or variance_eps. Not in the paper (public TensorFlow reimplementations of the
  /// paper do it, with lambda of order 1); with the paper's lambda (<= 0.0014) it leaves a_j at
  /// logistic(beta_a). J = 1 gives c = 0.
  bool standardize_cost = false;
  /// Added to the variance of the costs over the parents (standardize_cost): equal costs give 0, not 0/0.
  double cost_std_eps = 1e-6;
  /// true: the passes over the votes (the M-step's weighted mean and variance, the E-step's scaled
  /// distance) run in the fused operators of ops/em.h, for float32 / float64 CPU votes; other votes
  /// use the composite form. false: always the composite ATen form (kept for comparison and tests).
  /// Both compute the same values (to rounding) and gradients.
  bool fused_vote_passes = true;
};

/// lambda_t linear from `first` (t = 1) to `last` (t = iterations); `first` when iterations == 1.
std::vector<double> inverse_temperature_schedule(int64_t iterations, double first, double last);

/// The authors' schedule (OpenReview answers to the ICLR 2018 reviews): lambda_t = base (1 - 0.95^(t+1))
/// for the 0-based routing iteration t = 0 .. iterations - 1 (0.0005, 0.000975, 0.00142625 for base 0.01).
/// Throws std::invalid_argument if iterations < 1 or base <= 0.
std::vector<double> paper_inverse_temperature_schedule(int64_t iterations, double base = kPaperLambdaBase);

/// Output of em_routing.
struct EmRoutingResult {
  torch::Tensor poses;        // mu: [B, J, D] (the parents' pose means, e.g. D = 16 for 4x4 matrices)
  torch::Tensor activations;  // a: [B, J] in (0, 1)
};

/// EM routing (Procedure 1), independently for each of the B routing problems:
///   R_ij = 1/J; repeat: M-step for every parent j:
///     R'_ij = R_ij a_i,  mu_j^h = sum_i R'_ij V_ij^h / sum_i R'_ij,
///     (sigma_j^h)^2 = sum_i R'_ij (V_ij^h - mu_j^h)^2 / sum_i R'_ij  (+ variance_eps),
///     cost^h = (beta_u + log sigma_j^h) sum_i R'_ij,
///     a_j = logistic(beta_a - lambda_t sum_h cost^h)  (logit_offset_outside_lambda; else
///           logistic(lambda_t (beta_a - sum_h cost^h)); with standardize_cost the sums over h are first
///           standardised over the J parents);
///   E-step for every child i:
///     p_ij = N(V_ij; mu_j, diag sigma_j^2),  R_ij = a_j p_ij / sum_k a_k p_ik
///     (k over the J parents, or over all the child's parents given by options.child_log_total).
/// The E-step runs in log space (log a_j = logsigmoid, log p_ij, normalised by a logsumexp): no exp
/// underflow.
/// votes: [B, I, J, D]; activations_in: [B, I] in [0, 1]; beta_u, beta_a: [J] or one element
/// (shared). Gradients flow through every step (R included). Throws std::invalid_argument naming the
/// bad argument for wrong ranks, mismatched sizes, non-floating dtypes, iterations < 1 or a schedule
/// of the wrong length.
EmRoutingResult em_routing(const torch::Tensor& votes, const torch::Tensor& activations_in,
                           const torch::Tensor& beta_u, const torch::Tensor& beta_a,
                           const EmRoutingOptions& options = {});

/// Spread-loss margin m at `step` of `total_steps`: linear from m_start (step 0) to m_end (step >=
/// total_steps - 1); the paper anneals 0.2 -> 0.9. Throws std::invalid_argument if total_steps < 1.
double spread_margin(int64_t step, int64_t total_steps, double m_start = 0.2, double m_end = 0.9);

/// Spread loss (Sec. 3.1): L = sum_{i != t} max(0, m - (a_t - a_i))^2 per example, averaged over the
/// batch. activations: [B, K]; labels: [B] int64 in [0, K). Returns a scalar. Throws
/// std::invalid_argument naming the bad argument (shapes, label range, margin < 0).
torch::Tensor spread_loss(const torch::Tensor& activations, const torch::Tensor& labels, double margin);

namespace detail {
/// Slow, obviously-correct Procedure 1 written from the paper's equations with explicit loops over the
/// example b, children i, parents j and pose elements h on scalar tensors (autograd works through it,
/// so it is also the gradient oracle). Computes p_j with exp directly, as in the paper (fine for the
/// tiny, well-scaled inputs of the tests). Same arguments and result as em_routing; throws
/// std::invalid_argument if options.child_log_total is set (its geometry is the caller's: see
/// nn::detail::reference_conv_em_routing for the convolutional one).
EmRoutingResult reference_em_routing(const torch::Tensor& votes, const torch::Tensor& activations_in,
                                     const torch::Tensor& beta_u, const torch::Tensor& beta_a,
                                     const EmRoutingOptions& options = {});

/// Throws std::invalid_argument naming the bad argument unless the arguments fit em_routing.
void check_em_routing_args(const torch::Tensor& votes, const torch::Tensor& activations_in,
                           const torch::Tensor& beta_u, const torch::Tensor& beta_a, const EmRoutingOptions& options);

/// The loop form of standardize_over_parents for the references: one scalar tensor per parent.
std::vector<torch::Tensor> reference_standardize(const std::vector<torch::Tensor>& cost, double eps);

/// standardize_cost: cost [B, J] -> (cost - mean_j) / sqrt(var_j + eps), mean and (biased) variance over
/// dim 1. Used by em_routing; the references standardise with scalar loops of their own.
torch::Tensor standardize_over_parents(const torch::Tensor& cost, double eps);

/// lambda of iteration t (0-based) under `options`.
double inverse_temperature_at(const EmRoutingOptions& options, int64_t t);
}  // namespace detail

}  // namespace capsnet
