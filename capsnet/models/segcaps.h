#pragma once
// A small SegCaps-style U-shaped capsule segmentation network (LaLonde & Bagci 2018, Fig. 2, shrunk to
// train on 2 CPU cores). S = image side (multiple of 4), C = stem_channels, P = primary_types,
// T = types, La = low_atoms, Ha = high_atoms, capsule tensors [B, types, atoms, H, W]:
//
//   image [B,1,S,S] --conv kxk + ReLU--> stem [B,C,S,S] = capsules [B,1,C,S,S]
//   --CapsConv 5x5/2, r=1 (primary)--> [B,P,Ap,S/2,S/2]
//   --CapsConv kxk/1--> d1 [B,T,La,S/2,S/2] --CapsConv kxk/2--> [B,T,Ha,S/4,S/4] --CapsConv kxk/1--> [B,T,Ha,S/4,S/4]
//   --DeconvCaps 4x4/2--> [B,T,La,S/2,S/2] ++ d1 (concatenate types) --CapsConv kxk/1--> [B,T,La,S/2,S/2]
//   --DeconvCaps 4x4/2--> [B,P,C,S,S] ++ stem --CapsConv 1x1--> seg [B,1,A_seg,S,S] --|v|--> p [B,1,S,S]
//
// The length of the single segmentation capsule at each pixel is the foreground probability (SegCaps
// Sec. 3). Trained with binary cross-entropy on that length, the foreground pixels weighted by
// pos_weight (SegCaps Sec. 3.2). (With one parent type the last layer's coupling coefficients are all
// 1, as in SegCaps.) Optional masked reconstruction regulariser (SegCaps Sec. 3.1, Fig. 2):
//
//   seg [B,1,A_seg,S,S] * mask --1x1 conv + ReLU--> [B,H1,S,S] --1x1 conv + ReLU--> [B,H2,S,S]
//   --1x1 conv + sigmoid--> reconstruction [B,1,S,S], target = image * mask, loss += recon_weight * MSE

#include <torch/torch.h>

#include <nlohmann/json.hpp>

#include "capsnet/nn/capsule_conv.h"
#include "capsnet/kernels/precision.h"

namespace capsnet::models {

/// Hyper-parameters of SegCaps (defaults: the small CPU model of docs/segcaps.md).
struct SegCapsConfig {
  int64_t image_size = 32;     // S, a multiple of 4
  int64_t stem_channels = 16;  // C (also the atoms of the full-resolution capsules)
  int64_t stem_kernel = 5;
  int64_t primary_types = 2;  // P
  int64_t primary_atoms = 8;  // Ap
  int64_t types = 4;          // T in the down/up path
  int64_t low_atoms = 8;      // La, at S/2
  int64_t high_atoms = 16;    // Ha, at S/4
  int64_t kernel = 5;         // odd: capsule conv kernels in the down/up path ("same" padding)
  int64_t seg_atoms = 16;     // atoms of the final segmentation capsule
  int64_t routing_iterations = RoutingOptions{}.iterations;
  bool grad_through_routing = RoutingOptions{}.grad_through_routing;
  bool share_across_types = false;  // see nn::CapsuleConv2dOptions::share_across_types
  // Loss options. Their defaults are the model of before they existed (plain BCE, no decoder), which is
  // what a saved config without these keys means; `capsnet segcaps` defaults to the paper's instead.
  double pos_weight = 1;         // weight of foreground pixels in the BCE (1 = unweighted); > 0
  bool auto_pos_weight = false;  // true: pos_weight = background / foreground pixels of each batch's masks
  double recon_weight = 0;       // weight of the masked reconstruction MSE; 0 = no decoder (paper: 0.131)
  int64_t recon_hidden1 = 64;    // channels of the decoder's two hidden 1x1 convs (paper: 64, 128)
  int64_t recon_hidden2 = 128;

