#include "capsnet/data/coloured_digits.h"

#include <fmt/format.h>

#include <stdexcept>

namespace capsnet::data {

ImageSet coloured_digits(const ImageSet& source, uint64_t seed, const ColouredDigitsOptions& options) {
  if (!source.images.defined() || source.images.dim() != 3 || source.images.scalar_type() != torch::kUInt8)
    throw std::invalid_argument("coloured_digits: source images must be grey uint8 [N, H, W]");
  const int64_t N = source.images.size(0), h = source.height(), w = source.width(), S = options.side;
  if (S < h || S < w)
    throw std::invalid_argument(fmt::format("coloured_digits: side {} is smaller than the {}x{} digits", S, w, h));
  if (!(options.min_contrast >= 0 && options.min_contrast <= 200))
    throw std::invalid_argument(fmt::format("coloured_digits: min_contrast must be in [0, 200], got {}",
                                            options.min_contrast));
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  // Colour pairs by rejection: redraw the pairs whose luma contrast is too low (a few rounds suffice).
  const auto luma = torch::tensor({0.299f, 0.587f, 0.114f});
  auto bg = torch::randint(0, 256, {N, 3}, gen, torch::kFloat);
  auto fg = torch::randint(0, 256, {N, 3}, gen, torch::kFloat);
  for (int round = 0; round < 1000; ++round) {
    auto low = ((fg - bg).matmul(luma).abs() < options.min_contrast).nonzero().flatten();
    if (low.numel() == 0) break;
    bg.index_put_({low}, torch::randint(0, 256, {low.numel(), 3}, gen, torch::kFloat));
    fg.index_put_({low}, torch::randint(0, 256, {low.numel(), 3}, gen, torch::kFloat));
  }
  auto canvas = torch::zeros({N, S, S}, torch::kFloat);  // digit intensity in [0, 1], centred
  canvas.narrow(1, (S - h) / 2, h).narrow(2, (S - w) / 2, w).copy_(source.images.to(torch::kFloat).div(255));
  auto a = canvas.unsqueeze(1);                               // [N, 1, S, S]
  auto b = bg.view({N, 3, 1, 1}), f = fg.view({N, 3, 1, 1});  // [N, 3, 1, 1]
  auto images = (b + (f - b) * a).round_().clamp_(0, 255).to(torch::kUInt8);  // [N, 3, S, S]
  return {images, source.labels, source.class_names};
}

}  // namespace capsnet::data
