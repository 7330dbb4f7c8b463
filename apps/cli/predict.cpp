#include <fmt/format.h>
#include <fmt/ranges.h>

#include <filesystem>
#include <iostream>
#include <memory>

#include "capsnet/data/idx.h"
#include "capsnet/data/transforms.h"
#include "capsnet/train/checkpoint.h"
#include "apps/runtime.h"
#include "capsnet/viz/png.h"
#include "apps/cli/commands.h"

namespace capsnet::apps::cli {
namespace {

bool has_png_extension(const std::string& path) {
  auto ext = std::filesystem::path(path).extension().string();
  for (auto& ch : ext) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  return ext == ".png";
}

/// A PNG as the model's input: gray, white digit on black (inverted when `invert` says so or, for
/// "auto", when the background is light), resized to side x side. Returns uint8 [1, side, side].
torch::Tensor load_png_digit(const std::string& path, const std::string& invert, int64_t side) {
  auto img = viz::read_png_gray(path);  // [H, W]
  const bool light = img.to(torch::kFloat).mean().item<double>() > 127.5;
  if (invert == "yes" || (invert == "auto" && light)) img = 255 - img;
  if (img.size(0) != side || img.size(1) != side) {
    namespace F = torch::nn::functional;
    auto f = F::interpolate(img.to(torch::kFloat).unsqueeze(0).unsqueeze(0),
                            F::InterpolateFuncOptions()
                                .size(std::vector<int64_t>{side, side})
                                .mode(torch::kBilinear)
                                .align_corners(false));
    img = f.squeeze(0).squeeze(0).round().clamp(0, 255).to(torch::kUInt8);
  }
  return img.unsqueeze(0);
}

}  // namespace

Subcommand add_predict(CLI::App& root) {
  struct Flags {
    std::string checkpoint, invert = "auto";
    std::vector<std::string> inputs;
    int64_t limit = 20, batch_size = 256;
    bool json = false;
    int threads = 0;
    std::string precision = "fp32";
  };
  auto f = std::make_shared<Flags>();
  auto* app = root.add_subcommand("predict", "Classify digits from PNG images or an IDX image file");
  app->add_option("inputs", f->inputs, "PNG files and/or IDX image files ([N, 28, 28] uint8)")
      ->required()
      ->check(CLI::ExistingFile);
  app->add_option("--checkpoint", f->checkpoint, "Trained checkpoint (default: the shipped MNIST model, " + std::string(kShippedModel) + ")");
  app->add_option("--limit", f->limit, "At most N images from each IDX file (0 = all)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app->add_option("--invert", f->invert, "PNG: invert to white-on-black (auto: when the background is light)")
      ->check(CLI::IsMember({"auto", "yes", "no"}))
      ->capture_default_str();
  app->add_option("--batch-size", f->batch_size,
                  "Images per forward pass: memory stays bounded by one batch whatever the input size")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app->add_flag("--json", f->json, "One JSON object per image");
  add_threads_flag(*app, f->threads);
  add_precision_flag(*app, f->precision);

  return {app, [f]() {
            f->checkpoint = checkpoint_or_shipped(f->checkpoint);
            if (f->threads > 0) set_threads(f->threads);
            auto model = train::load_model(f->checkpoint);
            model->set_precision(nn::parse_precision(f->precision));
            const int64_t side = model->config.image_size;
            torch::NoGradGuard no_grad;
            for (const auto& path : f->inputs) {
              torch::Tensor images;  // [N, side, side] uint8
              if (has_png_extension(path)) {
                images = load_png_digit(path, f->invert, side);
              } else {
                images = data::read_idx(path);
                if (images.dim() == 2) images = images.unsqueeze(0);
                if (images.dim() != 3 || images.size(1) != side || images.size(2) != side)
                  throw std::invalid_argument(fmt::format("{}: expected IDX images [N, {}, {}], got {}", path, side,
                                                          side, fmt::join(images.sizes(), "x")));
                if (f->limit > 0) images = images.narrow(0, 0, std::min(f->limit, images.size(0)));
              }
              // Batched: activations of one batch at a time (the 60k-image file in ~0.5 GB, not ~90 GB).
              const int64_t n = images.size(0);
              for (int64_t start = 0; start < n; start += f->batch_size) {
                const int64_t len = std::min(f->batch_size, n - start);
                auto out = model(data::to_float(images.narrow(0, start, len)));
                auto lengths_all = out.lengths.contiguous();  // [len, K]
                auto pred = lengths_all.argmax(1);
                for (int64_t b = 0; b < len; ++b) {
                  const int64_t i = start + b;
                  auto lengths = lengths_all[b];
                  std::vector<double> lv(lengths.data_ptr<float>(), lengths.data_ptr<float>() + lengths.numel());
                  const int64_t p = pred[b].item<int64_t>();
                  const std::string name = n == 1 ? path : fmt::format("{}[{}]", path, i);
                  if (f->json) {
                    std::cout << nlohmann::json{{"input", name}, {"prediction", p}, {"lengths", lv}}.dump() << '\n';
                  } else {
                    std::cout << fmt::format("{}: {} (|v| = {:.3f}; lengths {:.2f})\n", name, p, lv[p],
                                             fmt::join(lv, " "));
                  }
                }
                std::cout.flush();
              }
            }
            return 0;
          }};
}

}  // namespace capsnet::apps::cli
