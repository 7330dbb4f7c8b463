#pragma once
// Batch construction and augmentation.

#include <torch/torch.h>

namespace capsnet::data {

/// uint8 images [B, H, W] (grey) or [B, C, H, W] -> float32 [B, C, H, W] in [0, 1] (x / 255: the
/// decoder's sigmoid reconstructs exactly this, so no mean/std normalisation).
torch::Tensor to_float(const torch::Tensor& images_u8);

/// Shifts each image by its own random (dx, dy), each uniform in [-max_shift, max_shift], with zero
/// padding (the paper's only augmentation). images: [B, C, H, W] float. Returns the same shape.
/// Deterministic given the generator state.
torch::Tensor random_shift(const torch::Tensor& images, int64_t max_shift, at::Generator& gen);

/// Mirrors each image left-right, independently with probability 1/2: label-preserving for sets whose
/// classes are mirror-symmetric (Fashion-MNIST's clothes; not digits). images: [B, C, H, W]. Returns the same
/// shape. Deterministic given the generator state (B draws).
torch::Tensor random_hflip(const torch::Tensor& images, at::Generator& gen);

/// Shifts image b by (dx[b], dy[b]) pixels (positive = right / down), zero padding.
/// images: [B, C, H, W]; dx, dy: [B] int64. Returns the same shape.
torch::Tensor shift(const torch::Tensor& images, const torch::Tensor& dx, const torch::Tensor& dy);

}  // namespace capsnet::data
