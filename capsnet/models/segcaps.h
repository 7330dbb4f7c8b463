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
// Sec. 3). Trained with binary cross-entropy on that length. (With one parent type the last layer's
// coupling coefficients are all 1, as in SegCaps.) No reconstruction branch.

#include <torch/torch.h>

#include <nlohmann/json.hpp>

#include "capsnet/nn/capsule_conv.h"

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
  }
  nlohmann::json to_json() const;
  /// Missing keys keep their defaults; unknown keys and wrong types throw std::invalid_argument.
  static SegCapsConfig from_json(const nlohmann::json& j);
};

struct SegCapsOutput {
  torch::Tensor capsules;     // v: [B, 1, A_seg, S, S], the segmentation capsule at every pixel
  torch::Tensor probability;  // |v|: [B, 1, S, S] in [0, 1), foreground probability
};

class SegCapsImpl : public torch::nn::Cloneable<SegCapsImpl> {
 public:
  explicit SegCapsImpl(const SegCapsConfig& config = {});
  void reset() override;
  /// images: [B, 1, S, S] float. Throws std::invalid_argument for another shape.
  SegCapsOutput forward(const torch::Tensor& images);
  /// Binary cross-entropy of the capsule length against masks [B, 1, S, S] in {0, 1}, mean over pixels.
  torch::Tensor loss(const SegCapsOutput& out, const torch::Tensor& masks) const;
  /// Fused routing operator (default) or the composite ATen path in every capsule layer.
  void set_fused_routing(bool fused);

  SegCapsConfig config;
  torch::nn::Conv2d stem{nullptr};
  nn::CapsuleConv2d primary{nullptr}, down1{nullptr}, down2{nullptr}, bottom{nullptr}, up1_conv{nullptr}, seg{nullptr};
  nn::CapsuleConvTranspose2d up1{nullptr}, up2{nullptr};
};
TORCH_MODULE(SegCaps);

}  // namespace capsnet::models
