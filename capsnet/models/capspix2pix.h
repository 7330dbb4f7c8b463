#pragma once
// Conditional image synthesis, label map -> image: CapsPix2pix (Bass et al., MIDL 2019: a pix2pix whose
// generator is a U-net of convolutional capsules with locally-constrained dynamic routing) and the
// pix2pix baseline (Isola et al. 2017: CNN U-net generator), both judged by one PatchGAN discriminator.
// S = image side (multiple of 4), K = label classes, Z = noise size. The noise z enters both generators
// the same way: broadcast to Z constant channels and concatenated with the one-hot label map.
//
// Capsule generator (C = stem_channels, P = primary_types, Ap = primary_atoms, T = types, A = atoms):
//   [label; z] [B,K+Z,S,S] --conv 5x5 + ReLU--> stem [B,C,S,S] = capsules [B,1,C,S,S]
//   --CapsConv 5x5/2, r=1 (primary)--> p [B,P,Ap,S/2,S/2] --CapsConv kxk/2--> [B,T,A,S/4,S/4]
//   --CapsConv kxk/1--> [B,T,A,S/4,S/4] --DeconvCaps 4x4/2--> [B,P,Ap,S/2,S/2] ++ p --CapsConv kxk/1-->
//   [B,P,Ap,S/2,S/2] --DeconvCaps 4x4/2--> [B,1,C,S,S] ++ stem --CapsConv 1x1--> [B,1,A_out,S,S]
//   --1x1 conv over the A_out atoms + tanh--> image [B,1,S,S] in (-1, 1)
// Every capsule layer computes Algorithm 1 of the seed deck: u_hat = bias + sum_n weight * a_n,
// routing logits b: [in_caps, H, W, out_caps], r iterations of softmax, s, squash, agreement.
//
// CNN U-net generator (Isola et al.'s unet, three levels fewer for 32x32; F = cnn_channels):
//   enc: conv4/2 F (S/2) -> LReLU,conv4/2,BN 2F (S/4) -> LReLU,conv4/2,BN 4F (S/8) -> LReLU,conv4/2 4F (S/16)
//   dec: ReLU,deconv4/2,BN 4F ++ e3 -> ReLU,deconv,BN 2F ++ e2 -> ReLU,deconv,BN F ++ e1 -> ReLU,deconv 1, tanh
// No dropout: z is the noise source (pix2pix's dropout noise was found to be mostly ignored).
//
// PatchGAN discriminator (D = disc_channels) on [label; image] [B,K+1,S,S]:
//   conv4/2 D, LReLU -> conv4/2 2D, BN, LReLU -> conv3/1 1: logits [B,1,S/4,S/4], one per 18x18 patch.
// BatchNorm everywhere uses the batch's statistics, in training and generation alike (pix2pix
// normalises with the test batch's statistics too).
// Precision (set_precision): bf16 runs every convolution (plain, transposed, and each capsule layer's) on
// bf16 copies of the fp32 weights; each output returns to fp32 at once, so routing, BatchNorm, the
// activations and the losses are fp32.

#include <torch/torch.h>

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "capsnet/nn/capsule_conv.h"
#include "capsnet/kernels/precision.h"

namespace capsnet::models {

/// Hyper-parameters of the conditional GAN (defaults: the small CPU models of docs/capspix2pix.md).
struct Pix2pixConfig {
  std::string generator = "caps";  // "caps" (CapsPix2pix) | "cnn" (pix2pix)
  int64_t image_size = 32;         // S, a multiple of 16 for cnn, of 4 for caps
  int64_t label_classes = 3;       // K
  int64_t z_dim = 8;               // Z (0 = no noise)
  // Capsule generator.
  int64_t stem_channels = 16;
  int64_t primary_types = 2;
  int64_t primary_atoms = 8;
  int64_t types = 4;
  int64_t atoms = 8;
  int64_t out_atoms = 16;
  int64_t kernel = 5;  // odd
  int64_t routing_iterations = 3;
  bool grad_through_routing = true;
  // CNN generator.
  int64_t cnn_channels = 32;
  // Discriminator.
  int64_t disc_channels = 64;
  // Loss: GAN + l1_weight * L1 (pix2pix: lambda = 100).
  double l1_weight = 100;

  /// Throws std::invalid_argument naming the bad field.
  void validate() const;
  template <class Self, class F>
  static void fields(Self& c, F&& f) {
    f("generator", c.generator);
    f("image_size", c.image_size);
    f("label_classes", c.label_classes);
    f("z_dim", c.z_dim);
    f("stem_channels", c.stem_channels);
    f("primary_types", c.primary_types);
    f("primary_atoms", c.primary_atoms);
    f("types", c.types);
    f("atoms", c.atoms);
    f("out_atoms", c.out_atoms);
    f("kernel", c.kernel);
    f("routing_iterations", c.routing_iterations);
    f("grad_through_routing", c.grad_through_routing);
    f("cnn_channels", c.cnn_channels);
    f("disc_channels", c.disc_channels);
    f("l1_weight", c.l1_weight);
  }
  nlohmann::json to_json() const;
  /// Missing keys keep their defaults; unknown keys and wrong types throw std::invalid_argument.
  static Pix2pixConfig from_json(const nlohmann::json& j);
};

/// [label; z] as the generators' input. labels: [B, K, S, S], z: [B, Z] -> [B, K + Z, S, S].
torch::Tensor condition_with_noise(const torch::Tensor& labels, const torch::Tensor& z);

/// CapsPix2pix generator. forward: labels [B, K, S, S], z [B, Z] -> image [B, 1, S, S] in (-1, 1).
class CapsGeneratorImpl : public torch::nn::Cloneable<CapsGeneratorImpl> {
 public:
  explicit CapsGeneratorImpl(const Pix2pixConfig& config = {});
  void reset() override;
  torch::Tensor forward(const torch::Tensor& labels, const torch::Tensor& z);
  /// The last capsule layer: [B, 1, A_out, S, S] (the deck's "capsule features at the last layer").
  torch::Tensor features(const torch::Tensor& labels, const torch::Tensor& z);
  /// Fused routing operator (default) or the composite ATen path in every capsule layer.
  void set_fused_routing(bool fused);
  /// Precision of the convolutions (runtime only; see the file comment).
  void set_precision(Precision precision) { precision_ = precision; }

