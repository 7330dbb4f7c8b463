#include "capsnet/train/weight_average.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <stdexcept>

namespace capsnet::train {

WeightAverage::WeightAverage(torch::nn::Module& model, double decay) : params_(model.parameters()), decay_(decay) {
  if (!(decay > 0 && decay < 1))
    throw std::invalid_argument(fmt::format("weight average: decay must be in (0, 1), got {}", decay));
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < params_.size(); ++i)
    averages_.emplace_back(fmt::format("p{}", i), params_[i].detach().clone());
}

double WeightAverage::decay_at(double decay, int64_t updates) {
  const double t = static_cast<double>(std::max<int64_t>(updates, 0));
  return std::min(decay, (1 + t) / (10 + t));
}

void WeightAverage::update(int64_t updates) {
  torch::NoGradGuard no_grad;
  const double d = decay_at(decay_, updates);
  for (size_t i = 0; i < params_.size(); ++i) averages_[i].second.mul_(d).add_(params_[i].detach(), 1 - d);
}

WeightAverage::Swap::Swap(WeightAverage& average) : params_(average.params_) {
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < params_.size(); ++i) {
    trained_.push_back(params_[i].detach().clone());
    params_[i].detach().copy_(average.averages_[i].second);  // bumps the version: weight caches refresh
  }
}

WeightAverage::Swap::~Swap() {
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < params_.size(); ++i) params_[i].detach().copy_(trained_[i]);
}

}  // namespace capsnet::train
