#include "capsnet/viz/perturbation.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

#include "capsnet/viz/figures.h"

namespace capsnet::viz {

std::vector<double> default_perturbation_offsets() { return symmetric_offsets(0.25, 5); }

std::vector<double> symmetric_offsets(double max_offset, int64_t steps) {
  if (!(max_offset > 0) || !std::isfinite(max_offset))
    throw std::invalid_argument(fmt::format("perturbation: max offset must be positive, got {}", max_offset));
  if (steps < 1) throw std::invalid_argument(fmt::format("perturbation: steps must be >= 1, got {}", steps));
  std::vector<double> offsets;
  // (i - steps) * step rather than an accumulated sum, so the middle offset is exactly 0.
  for (int64_t i = 0; i <= 2 * steps; ++i) offsets.push_back(static_cast<double>(i - steps) * max_offset / steps);
  return offsets;
}

Perturbation perturb_capsule(models::CapsNet& model, const torch::Tensor& image, const PerturbationOptions& options) {
  const auto& cfg = model->config;
  TORCH_CHECK(model->decoder, "perturb_capsule: this model has no decoder (trained without reconstruction)");
  TORCH_CHECK(cfg.image_channels == 1, "perturb_capsule: only single-channel models are supported, got ",
              cfg.image_channels, " channels");
  TORCH_CHECK(image.defined() && image.is_floating_point(), "perturb_capsule: image must be a float tensor in [0, 1]",
              image.defined() ? fmt::format(", got {}", std::string(c10::toString(image.scalar_type()))) : "");
  const int64_t S = cfg.image_size;
  const bool shape_ok = (image.dim() == 2 && image.size(0) == S && image.size(1) == S) ||
                        (image.dim() == 3 && image.size(0) == 1 && image.size(1) == S && image.size(2) == S);
  TORCH_CHECK(shape_ok, "perturb_capsule: image must be [1, ", S, ", ", S, "] or [", S, ", ", S, "], got ",
              image.sizes());
  const double lo = image.min().item<double>(), hi = image.max().item<double>();
  TORCH_CHECK(lo >= 0.0 && hi <= 1.0, "perturb_capsule: image values must be in [0, 1], got [", lo, ", ", hi, "]");
  TORCH_CHECK(!options.offsets.empty(), "perturb_capsule: no offsets");
  for (double o : options.offsets) TORCH_CHECK(std::isfinite(o), "perturb_capsule: offset ", o, " is not finite");
  if (options.capsule)
    TORCH_CHECK(*options.capsule >= 0 && *options.capsule < cfg.num_classes, "perturb_capsule: capsule ",
                *options.capsule, " is out of range [0, ", cfg.num_classes, ")");

  torch::NoGradGuard no_grad;
  // Eval mode for the forward pass, and the caller's mode back afterwards even if decoding throws.
  struct ModeGuard {
    models::CapsNet& m;
    bool training;
    ~ModeGuard() { m->train(training); }
  } mode{model, model->is_training()};
  model->eval();

  Perturbation p;
  p.offsets = options.offsets;
  const auto param = model->parameters().front();
  auto x = image.reshape({1, 1, S, S}).to(param.device(), param.scalar_type());  // [1, 1, S, S]
  auto u = model->primary_caps(torch::relu(model->conv1(x)));                    // [1, I, Din]
  auto v = model->digit_caps(u);                                                 // [1, J, D]
  p.digit_caps = v[0];                                                           // [J, D]
  p.lengths = capsule_length(p.digit_caps);                                      // [J]
  p.prediction = p.lengths.argmax().item<int64_t>();
  p.capsule = options.capsule.value_or(p.prediction);

  const int64_t D = cfg.digit_dim, O = static_cast<int64_t>(options.offsets.size());
  // delta[d, o, k, d] = offsets[o]: one copy of v per (dimension, offset), each moved along one axis.
  auto offsets = torch::tensor(options.offsets, torch::kDouble).to(v.options());   // [O]
  auto delta = torch::zeros({D, O, cfg.num_classes, D}, v.options());              // [D, O, J, D]
  auto eye = torch::eye(D, v.options()).unsqueeze(1);                              // [D, 1, D]
  delta.select(2, p.capsule).copy_(eye * offsets.view({1, O, 1}));                 // [D, O, D]
  auto perturbed = (v + delta).reshape({D * O, cfg.num_classes, D});               // [D*O, J, D]
  auto which = torch::full({D * O}, p.capsule, torch::dtype(torch::kLong).device(v.device()));
  p.reconstructions = model->decode(perturbed, which).view({D, O, S, S}).to(torch::kCPU, torch::kFloat);

  return p;
}

torch::Tensor dimension_sensitivity(const Perturbation& p) {
  TORCH_CHECK(p.reconstructions.dim() == 4 && p.reconstructions.size(1) == static_cast<int64_t>(p.offsets.size()),
              "dimension_sensitivity: reconstructions must be [D, O, H, W] with O = ", p.offsets.size(), ", got ",
              p.reconstructions.sizes());
  const auto [lo, hi] = std::minmax_element(p.offsets.begin(), p.offsets.end());
  auto low = p.reconstructions.select(1, lo - p.offsets.begin());   // [D, H, W]
  auto high = p.reconstructions.select(1, hi - p.offsets.begin());  // [D, H, W]
  return (high - low).abs().mean({1, 2});                           // [D]
}

std::string offset_label(double offset) {
  const auto hundredths = static_cast<int64_t>(std::llround(offset * 100.0));
  if (hundredths == 0) return "0";
  const int64_t a = std::abs(hundredths);
  const std::string whole = a >= 100 ? std::to_string(a / 100) : "";
  return fmt::format("{}{}.{:02}", hundredths < 0 ? '-' : '+', whole, a % 100);
}

torch::Tensor perturbation_figure(const Perturbation& p, const PerturbationFigureLayout& layout) {
  TORCH_CHECK(p.reconstructions.dim() == 4, "perturbation_figure: reconstructions must be [D, O, H, W], got ",
              p.reconstructions.sizes());
  TORCH_CHECK(layout.zoom >= 1 && layout.pad >= 0, "perturbation_figure: zoom must be >= 1 and pad >= 0, got zoom ",
              layout.zoom, ", pad ", layout.pad);
  const int64_t D = p.reconstructions.size(0), O = p.reconstructions.size(1);
  // Zoom all D*O cells in one op: hundreds of small per-cell ops cost seconds when the cores are contended.
  auto zoomed = p.reconstructions.to(torch::kFloat).repeat_interleave(layout.zoom, 2).repeat_interleave(layout.zoom, 3);
  std::vector<torch::Tensor> cells;  // views of zoomed: [h, w] each
  for (int64_t d = 0; d < D; ++d)
    for (int64_t o = 0; o < O; ++o) cells.push_back(zoomed[d][o]);
  // A dim grey between cells keeps the black backgrounds of neighbouring reconstructions apart.
  auto grid = tile(cells, O, layout.pad, 0.25f);  // [D*(h+pad)+pad, O*(w+pad)+pad]
  if (!layout.captions) return grid;

  const int64_t h = cells[0].size(0), w = cells[0].size(1), s = layout.caption_scale(w);
  const int64_t top = 5 * s + 4, left = text_width(std::to_string(D - 1), s) + 2 * s;
  auto canvas = torch::zeros({top + grid.size(0), left + grid.size(1)});
  canvas.narrow(0, top, grid.size(0)).narrow(1, left, grid.size(1)).copy_(grid);
  for (int64_t o = 0; o < O; ++o) {
    const auto text = offset_label(p.offsets[o]);
    const int64_t x = left + layout.pad + o * (w + layout.pad) + (w - text_width(text, s)) / 2;
    draw_text(canvas, x, 2, text, s);
  }
  for (int64_t d = 0; d < D; ++d) {
    const auto text = std::to_string(d);
    const int64_t y = top + layout.pad + d * (h + layout.pad) + (h - 5 * s) / 2;
    draw_text(canvas, left - s - text_width(text, s), y, text, s);  // right-aligned against the grid
  }
  return canvas;
}

}  // namespace capsnet::viz
