#include "capsnet/nn/spatial_transformer.h"

#include <fmt/format.h>

#include <cmath>
#include <sstream>
#include <stdexcept>
#include <vector>

namespace capsnet::nn {
namespace {

std::string sizes_string(const torch::Tensor& t) {
  std::ostringstream s;
  s << t.sizes();
  return s.str();
}

void check_sample_args(const torch::Tensor& input, const torch::Tensor& theta, int64_t out_h, int64_t out_w) {
  if (!input.defined() || input.dim() != 4)
    throw std::invalid_argument(fmt::format("affine_sample: input must be [B, C, H, W], got {}",
                                            input.defined() ? sizes_string(input) : "an undefined tensor"));
  if (!theta.defined() || theta.dim() != 3 || theta.size(1) != 2 || theta.size(2) != 3)
    throw std::invalid_argument(fmt::format("affine_sample: theta must be [B, 2, 3], got {}",
                                            theta.defined() ? sizes_string(theta) : "an undefined tensor"));
  if (theta.size(0) != input.size(0))
    throw std::invalid_argument(fmt::format("affine_sample: theta has batch {} but input has batch {}",
                                            theta.size(0), input.size(0)));
  if (!input.is_floating_point() || theta.scalar_type() != input.scalar_type())
    throw std::invalid_argument(fmt::format("affine_sample: input and theta must share a floating dtype, got {} and {}",
                                            c10::toString(input.scalar_type()), c10::toString(theta.scalar_type())));
  if (theta.device() != input.device())
    throw std::invalid_argument("affine_sample: input and theta must be on the same device");
  if (out_h <= 0 || out_w <= 0)
    throw std::invalid_argument(fmt::format("affine_sample: out_h and out_w must be positive, got {} x {}", out_h, out_w));
}

}  // namespace

int64_t num_parameters(const SpatialTransformerOptions& o) {
  const int64_t k2 = o.loc_kernel() * o.loc_kernel();
  const int64_t flat = o.loc_channels2() * (o.height() / 4) * (o.width() / 4);
  return o.channels() * o.loc_channels1() * k2 + o.loc_channels1() +       // loc_conv1
         o.loc_channels1() * o.loc_channels2() * k2 + o.loc_channels2() +  // loc_conv2
         flat * o.loc_hidden() + o.loc_hidden() +                         // loc_fc1
         o.loc_hidden() * 6 + 6;                                          // loc_fc2
}

torch::Tensor identity_theta(int64_t batch, const torch::TensorOptions& options) {
  auto one = torch::tensor({1.0, 0.0, 0.0, 0.0, 1.0, 0.0}, options);
  return one.view({1, 2, 3}).expand({batch, 2, 3}).contiguous();
}

torch::Tensor affine_sample(const torch::Tensor& input, const torch::Tensor& theta, int64_t out_h, int64_t out_w) {
  check_sample_args(input, theta, out_h, out_w);
  namespace F = torch::nn::functional;
  // grid: [B, out_h, out_w, 2] holding (x_s, y_s) in normalised coordinates
  auto grid = F::affine_grid(theta, {input.size(0), input.size(1), out_h, out_w}, /*align_corners=*/false);
  return F::grid_sample(input, grid,
                        F::GridSampleFuncOptions().mode(torch::kBilinear).padding_mode(torch::kZeros).align_corners(false));
}

namespace detail {

torch::Tensor reference_affine_sample(const torch::Tensor& input, const torch::Tensor& theta, int64_t out_h,
                                      int64_t out_w) {
  check_sample_args(input, theta, out_h, out_w);
  const int64_t B = input.size(0), C = input.size(1), H = input.size(2), W = input.size(3);
  std::vector<torch::Tensor> images;
  for (int64_t b = 0; b < B; ++b) {
    auto t = theta[b];  // [2, 3]
    std::vector<torch::Tensor> pixels;
    for (int64_t i = 0; i < out_h; ++i) {
      for (int64_t j = 0; j < out_w; ++j) {
        const double xt = (2.0 * j + 1) / out_w - 1, yt = (2.0 * i + 1) / out_h - 1;
        auto xs = t[0][0] * xt + t[0][1] * yt + t[0][2];
        auto ys = t[1][0] * xt + t[1][1] * yt + t[1][2];
        auto ix = ((xs + 1) * W - 1) / 2, iy = ((ys + 1) * H - 1) / 2;
        const auto x0 = static_cast<int64_t>(std::floor(ix.item<double>()));
        const auto y0 = static_cast<int64_t>(std::floor(iy.item<double>()));
        auto dx = ix - static_cast<double>(x0), dy = iy - static_cast<double>(y0);
        auto value = input.new_zeros({C});  // [C]
        for (int64_t yy : {y0, y0 + 1}) {
          for (int64_t xx : {x0, x0 + 1}) {
            if (yy < 0 || yy >= H || xx < 0 || xx >= W) continue;  // zero padding
            auto wx = xx == x0 ? 1 - dx : dx;
            auto wy = yy == y0 ? 1 - dy : dy;
            value = value + wx * wy * input.select(0, b).select(1, yy).select(1, xx);
          }
        }
        pixels.push_back(value);
      }
    }
    images.push_back(torch::stack(pixels).view({out_h, out_w, C}).permute({2, 0, 1}));  // [C, out_h, out_w]
  }
  return torch::stack(images);  // [B, C, out_h, out_w]
}

}  // namespace detail

SpatialTransformerImpl::SpatialTransformerImpl(const SpatialTransformerOptions& options_) : options(options_) {
  reset();
}

void SpatialTransformerImpl::reset() {
  const auto& o = options;
  auto positive = [](const char* name, int64_t v) {
    if (v <= 0) throw std::invalid_argument(fmt::format("SpatialTransformerOptions: {} must be positive, got {}", name, v));
  };
  positive("channels", o.channels());
  positive("loc_channels1", o.loc_channels1());
  positive("loc_channels2", o.loc_channels2());
  positive("loc_kernel", o.loc_kernel());
  positive("loc_hidden", o.loc_hidden());
  if (o.height() < 4 || o.width() < 4)
    throw std::invalid_argument(fmt::format(
        "SpatialTransformerOptions: height and width must be >= 4 (two 2x2 poolings), got {} x {}", o.height(), o.width()));
  if (o.loc_kernel() % 2 == 0)
    throw std::invalid_argument(fmt::format("SpatialTransformerOptions: loc_kernel must be odd, got {}", o.loc_kernel()));
  if (o.output_height() < 0 || o.output_width() < 0)
    throw std::invalid_argument("SpatialTransformerOptions: output_height and output_width must be >= 0 (0 = input size)");
  const int64_t pad = o.loc_kernel() / 2;
  loc_conv1 = register_module(
      "loc_conv1", torch::nn::Conv2d(torch::nn::Conv2dOptions(o.channels(), o.loc_channels1(), o.loc_kernel()).padding(pad)));
  loc_conv2 = register_module(
      "loc_conv2",
      torch::nn::Conv2d(torch::nn::Conv2dOptions(o.loc_channels1(), o.loc_channels2(), o.loc_kernel()).padding(pad)));
  const int64_t flat = o.loc_channels2() * (o.height() / 4) * (o.width() / 4);
  loc_fc1 = register_module("loc_fc1", torch::nn::Linear(flat, o.loc_hidden()));
  loc_fc2 = register_module("loc_fc2", torch::nn::Linear(o.loc_hidden(), 6));
  // Start at the identity map: a random theta would scramble the input and give the classifier
  // behind it nothing to learn from at first (Jaderberg et al. initialise the same way).
  torch::NoGradGuard no_grad;
  loc_fc2->weight.zero_();
  loc_fc2->bias.copy_(torch::tensor({1.0f, 0.0f, 0.0f, 0.0f, 1.0f, 0.0f}));
}

void SpatialTransformerImpl::check_input(const torch::Tensor& images) const {
  if (!images.defined() || images.dim() != 4)
    throw std::invalid_argument(fmt::format("SpatialTransformer: images must be [B, C, H, W], got {}",
                                            images.defined() ? sizes_string(images) : "an undefined tensor"));
  if (images.size(1) != options.channels())
    throw std::invalid_argument(fmt::format("SpatialTransformer: images have {} channels, the module expects {}",
                                            images.size(1), options.channels()));
  if (images.size(2) != options.height() || images.size(3) != options.width())
    throw std::invalid_argument(fmt::format("SpatialTransformer: images are {} x {}, the module expects {} x {}",
                                            images.size(2), images.size(3), options.height(), options.width()));
}

torch::Tensor SpatialTransformerImpl::localize(const torch::Tensor& images) {
  check_input(images);
  auto x = torch::relu(torch::max_pool2d(loc_conv1(images), 2));  // [B, c1, H/2, W/2]
  x = torch::relu(torch::max_pool2d(loc_conv2(x), 2));            // [B, c2, H/4, W/4]
  x = torch::relu(loc_fc1(x.flatten(1)));                         // [B, hidden]
  return loc_fc2(x).view({-1, 2, 3});                             // theta: [B, 2, 3]
}

torch::Tensor SpatialTransformerImpl::transform(const torch::Tensor& images, const torch::Tensor& theta) const {
  check_input(images);
  const int64_t oh = options.output_height() > 0 ? options.output_height() : options.height();
  const int64_t ow = options.output_width() > 0 ? options.output_width() : options.width();
  return affine_sample(images, theta, oh, ow);
}

torch::Tensor SpatialTransformerImpl::forward(const torch::Tensor& images) { return forward_with_theta(images).output; }

SpatialTransformerOutput SpatialTransformerImpl::forward_with_theta(const torch::Tensor& images) {
  SpatialTransformerOutput out;
  out.theta = localize(images);
  out.output = transform(images, out.theta);
  return out;
}

}  // namespace capsnet::nn
