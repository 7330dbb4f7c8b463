#include "capsnet/models/capspix2pix.h"

#include <fmt/format.h>

#include <stdexcept>

#include "capsnet/kernels/conv_dispatch.h"
#include "capsnet/models/config_io.h"

namespace capsnet::models {
namespace {

namespace F = torch::nn::functional;

// Batch statistics always (no running averages): pix2pix normalises generated batches by their own
// statistics at test time too, and nothing then depends on train() / eval().
torch::nn::BatchNorm2d batch_norm(int64_t channels) {
  return torch::nn::BatchNorm2d(torch::nn::BatchNorm2dOptions(channels).track_running_stats(false));
}

// A convolution in `precision` with its output back in the master dtype: what every layer here does
// (BatchNorm, the activations and the losses stay fp32).
torch::Tensor conv_at(torch::nn::Conv2d& conv, const torch::Tensor& x, Precision precision) {
  return kernels::conv2d_at(conv, x, precision).to(conv->weight.scalar_type());
}

// The same for a transposed convolution (dilation 1 here), whose bf16 path is kernels::conv_transpose2d_at's.
torch::Tensor conv_at(torch::nn::ConvTranspose2d& deconv, const torch::Tensor& x, Precision precision) {
  if (precision == Precision::kFloat32) return deconv->forward(x);
  const auto& o = deconv->options;
  const auto padding = kernels::numeric_padding(o, "conv_at");
  TORCH_CHECK(o.dilation()->at(0) == 1 && o.dilation()->at(1) == 1, "conv_at: transposed convolutions take dilation 1");
  return kernels::conv_transpose2d_at(x, deconv->weight, deconv->bias, o.stride(), padding, o.output_padding(), o.groups(),
                                 precision);
}

void check_labels(const Pix2pixConfig& c, const torch::Tensor& labels, const char* who) {
  const int64_t S = c.image_size;
  if (!labels.defined() || labels.dim() != 4 || labels.size(1) != c.label_classes || labels.size(2) != S ||
      labels.size(3) != S)
    throw std::invalid_argument(fmt::format("{}: labels must be [B, {}, {}, {}], got {}", who, c.label_classes, S, S,
                                            labels.defined() ? c10::str(labels.sizes()) : "undefined"));
}

}  // namespace

void Pix2pixConfig::validate() const {
  auto positive = [](const char* name, int64_t v) {
    if (v <= 0) throw std::invalid_argument(fmt::format("capspix2pix config: {} must be positive, got {}", name, v));
  };
  if (generator != "caps" && generator != "cnn")
    throw std::invalid_argument(fmt::format("capspix2pix config: generator must be caps or cnn, got '{}'", generator));
  positive("image_size", image_size);
  positive("label_classes", label_classes);
  positive("stem_channels", stem_channels);
  positive("primary_types", primary_types);
  positive("primary_atoms", primary_atoms);
  positive("types", types);
  positive("atoms", atoms);
  positive("out_atoms", out_atoms);
  positive("kernel", kernel);
  positive("routing_iterations", routing_iterations);
  positive("cnn_channels", cnn_channels);
  positive("disc_channels", disc_channels);
  if (z_dim < 0) throw std::invalid_argument(fmt::format("capspix2pix config: z_dim must be >= 0, got {}", z_dim));
  if (kernel % 2 == 0)
    throw std::invalid_argument(fmt::format("capspix2pix config: kernel must be odd, got {}", kernel));
  const int64_t multiple = generator == "cnn" ? 16 : 4;  // cnn: four stride-2 levels; caps and D: two
  if (image_size % multiple != 0 || image_size < multiple)
    throw std::invalid_argument(fmt::format("capspix2pix config: image_size must be a multiple of {} for the {} "
                                            "generator, got {}",
                                            multiple, generator, image_size));
  if (!(l1_weight >= 0 && l1_weight <= 1e6))
    throw std::invalid_argument(fmt::format("capspix2pix config: l1_weight must be in [0, 1e6], got {}", l1_weight));
}

nlohmann::json Pix2pixConfig::to_json() const { return config_io::to_json(*this); }

Pix2pixConfig Pix2pixConfig::from_json(const nlohmann::json& j) {
  return config_io::from_json<Pix2pixConfig>(j, "capspix2pix config");
}

torch::Tensor condition_with_noise(const torch::Tensor& labels, const torch::Tensor& z) {
  const int64_t B = labels.size(0), H = labels.size(2), W = labels.size(3);
  if (!z.defined() || z.dim() != 2 || z.size(0) != B)
    throw std::invalid_argument(fmt::format("capspix2pix: z must be [{}, Z], got {}", B,
                                            z.defined() ? c10::str(z.sizes()) : "undefined"));
  if (z.size(1) == 0) return labels;
  auto planes = z.to(labels.dtype()).reshape({B, z.size(1), 1, 1}).expand({B, z.size(1), H, W});  // [B, Z, H, W]
  return torch::cat({labels, planes}, 1);                                                     // [B, K + Z, H, W]
}

// ---- CapsPix2pix generator ----

CapsGeneratorImpl::CapsGeneratorImpl(const Pix2pixConfig& config_) : config(config_) { reset(); }

void CapsGeneratorImpl::reset() {
  config.validate();
  const auto& c = config;
  const int64_t k = c.kernel, r = c.routing_iterations;
  auto conv = [&](int64_t ti, int64_t ai, int64_t to, int64_t ao, int64_t kernel, int64_t stride, int64_t iters) {
    return nn::CapsuleConv2d(nn::CapsuleConv2dOptions(ti, ai, to, ao)
                                 .kernel_size(kernel)
                                 .stride(stride)
                                 .padding(kernel / 2)
                                 .routing({iters, c.grad_through_routing}));
  };
  auto deconv = [&](int64_t ti, int64_t ai, int64_t to, int64_t ao) {
    return nn::CapsuleConvTranspose2d(
        nn::CapsuleConvTranspose2dOptions(ti, ai, to, ao).routing({r, c.grad_through_routing}));
  };
  stem = register_module("stem", torch::nn::Conv2d(torch::nn::Conv2dOptions(c.label_classes + c.z_dim,
                                                                             c.stem_channels, 5)
                                                       .padding(2)));
  // As in SegCaps, the primary capsules see one child type (the stem's map) and route once.
  primary = register_module("primary", conv(1, c.stem_channels, c.primary_types, c.primary_atoms, 5, 2, 1));
  down = register_module("down", conv(c.primary_types, c.primary_atoms, c.types, c.atoms, k, 2, r));
  bottom = register_module("bottom", conv(c.types, c.atoms, c.types, c.atoms, k, 1, r));
  up1 = register_module("up1", deconv(c.types, c.atoms, c.primary_types, c.primary_atoms));
  up1_conv = register_module("up1_conv",
                             conv(2 * c.primary_types, c.primary_atoms, c.primary_types, c.primary_atoms, k, 1, r));
  up2 = register_module("up2", deconv(c.primary_types, c.primary_atoms, 1, c.stem_channels));
  out = register_module("out", conv(2, c.stem_channels, 1, c.out_atoms, 1, 1, r));
  to_image = register_module("to_image", torch::nn::Conv2d(torch::nn::Conv2dOptions(c.out_atoms, 1, 1)));
}

torch::Tensor CapsGeneratorImpl::features(const torch::Tensor& labels, const torch::Tensor& z) {
  check_labels(config, labels, "CapsGenerator");
  const int64_t B = labels.size(0), S = config.image_size;
  const auto pr = precision_;  // of the convolutions; every layer hands back fp32
  auto x = torch::relu(conv_at(stem, condition_with_noise(labels, z), pr));  // [B, C, S, S]
  auto stem_caps = x.view({B, 1, config.stem_channels, S, S});               // [B, 1, C, S, S]
  auto p = primary->forward(stem_caps, pr);                                  // [B, P, Ap, S/2, S/2]
  auto d = bottom->forward(down->forward(p, pr), pr);                        // [B, T, A, S/4, S/4]
  auto u1 = up1_conv->forward(torch::cat({up1->forward(d, pr), p}, 1), pr);  // [B, P, Ap, S/2, S/2]
  auto u2 = torch::cat({up2->forward(u1, pr), stem_caps}, 1);                // [B, 2, C, S, S]
  return out->forward(u2, pr);                                               // [B, 1, A_out, S, S]
}

torch::Tensor CapsGeneratorImpl::forward(const torch::Tensor& labels, const torch::Tensor& z) {
  auto v = features(labels, z);                                     // [B, 1, A_out, S, S]
  return torch::tanh(conv_at(to_image, v.select(1, 0), precision_));  // [B, 1, S, S]
}

void CapsGeneratorImpl::set_fused_routing(bool fused) {
  for (auto* layer : {&primary, &down, &bottom, &up1_conv, &out}) (*layer)->options.routing().fused = fused;
  for (auto* layer : {&up1, &up2}) (*layer)->options.routing().fused = fused;
}

// ---- pix2pix U-net generator ----

UnetGeneratorImpl::UnetGeneratorImpl(const Pix2pixConfig& config_) : config(config_) { reset(); }

void UnetGeneratorImpl::reset() {
  config.validate();
  const int64_t f = config.cnn_channels, in = config.label_classes + config.z_dim;
  auto down = [](int64_t i, int64_t o) { return torch::nn::Conv2d(torch::nn::Conv2dOptions(i, o, 4).stride(2).padding(1)); };
  auto up = [](int64_t i, int64_t o) {
    return torch::nn::ConvTranspose2d(torch::nn::ConvTranspose2dOptions(i, o, 4).stride(2).padding(1));
  };
  e1 = register_module("e1", down(in, f));
  e2 = register_module("e2", down(f, 2 * f));
  e3 = register_module("e3", down(2 * f, 4 * f));
  e4 = register_module("e4", down(4 * f, 4 * f));
  d4 = register_module("d4", up(4 * f, 4 * f));
  d3 = register_module("d3", up(8 * f, 2 * f));
  d2 = register_module("d2", up(4 * f, f));
  d1 = register_module("d1", up(2 * f, 1));
  n2 = register_module("n2", batch_norm(2 * f));
  n3 = register_module("n3", batch_norm(4 * f));
  m4 = register_module("m4", batch_norm(4 * f));
  m3 = register_module("m3", batch_norm(2 * f));
  m2 = register_module("m2", batch_norm(f));
}

torch::Tensor UnetGeneratorImpl::forward(const torch::Tensor& labels, const torch::Tensor& z) {
  check_labels(config, labels, "UnetGenerator");
  auto lrelu = [](const torch::Tensor& t) { return torch::leaky_relu(t, 0.2); };
  const auto pr = precision_;
  auto x1 = conv_at(e1, condition_with_noise(labels, z), pr);  // [B, F, S/2, S/2]
  auto x2 = n2->forward(conv_at(e2, lrelu(x1), pr));            // [B, 2F, S/4, S/4]
  auto x3 = n3->forward(conv_at(e3, lrelu(x2), pr));            // [B, 4F, S/8, S/8]
  auto x4 = conv_at(e4, lrelu(x3), pr);                         // [B, 4F, S/16, S/16] (innermost: no norm)
  auto y4 = m4->forward(conv_at(d4, torch::relu(x4), pr));      // [B, 4F, S/8, S/8]
  auto y3 = m3->forward(conv_at(d3, torch::relu(torch::cat({y4, x3}, 1)), pr));  // [B, 2F, S/4, S/4]
  auto y2 = m2->forward(conv_at(d2, torch::relu(torch::cat({y3, x2}, 1)), pr));  // [B, F, S/2, S/2]
  return torch::tanh(conv_at(d1, torch::relu(torch::cat({y2, x1}, 1)), pr));     // [B, 1, S, S]
}

// ---- PatchGAN discriminator ----

PatchDiscriminatorImpl::PatchDiscriminatorImpl(const Pix2pixConfig& config_) : config(config_) { reset(); }

void PatchDiscriminatorImpl::reset() {
  config.validate();
  const int64_t d = config.disc_channels;
  c1 = register_module("c1", torch::nn::Conv2d(torch::nn::Conv2dOptions(config.label_classes + 1, d, 4).stride(2).padding(1)));
  c2 = register_module("c2", torch::nn::Conv2d(torch::nn::Conv2dOptions(d, 2 * d, 4).stride(2).padding(1)));
  c3 = register_module("c3", torch::nn::Conv2d(torch::nn::Conv2dOptions(2 * d, 1, 3).padding(1)));
  n2 = register_module("n2", batch_norm(2 * d));
}

torch::Tensor PatchDiscriminatorImpl::forward(const torch::Tensor& labels, const torch::Tensor& image) {
  check_labels(config, labels, "PatchDiscriminator");
  const int64_t S = config.image_size;
  if (!image.defined() || image.dim() != 4 || image.size(0) != labels.size(0) || image.size(1) != 1 ||
      image.size(2) != S || image.size(3) != S)
    throw std::invalid_argument(fmt::format("PatchDiscriminator: image must be [{}, 1, {}, {}], got {}",
                                            labels.size(0), S, S,
                                            image.defined() ? c10::str(image.sizes()) : "undefined"));
  const auto pr = precision_;
  auto x = torch::leaky_relu(conv_at(c1, torch::cat({labels, image.to(labels.dtype())}, 1), pr), 0.2);  // [B, D, S/2, S/2]
  x = torch::leaky_relu(n2->forward(conv_at(c2, x, pr)), 0.2);  // [B, 2D, S/4, S/4]
  return conv_at(c3, x, pr);                                     // [B, 1, S/4, S/4]: fp32 logits for the BCE
}

// ---- the pair ----

Pix2pixImpl::Pix2pixImpl(const Pix2pixConfig& config_) : config(config_) { reset(); }

void Pix2pixImpl::reset() {
  config.validate();
  if (config.generator == "caps") {
    caps = register_module("generator", CapsGenerator(config));
    cnn = nullptr;
  } else {
    cnn = register_module("generator", UnetGenerator(config));
    caps = nullptr;
  }
  discriminator = register_module("discriminator", PatchDiscriminator(config));
  set_precision(precision_);  // networks built anew (reset() again, clone()) compute as the pair does
}

void Pix2pixImpl::set_precision(Precision precision) {
  precision_ = precision;
  if (caps) caps->set_precision(precision);
  if (cnn) cnn->set_precision(precision);
  discriminator->set_precision(precision);
}

torch::Tensor Pix2pixImpl::generate(const torch::Tensor& labels, const torch::Tensor& z) {
  if (z.defined() && z.dim() == 2 && z.size(1) != config.z_dim)
    throw std::invalid_argument(fmt::format("capspix2pix: z must have {} entries per example, got {}", config.z_dim,
                                            z.size(1)));
  return caps ? caps->forward(labels, z) : cnn->forward(labels, z);
}

std::vector<torch::Tensor> Pix2pixImpl::generator_parameters() const {
  return caps ? caps->parameters() : cnn->parameters();
}

std::vector<torch::Tensor> Pix2pixImpl::discriminator_parameters() const { return discriminator->parameters(); }

torch::Tensor Pix2pixImpl::discriminator_loss(const torch::Tensor& labels, const torch::Tensor& real,
                                              const torch::Tensor& fake) {
  auto on_real = discriminator->forward(labels, real);           // [B, 1, S/4, S/4]
  auto on_fake = discriminator->forward(labels, fake.detach());  // [B, 1, S/4, S/4]
  // Halved as in pix2pix, which slows D down relative to G.
  return 0.5 * (F::binary_cross_entropy_with_logits(on_real, torch::ones_like(on_real)) +
                F::binary_cross_entropy_with_logits(on_fake, torch::zeros_like(on_fake)));
}

Pix2pixLosses Pix2pixImpl::generator_losses(const torch::Tensor& labels, const torch::Tensor& real,
                                            const torch::Tensor& fake) {
  Pix2pixLosses l;
  auto on_fake = discriminator->forward(labels, fake);  // [B, 1, S/4, S/4]
  l.generator_gan = F::binary_cross_entropy_with_logits(on_fake, torch::ones_like(on_fake));
  l.l1 = (fake - real).abs().mean();
  l.generator = l.generator_gan + config.l1_weight * l.l1;
  return l;
}

}  // namespace capsnet::models
