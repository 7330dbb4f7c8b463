#include "capsnet/models/segcaps.h"

#include <fmt/format.h>

#include <stdexcept>
#include <string>

#include "capsnet/kernels/conv_dispatch.h"
#include "capsnet/models/config_io.h"
#include "capsnet/nn/functional.h"

namespace capsnet::models {

void SegCapsConfig::validate() const {
  auto positive = [](const char* name, int64_t value) {
    if (value <= 0) throw std::invalid_argument(fmt::format("segcaps config: {} must be positive, got {}", name, value));
  };
  positive("image_size", image_size);
  positive("stem_channels", stem_channels);
  positive("stem_kernel", stem_kernel);
  positive("primary_types", primary_types);
  positive("primary_atoms", primary_atoms);
  positive("types", types);
  positive("low_atoms", low_atoms);
  positive("high_atoms", high_atoms);
  positive("kernel", kernel);
  positive("seg_atoms", seg_atoms);
  positive("routing_iterations", routing_iterations);
  positive("recon_hidden1", recon_hidden1);
  positive("recon_hidden2", recon_hidden2);
  if (!(pos_weight > 0 && pos_weight <= 1e6))
    throw std::invalid_argument(fmt::format("segcaps config: pos_weight must be in (0, 1e6], got {}", pos_weight));
  if (!(recon_weight >= 0 && recon_weight <= 1e6))
    throw std::invalid_argument(fmt::format("segcaps config: recon_weight must be in [0, 1e6], got {}", recon_weight));
  if (image_size % 4 != 0 || image_size < 8)
    throw std::invalid_argument(
        fmt::format("segcaps config: image_size must be a multiple of 4 and at least 8 (two stride-2 levels), got {}",
                    image_size));
  if (kernel % 2 == 0 || stem_kernel % 2 == 0)
    throw std::invalid_argument(fmt::format(
        "segcaps config: kernel and stem_kernel must be odd ('same' padding), got {} and {}", kernel, stem_kernel));
}

nlohmann::json SegCapsConfig::to_json() const { return config_io::to_json(*this); }

SegCapsConfig SegCapsConfig::from_json(const nlohmann::json& j) {
  return config_io::from_json<SegCapsConfig>(j, "segcaps config");
}

SegCapsImpl::SegCapsImpl(const SegCapsConfig& config_) : config(config_) { reset(); }

void SegCapsImpl::reset() {
  config.validate();
  const auto& c = config;
  const int64_t r = c.routing_iterations, k = c.kernel;
  auto conv = [&](int64_t ti, int64_t ai, int64_t to, int64_t ao, int64_t kernel, int64_t stride, int64_t iters) {
    return nn::CapsuleConv2d(nn::CapsuleConv2dOptions(ti, ai, to, ao)
                                 .kernel_size(kernel)
                                 .stride(stride)
                                 .padding(kernel / 2)
                                 .routing({iters, c.grad_through_routing})
                                 .share_across_types(c.share_across_types));
  };
  auto deconv = [&](int64_t ti, int64_t ai, int64_t to, int64_t ao) {
    return nn::CapsuleConvTranspose2d(nn::CapsuleConvTranspose2dOptions(ti, ai, to, ao)
                                          .routing({r, c.grad_through_routing})
                                          .share_across_types(c.share_across_types));
  };
  stem = register_module("stem", torch::nn::Conv2d(torch::nn::Conv2dOptions(1, c.stem_channels, c.stem_kernel)
                                                       .padding(c.stem_kernel / 2)));
  // SegCaps' primary capsules: one child type (the stem's feature map), routing r = 1.
  primary = register_module("primary", conv(1, c.stem_channels, c.primary_types, c.primary_atoms, 5, 2, 1));
  down1 = register_module("down1", conv(c.primary_types, c.primary_atoms, c.types, c.low_atoms, k, 1, r));
  down2 = register_module("down2", conv(c.types, c.low_atoms, c.types, c.high_atoms, k, 2, r));
  bottom = register_module("bottom", conv(c.types, c.high_atoms, c.types, c.high_atoms, k, 1, r));
  up1 = register_module("up1", deconv(c.types, c.high_atoms, c.types, c.low_atoms));
  up1_conv = register_module("up1_conv", conv(2 * c.types, c.low_atoms, c.types, c.low_atoms, k, 1, r));
  up2 = register_module("up2", deconv(c.types, c.low_atoms, c.primary_types, c.stem_channels));
  seg = register_module("seg", conv(c.primary_types + 1, c.stem_channels, 1, c.seg_atoms, 1, 1, r));
  if (c.recon_weight > 0) {
    // The paper's decoder: three 1x1 convs (64, 128, 1 channels), ReLU, ReLU, sigmoid: per pixel, so a
    // pixel is rebuilt from its own capsule only.
    auto conv1x1 = [](int64_t in, int64_t out) { return torch::nn::Conv2d(torch::nn::Conv2dOptions(in, out, 1)); };
    decoder = register_module("decoder", torch::nn::Sequential(conv1x1(c.seg_atoms, c.recon_hidden1), torch::nn::ReLU(),
                                                               conv1x1(c.recon_hidden1, c.recon_hidden2),
                                                               torch::nn::ReLU(), conv1x1(c.recon_hidden2, 1),
                                                               torch::nn::Sigmoid()));
  } else {
    decoder = nullptr;
  }
}

double batch_pos_weight(const torch::Tensor& masks) {
  const double total = static_cast<double>(masks.numel());
  const double fg = (masks > 0.5).sum().item<double>();
  if (fg == 0 || fg == total) return 1.0;
  return (total - fg) / fg;
}

torch::Tensor weighted_bce(const torch::Tensor& p, const torch::Tensor& masks, double pos_weight) {
  // |v| < 1 always, but |v| -> 0 on background: clamp keeps log finite.
  auto q = p.clamp(1e-6, 1 - 1e-6);
  auto y = masks.to(q.dtype());
  if (pos_weight == 1) return torch::binary_cross_entropy(q, y);  // the unweighted loss of before, bit for bit
  return -(pos_weight * y * torch::log(q) + (1 - y) * torch::log(1 - q)).mean();
}

torch::Tensor masked_reconstruction_target(const torch::Tensor& images, const torch::Tensor& masks) {
  return images * masks.to(images.dtype());  // [B, 1, S, S]
}

SegCapsOutput SegCapsImpl::forward(const torch::Tensor& images, const torch::Tensor& masks) {
  const int64_t S = config.image_size;
  if (!images.defined() || images.dim() != 4 || images.size(1) != 1 || images.size(2) != S || images.size(3) != S)
    throw std::invalid_argument(fmt::format("SegCaps: images must be [B, 1, {}, {}], got {}", S, S,
                                            images.defined() ? c10::str(images.sizes()) : "undefined"));
  const int64_t B = images.size(0);
  const auto pr = precision_;  // of the convolutions; every layer hands back fp32
  auto x = torch::relu(kernels::conv2d_at(stem, images, pr).to(stem->weight.scalar_type()));  // [B, C, S, S]
  auto stem_caps = x.view({B, 1, config.stem_channels, S, S});     // [B, 1, C, S, S]
  auto p = primary->forward(stem_caps, pr);                        // [B, P, Ap, S/2, S/2]
  auto d1 = down1->forward(p, pr);                                 // [B, T, La, S/2, S/2]
  auto d2 = bottom->forward(down2->forward(d1, pr), pr);           // [B, T, Ha, S/4, S/4]
  auto u1 = up1_conv->forward(torch::cat({up1->forward(d2, pr), d1}, 1), pr);  // [B, T, La, S/2, S/2]
  auto u2 = torch::cat({up2->forward(u1, pr), stem_caps}, 1);      // [B, P + 1, C, S, S]
  SegCapsOutput out;
  out.capsules = seg->forward(u2, pr);                             // [B, 1, A_seg, S, S]
  out.probability = capsule_length(out.capsules, /*dim=*/2);       // [B, 1, S, S]
  if (masks.defined() && decoder) out.reconstruction = decode(out.capsules, masks);  // [B, 1, S, S]
  return out;
}

torch::Tensor SegCapsImpl::decode(const torch::Tensor& capsules, const torch::Tensor& masks) {
  if (!decoder)
    throw std::invalid_argument("SegCaps::decode: the model has no decoder (recon_weight = 0)");
  const int64_t S = config.image_size;
  if (!capsules.defined() || capsules.dim() != 5 || capsules.size(1) != 1 || capsules.size(2) != config.seg_atoms ||
      capsules.size(3) != S || capsules.size(4) != S)
    throw std::invalid_argument(fmt::format("SegCaps::decode: capsules must be [B, 1, {}, {}, {}], got {}",
                                            config.seg_atoms, S, S,
                                            capsules.defined() ? c10::str(capsules.sizes()) : "undefined"));
  const int64_t B = capsules.size(0);
  if (!masks.defined() || masks.sizes() != at::IntArrayRef({B, 1, S, S}))
    throw std::invalid_argument(fmt::format("SegCaps::decode: masks must be [{}, 1, {}, {}], got {}", B, S, S,
                                            masks.defined() ? c10::str(masks.sizes()) : "undefined"));
  // Only the object's capsules reach the decoder: the ground truth masks every other pixel to 0.
  auto h = capsules.select(1, 0) * masks.to(capsules.dtype());  // [B, A_seg, S, S]
  // The Sequential layer by layer, so that its 1x1 convolutions run in the compute precision (output
  // back in the master dtype at once: ReLU, sigmoid and the MSE stay fp32); in fp32 this is forward().
  for (auto& layer : *decoder) {
    if (auto impl = std::dynamic_pointer_cast<torch::nn::Conv2dImpl>(layer.ptr())) {
      torch::nn::Conv2d conv(impl);
      h = kernels::conv2d_at(conv, h, precision_).to(impl->weight.scalar_type());
    } else {
      h = layer.forward(h);
    }
  }
  return h;  // [B, 1, S, S]
}

SegCapsLoss SegCapsImpl::loss_terms(const SegCapsOutput& out, const torch::Tensor& masks,
                                    const torch::Tensor& images) const {
  if (!masks.defined() || masks.sizes() != out.probability.sizes())
    throw std::invalid_argument(fmt::format("SegCaps::loss: masks must be {}, got {}", c10::str(out.probability.sizes()),
                                            masks.defined() ? c10::str(masks.sizes()) : "undefined"));
  SegCapsLoss l;
  // Auto: measured on the batch, since the images are generated on the fly (there is no fixed training
  // set whose ratio the authors' code would count) and a per-batch number needs no state to resume.
  l.pos_weight = config.auto_pos_weight ? batch_pos_weight(masks) : config.pos_weight;
  l.bce = weighted_bce(out.probability, masks, l.pos_weight);
  if (config.recon_weight > 0) {
    if (!out.reconstruction.defined() || !images.defined() || images.sizes() != masks.sizes())
      throw std::invalid_argument(
          "SegCaps::loss: recon_weight > 0 needs the output of forward(images, masks) and the images");
    l.reconstruction = torch::mse_loss(out.reconstruction, masked_reconstruction_target(images, masks));
    l.total = l.bce + config.recon_weight * l.reconstruction;
  } else {
    l.reconstruction = torch::zeros({}, l.bce.options());
    l.total = l.bce;
  }
  return l;
}

torch::Tensor SegCapsImpl::loss(const SegCapsOutput& out, const torch::Tensor& masks,
                                const torch::Tensor& images) const {
  return loss_terms(out, masks, images).total;
}

void SegCapsImpl::set_fused_routing(bool fused) {
  for (auto* layer : {&primary, &down1, &down2, &bottom, &up1_conv, &seg}) (*layer)->options.routing().fused = fused;
  for (auto* layer : {&up1, &up2}) (*layer)->options.routing().fused = fused;
}

}  // namespace capsnet::models
