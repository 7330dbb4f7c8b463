// The one TORCH_LIBRARY block of the `capsnet` operator namespace: every capsnet:: schema is declared
// here, kernels register per dispatch key elsewhere (cpu/, cuda/, autograd/).
#include <torch/library.h>

TORCH_LIBRARY(capsnet, m) {
  // Public operators (routing.h). u: [B, I, Din], W: [I, J, D, Din], u_hat: [B, I, J, D] -> v: [B, J, D].
  m.def("capsule_routing(Tensor u, Tensor W, int iterations, bool grad_through_routing) -> Tensor");
  m.def("routing_from_predictions(Tensor u_hat, int iterations, bool grad_through_routing) -> Tensor");

  // Internal: forward kernels that also return the routing state s_all: [B, r, J, D] (s_j^t of every
  // iteration, all the backward pass needs besides the inputs), and the backward kernels.
  m.def("_capsule_routing_forward(Tensor u, Tensor W, int iterations) -> (Tensor v, Tensor s_all)");
  m.def(
      "_capsule_routing_backward(Tensor grad_v, Tensor u, Tensor W, Tensor s_all, bool grad_through_routing)"
      " -> (Tensor grad_u, Tensor grad_W)");
  m.def("_routing_from_predictions_forward(Tensor u_hat, int iterations) -> (Tensor v, Tensor s_all)");
  m.def(
      "_routing_from_predictions_backward(Tensor grad_v, Tensor u_hat, Tensor s_all, bool grad_through_routing)"
      " -> Tensor grad_u_hat");

  // EM routing's passes over the votes (em.h). weights: [B, I, J], votes: [B, I, J, D],
  // mean / variance: [B, J, D], distance: [B, I, J].
  m.def("em_weighted_moments(Tensor weights, Tensor votes) -> (Tensor mean, Tensor variance)");
  m.def(
      "_em_weighted_moments_backward(Tensor grad_mean, Tensor grad_variance, Tensor weights, Tensor votes,"
      " Tensor mean) -> (Tensor grad_weights, Tensor grad_votes)");
  m.def("em_scaled_distance(Tensor votes, Tensor mean, Tensor variance) -> Tensor");
  m.def(
      "_em_scaled_distance_backward(Tensor grad_distance, Tensor votes, Tensor mean, Tensor variance)"
      " -> (Tensor grad_votes, Tensor grad_mean, Tensor grad_variance)");
}
