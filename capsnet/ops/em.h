#pragma once
// EM routing's passes over the votes (Hinton, Sabour & Frosst 2018, Procedure 1), as two fused
// operators registered with the dispatcher (library.cpp): each reads the votes once per call where
// the composite ATen form made several passes and temporaries of their size per routing iteration
// (docs/em.md, "Speed of the training step"). capsnet::em_routing (nn/em_routing.h) calls them for
// float32 / float64 CPU votes; the rest of EM routing works on tensors 1/D of the votes' size.
//
// Per routing problem b, child i, parent j, pose entry d (w = the M-step's normalised weights
// R_ij a_i / (sum_i R_ij a_i + eps), so sum_i w_ij <= 1):
//   em_weighted_moments:  mean_jd = sum_i w_ij V_ijd,  variance_jd = sum_i w_ij (V_ijd - mean_jd)^2
//   em_scaled_distance:   distance_ij = sum_d (V_ijd - mean_jd)^2 / variance_jd
// Both are differentiable in every input (first order; a double backward is refused). From Python:
//   torch.ops.load_library("libcapsnet_ops.so"); torch.ops.capsnet.em_weighted_moments(w, V)

#include <ATen/core/Tensor.h>

#include <tuple>

namespace capsnet::ops {

/// weights: [B, I, J], votes: [B, I, J, D] (same dtype float32/float64, same device).
/// Returns (mean, variance): [B, J, D] each; the variance has no floor added (the caller adds its eps).
std::tuple<at::Tensor, at::Tensor> em_weighted_moments(const at::Tensor& weights, const at::Tensor& votes);

/// votes: [B, I, J, D]; mean, variance: [B, J, D] (variance > 0). Returns distance: [B, I, J], the
/// variance-scaled squared distance of each vote from its parent's mean (the E-step's Gaussian
/// exponent times -2).
at::Tensor em_scaled_distance(const at::Tensor& votes, const at::Tensor& mean, const at::Tensor& variance);

}  // namespace capsnet::ops
