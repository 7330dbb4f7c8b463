#pragma once
// An exponential moving average of a model's parameters (Polyak averaging, "EMA weights"): what a training
// run with LoopOptions::ema_decay > 0 evaluates, selects best.pt by and ships, beside the weights it trains.
// After the t-th optimizer step every average a of a parameter p moves to
//   a <- d_t a + (1 - d_t) p,   d_t = min(decay, (1 + t) / (10 + t)),
// the warm-up of TensorFlow's ExponentialMovingAverage (num_updates), so that the early average is not
// dominated by the initial weights. d_t depends only on t, so a run resumed from a checkpoint that holds the
// average continues it exactly. The average is kept in the parameters' dtype (fp32) on their device.

#include <torch/torch.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace capsnet::train {

/// Tensors a checkpoint keeps beside its model, by name (checkpoint.h).
using NamedTensors = std::vector<std::pair<std::string, torch::Tensor>>;

class WeightAverage {
 public:
  /// Starts at `model`'s current parameters. decay in (0, 1).
  WeightAverage(torch::nn::Module& model, double decay);

  /// The factor d_t after the t-th optimizer step (t >= 1).
  static double decay_at(double decay, int64_t updates);
  /// Moves the average towards the model's parameters after its `updates`-th optimizer step.
  void update(int64_t updates);

  /// The averages, named "p0", "p1", ... in the model's parameter order, for save_checkpoint / load_checkpoint.
  NamedTensors& tensors() { return averages_; }
  double decay() const { return decay_; }

  /// While alive, the model's parameters hold the average; the trained weights are back when it ends.
  class Swap {
   public:
    explicit Swap(WeightAverage& average);
    ~Swap();
    Swap(const Swap&) = delete;
    Swap& operator=(const Swap&) = delete;

   private:
    std::vector<torch::Tensor> params_, trained_;
  };

 private:
  std::vector<torch::Tensor> params_;  // the model's parameters (shared storage)
  NamedTensors averages_;
  double decay_;
};

}  // namespace capsnet::train
