// kernels/cast_cache.h: the decoder's bf16 weights are cast once per weight update for inference (not per
// call, and again after an optimizer step or a load), every call under autograd casts afresh so that
// the gradient reaches the fp32 master, and the decoder's outputs are bit-identical to the uncached path.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "capsnet/kernels/cast_cache.h"
#include "capsnet/nn/decoder.h"
#include "capsnet/kernels/conv_dispatch.h"
#include "capsnet/kernels/fused_adam.h"

namespace capsnet {
namespace {


TEST(CastCache, KeepsOneCastPerWeightVersionWithoutAutograd) {
  torch::manual_seed(1);
  torch::nn::Linear linear(16, 8);
  const auto& w = linear->weight;
  kernels::CastCache cache;
  {
    torch::NoGradGuard no_grad;
    const auto a = cache.get(w, torch::kBFloat16);
    const auto b = cache.get(w, torch::kBFloat16);
    EXPECT_EQ(cache.casts(), 1);
    EXPECT_EQ(a.data_ptr(), b.data_ptr());  // the kept copy, not a new cast
    EXPECT_EQ(a.scalar_type(), torch::kBFloat16);
    EXPECT_TRUE(torch::equal(a, w.to(torch::kBFloat16)));
    w.add_(0.25);  // an in-place update (what an optimizer step does) must not leave a stale copy
    const auto c = cache.get(w, torch::kBFloat16);
    EXPECT_EQ(cache.casts(), 2);
    EXPECT_TRUE(torch::equal(c, w.to(torch::kBFloat16)));
    EXPECT_FALSE(torch::equal(c, a));
    EXPECT_EQ(cache.get(w, torch::kFloat32).data_ptr(), w.data_ptr());  // no cast to the master's own dtype
    EXPECT_FALSE(cache.get(torch::Tensor(), torch::kBFloat16).defined());
  }
  // Under autograd: a fresh cast in the graph, so the gradient reaches the fp32 weight; nothing kept.
  const auto d = cache.get(w, torch::kBFloat16);
  EXPECT_TRUE(d.requires_grad());
  EXPECT_EQ(cache.casts(), 2);
  d.to(torch::kFloat32).sum().backward();
  ASSERT_TRUE(w.grad().defined());
  EXPECT_TRUE(torch::equal(w.grad(), torch::ones_like(w)));
  // A copy (a cloned module's) starts empty.
  kernels::CastCache copy(cache);
  EXPECT_EQ(copy.casts(), 0);
}

// The decoder's three layers by the uncached linear_at of precision.h: what the decoder computed before.
torch::Tensor uncached_decoder(nn::Decoder& decoder, const torch::Tensor& x, Precision precision) {
  auto h = torch::relu(kernels::linear_at(decoder->fc1, x, precision));
  h = torch::relu(kernels::linear_at(decoder->fc2, h, precision));
  return torch::sigmoid(kernels::linear_at(decoder->fc3, h, precision).to(torch::kFloat32));
}

TEST(CastCache, DecoderOutputsAreBitIdenticalToTheUncachedPathAcrossTrainingSteps) {
  // A training loop's order: inference (copies kept), then forward under autograd (copies dropped),
  // backward, an optimizer step. SGD in LibTorch 1.13 updates p.data(), which bumps no version counter,
  // so only the dropping keeps the next inference call from using stale copies; Adam bumps it.
  torch::manual_seed(2);
  nn::Decoder decoder(nn::DecoderOptions(12, 20).hidden1(16).hidden2(32));
  torch::optim::SGD sgd(decoder->parameters(), torch::optim::SGDOptions(0.5));
  const auto x = torch::randn({3, 12});
  torch::Tensor previous;
  for (int step = 0; step < 3; ++step) {
    torch::Tensor expected;
    {
      torch::NoGradGuard no_grad;
      expected = uncached_decoder(decoder, x, Precision::kBFloat16);
      EXPECT_TRUE(torch::equal(decoder(x, Precision::kBFloat16), expected)) << "step " << step;
      EXPECT_TRUE(torch::equal(decoder(x, Precision::kBFloat16), expected)) << "step " << step << ", kept copy";
      if (previous.defined()) EXPECT_FALSE(torch::equal(expected, previous)) << "step " << step << " changed nothing";
      previous = expected;
    }
    const auto trained = decoder(x, Precision::kBFloat16);  // under autograd: a fresh cast, copies dropped
    EXPECT_TRUE(torch::equal(trained.detach(), expected)) << "step " << step;
    sgd.zero_grad();
    (trained - 0.5).square().sum().backward();  // a target inside (0, 1): the sigmoid stays unsaturated
    sgd.step();
  }
  // Adam bumps the version counters: no forward under autograd needed between its step and inference.
  // Both LibTorch's and the fused one the training loops use (which writes through raw pointers).
  torch::optim::Adam libtorch_adam(decoder->parameters(), torch::optim::AdamOptions(0.1));
  const auto fused_adam = kernels::make_adam(decoder->parameters(), torch::optim::AdamOptions(0.1));
  for (auto* adam : {&libtorch_adam, fused_adam.get()}) {
    adam->zero_grad();
    (decoder(x, Precision::kBFloat16) - 0.5).square().sum().backward();
    torch::NoGradGuard no_grad;
    const auto before = decoder(x, Precision::kBFloat16);
    adam->step();
    const auto after = decoder(x, Precision::kBFloat16);
    EXPECT_FALSE(torch::equal(after, before)) << (adam == &libtorch_adam ? "LibTorch's Adam" : "FusedAdam");
    EXPECT_TRUE(torch::equal(after, uncached_decoder(decoder, x, Precision::kBFloat16)));
  }
  // A clone serves its own weights.
  auto clone = std::dynamic_pointer_cast<nn::DecoderImpl>(decoder->clone());
  torch::NoGradGuard no_grad;
  for (auto& p : clone->parameters()) p.mul_(0.5);
  nn::Decoder cloned(clone);
  EXPECT_TRUE(torch::equal(cloned(x, Precision::kBFloat16), uncached_decoder(cloned, x, Precision::kBFloat16)));
  EXPECT_TRUE(torch::equal(decoder(x, Precision::kBFloat16), uncached_decoder(decoder, x, Precision::kBFloat16)));
}

}  // namespace
}  // namespace capsnet