  Pix2pixConfig config;
  torch::nn::Conv2d stem{nullptr}, to_image{nullptr};
  nn::CapsuleConv2d primary{nullptr}, down{nullptr}, bottom{nullptr}, up1_conv{nullptr}, out{nullptr};
  nn::CapsuleConvTranspose2d up1{nullptr}, up2{nullptr};

 private:
  Precision precision_ = Precision::kFloat32;
};
TORCH_MODULE(CapsGenerator);

/// pix2pix U-net generator. forward: labels [B, K, S, S], z [B, Z] -> image [B, 1, S, S] in (-1, 1).
class UnetGeneratorImpl : public torch::nn::Cloneable<UnetGeneratorImpl> {
 public:
  explicit UnetGeneratorImpl(const Pix2pixConfig& config = {});
  void reset() override;
  torch::Tensor forward(const torch::Tensor& labels, const torch::Tensor& z);
  /// Precision of the convolutions (runtime only; see the file comment).
  void set_precision(Precision precision) { precision_ = precision; }

  Pix2pixConfig config;
  torch::nn::Conv2d e1{nullptr}, e2{nullptr}, e3{nullptr}, e4{nullptr};
  torch::nn::ConvTranspose2d d4{nullptr}, d3{nullptr}, d2{nullptr}, d1{nullptr};
  torch::nn::BatchNorm2d n2{nullptr}, n3{nullptr}, m4{nullptr}, m3{nullptr}, m2{nullptr};

 private:
  Precision precision_ = Precision::kFloat32;
};
TORCH_MODULE(UnetGenerator);

/// PatchGAN discriminator. forward: labels [B, K, S, S], image [B, 1, S, S] -> logits [B, 1, S/4, S/4].
class PatchDiscriminatorImpl : public torch::nn::Cloneable<PatchDiscriminatorImpl> {
 public:
  explicit PatchDiscriminatorImpl(const Pix2pixConfig& config = {});
  void reset() override;
  torch::Tensor forward(const torch::Tensor& labels, const torch::Tensor& image);
  /// Precision of the convolutions (runtime only; see the file comment).
  void set_precision(Precision precision) { precision_ = precision; }

  Pix2pixConfig config;
  torch::nn::Conv2d c1{nullptr}, c2{nullptr}, c3{nullptr};
  torch::nn::BatchNorm2d n2{nullptr};

 private:
  Precision precision_ = Precision::kFloat32;
};
TORCH_MODULE(PatchDiscriminator);

/// The losses of one batch (pix2pix's objective, Isola et al. Eq. 4).
struct Pix2pixLosses {
  torch::Tensor discriminator;  // 0.5 (BCE(D(x, y), 1) + BCE(D(x, G(x, z)), 0)), G's output detached
  torch::Tensor generator_gan;  // BCE(D(x, G(x, z)), 1)
  torch::Tensor l1;             // mean |G(x, z) - y| over pixels (images in [-1, 1])
  torch::Tensor generator;      // generator_gan + l1_weight * l1
};

/// Generator (caps or cnn, registered as "generator") + discriminator: what a checkpoint holds.
class Pix2pixImpl : public torch::nn::Cloneable<Pix2pixImpl> {
 public:
  explicit Pix2pixImpl(const Pix2pixConfig& config = {});
  void reset() override;
  /// labels [B, K, S, S], z [B, Z] -> image [B, 1, S, S] in (-1, 1). Throws std::invalid_argument on bad shapes.
  torch::Tensor generate(const torch::Tensor& labels, const torch::Tensor& z);
  std::vector<torch::Tensor> generator_parameters() const;
  std::vector<torch::Tensor> discriminator_parameters() const;
  /// The discriminator's loss on a generated batch `fake` (detached here).
  torch::Tensor discriminator_loss(const torch::Tensor& labels, const torch::Tensor& real, const torch::Tensor& fake);
  /// The generator's losses for `fake` = generate(labels, z) (gradients reach G through D).
  Pix2pixLosses generator_losses(const torch::Tensor& labels, const torch::Tensor& real, const torch::Tensor& fake);
  /// Precision of the convolutions of both networks (runtime only: weights and checkpoints stay fp32).
  void set_precision(Precision precision);
  Precision precision() const { return precision_; }

  Pix2pixConfig config;
  CapsGenerator caps{nullptr};  // set when config.generator == "caps"
  UnetGenerator cnn{nullptr};   // set when config.generator == "cnn"
  PatchDiscriminator discriminator{nullptr};

 private:
  Precision precision_ = Precision::kFloat32;
};
TORCH_MODULE(Pix2pix);

}  // namespace capsnet::models
