// The C++ half of python.torchscript: loads a TorchScript module written by `python3 -m
// capsnet.torchscript` with torch::jit::load (the op library is linked, so torch.ops.capsnet resolves)
// and compares its outputs with the C++ model built from the same weight file.
//   usage: capsnet_check_torchscript MODEL.ts WEIGHTS.pt
#include <torch/script.h>
#include <torch/torch.h>

#include <cstdio>
#include <exception>

#include "capsnet/train/checkpoint.h"

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: %s MODEL.ts WEIGHTS.pt\n", argv[0]);
    return 2;
  }
  try {
    auto scripted = torch::jit::load(argv[1]);
    scripted.eval();
    auto model = capsnet::train::load_model(argv[2]);  // eval mode, fp32
    const auto& c = model->config;
    torch::manual_seed(5);
    auto images = torch::rand({3, c.image_channels, c.image_size, c.image_size});  // [3, C, S, S]
    torch::NoGradGuard no_grad;
    auto got = scripted.forward({images}).toTuple()->elements();
    auto want = model->forward(images);
    const char* names[] = {"digit_caps", "lengths", "reconstruction"};
    const torch::Tensor expected[] = {want.digit_caps, want.lengths, want.reconstruction};
    int failures = 0;
    for (int i = 0; i < 3; ++i) {
      auto t = got[i].toTensor();
      const bool same_shape = t.sizes() == expected[i].sizes();
      const double diff = same_shape ? (t - expected[i]).abs().max().item<double>() : -1;
      std::printf("%s: max |torchscript - C++| = %.3g\n", names[i], diff);
      if (!same_shape || diff > 1e-4) ++failures;
    }
    if (failures) std::fprintf(stderr, "FAIL: %d output(s) differ from the C++ model\n", failures);
    return failures ? 1 : 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "FAIL: %s\n", e.what());
    return 1;
  }
}