  /// Throws std::invalid_argument naming the bad field.
  void validate() const;
  /// The field list (config_io.h): JSON in both directions is built from it.
  template <class Self, class F>
  static void fields(Self& c, F&& f) {
    f("image_size", c.image_size);
    f("stem_channels", c.stem_channels);
    f("stem_kernel", c.stem_kernel);
    f("primary_types", c.primary_types);
    f("primary_atoms", c.primary_atoms);
    f("types", c.types);
    f("low_atoms", c.low_atoms);
    f("high_atoms", c.high_atoms);
    f("kernel", c.kernel);
    f("seg_atoms", c.seg_atoms);
    f("routing_iterations", c.routing_iterations);
    f("grad_through_routing", c.grad_through_routing);
    f("share_across_types", c.share_across_types);
    f("pos_weight", c.pos_weight);
    f("auto_pos_weight", c.auto_pos_weight);
    f("recon_weight", c.recon_weight);
    f("recon_hidden1", c.recon_hidden1);
    f("recon_hidden2", c.recon_hidden2);
  }
  nlohmann::json to_json() const;
  /// Missing keys keep their defaults; unknown keys and wrong types throw std::invalid_argument.
  static SegCapsConfig from_json(const nlohmann::json& j);
};

struct SegCapsOutput {
  torch::Tensor capsules;     // v: [B, 1, A_seg, S, S], the segmentation capsule at every pixel
  torch::Tensor probability;  // |v|: [B, 1, S, S] in [0, 1), foreground probability
  /// [B, 1, S, S] in (0, 1): decoded from the capsules masked by the ground truth; undefined without a
  /// decoder (recon_weight = 0) or without masks.
  torch::Tensor reconstruction;
};

struct SegCapsLoss {
  torch::Tensor total;           // bce + recon_weight * reconstruction (scalar)
  torch::Tensor bce;             // weighted binary cross-entropy, mean over pixels (scalar)
  torch::Tensor reconstruction;  // MSE(reconstruction, image * mask), mean over pixels; 0 without decoder
  double pos_weight = 1;         // the foreground weight used
};

/// Foreground weight measured on masks [B, 1, S, S] in {0, 1}: background pixels / foreground pixels
/// (1 when either count is 0, so an empty batch is not weighted by infinity or zero).
double batch_pos_weight(const torch::Tensor& masks);

/// Class-weighted binary cross-entropy, mean over all pixels:
///   -mean(w y log p + (1 - y) log(1 - p)),  p clamped to [1e-6, 1 - 1e-6] (|v| -> 0 on background).
/// p, masks: same shape; w = pos_weight.
torch::Tensor weighted_bce(const torch::Tensor& p, const torch::Tensor& masks, double pos_weight);

/// The reconstruction target: the input with every pixel outside the object set to 0.
/// images, masks: [B, 1, S, S] -> [B, 1, S, S].
torch::Tensor masked_reconstruction_target(const torch::Tensor& images, const torch::Tensor& masks);

class SegCapsImpl : public torch::nn::Cloneable<SegCapsImpl> {
 public:
  explicit SegCapsImpl(const SegCapsConfig& config = {});
  void reset() override;
  /// images: [B, 1, S, S] float; masks: [B, 1, S, S] in {0, 1} or undefined. With masks and a decoder
  /// the output also holds the masked reconstruction. Throws std::invalid_argument for other shapes.
  SegCapsOutput forward(const torch::Tensor& images, const torch::Tensor& masks = {});
  /// The decoder on the segmentation capsules masked by the ground truth (only the object's pixels keep
  /// their capsule). capsules: [B, 1, A_seg, S, S], masks: [B, 1, S, S] -> [B, 1, S, S] in (0, 1).
  /// Throws std::invalid_argument without a decoder.
  torch::Tensor decode(const torch::Tensor& capsules, const torch::Tensor& masks);
  /// weighted_bce(|v|, masks, pos_weight) + recon_weight * MSE(reconstruction, image * mask).
  /// out: from forward(images, masks) when recon_weight > 0 (images needed then, ignored otherwise).
  SegCapsLoss loss_terms(const SegCapsOutput& out, const torch::Tensor& masks, const torch::Tensor& images = {}) const;
  /// loss_terms(...).total.
  torch::Tensor loss(const SegCapsOutput& out, const torch::Tensor& masks, const torch::Tensor& images = {}) const;
  /// Fused routing operator (default) or the composite ATen path in every capsule layer.
  void set_fused_routing(bool fused);
  /// Precision of the convolutions: the stem, every capsule layer's (transposed) convolution and the
  /// decoder's 1x1 convolutions. Routing, squash, capsule lengths and the losses stay fp32, each
  /// convolution's output going back to fp32 at once. Runtime only: weights and checkpoints stay fp32.
  void set_precision(Precision precision) { precision_ = precision; }
  Precision precision() const { return precision_; }

  SegCapsConfig config;
  torch::nn::Conv2d stem{nullptr};
  nn::CapsuleConv2d primary{nullptr}, down1{nullptr}, down2{nullptr}, bottom{nullptr}, up1_conv{nullptr}, seg{nullptr};
  nn::CapsuleConvTranspose2d up1{nullptr}, up2{nullptr};
  torch::nn::Sequential decoder{nullptr};  // registered only when recon_weight > 0

 private:
  Precision precision_ = Precision::kFloat32;
};
TORCH_MODULE(SegCaps);

}  // namespace capsnet::models
