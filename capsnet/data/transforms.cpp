#include "capsnet/data/transforms.h"

namespace capsnet::data {

torch::Tensor to_float(const torch::Tensor& images_u8) {
  TORCH_CHECK((images_u8.dim() == 3 || images_u8.dim() == 4) && images_u8.scalar_type() == torch::kUInt8,
              "to_float: expected uint8 images [B, H, W] or [B, C, H, W], got ", images_u8.scalar_type(), " ",
              images_u8.sizes());
  auto nchw = images_u8.dim() == 3 ? images_u8.unsqueeze(1) : images_u8;
  return nchw.to(torch::kFloat).div_(255);  // [B, C, H, W]
}

torch::Tensor shift(const torch::Tensor& images, const torch::Tensor& dx, const torch::Tensor& dy) {
  TORCH_CHECK(images.dim() == 4, "shift: images must be [B, C, H, W], got ", images.sizes());
  const int64_t B = images.size(0), C = images.size(1), H = images.size(2), W = images.size(3);
  for (const auto* t : {&dx, &dy}) {
    TORCH_CHECK(t->dim() == 1 && t->size(0) == B, "shift: dx and dy must be [B] with B = ", B,
                ", got ", t->sizes());
    TORCH_CHECK(!t->is_floating_point() && !t->is_complex() && t->scalar_type() != torch::kBool,
                "shift: dx and dy must be integer tensors, got ", t->scalar_type());
  }
  // One gather over the flattened image: output (y, x) reads input (y - dy, x - dx), and reads
  // that fall outside the image become zero.
  const auto long_on = torch::TensorOptions().dtype(torch::kLong).device(images.device());
  const auto sx = dx.to(long_on).view({B, 1, 1});
  const auto sy = dy.to(long_on).view({B, 1, 1});
  const auto src_y = torch::arange(H, long_on).view({1, H, 1}) - sy;  // [B, H, 1]
  const auto src_x = torch::arange(W, long_on).view({1, 1, W}) - sx;  // [B, 1, W]
  const auto valid = ((src_y >= 0) & (src_y < H)) & ((src_x >= 0) & (src_x < W));  // [B, H, W]
  const auto index = (src_y.clamp(0, H - 1) * W + src_x.clamp(0, W - 1)).view({B, 1, H * W});
  auto out = images.reshape({B, C, H * W}).gather(2, index.expand({B, C, H * W}));
  return out.view({B, C, H, W}).masked_fill_(valid.logical_not().unsqueeze(1), 0);
}

torch::Tensor random_shift(const torch::Tensor& images, int64_t max_shift, at::Generator& gen) {
  TORCH_CHECK(max_shift >= 0, "random_shift: max_shift must be >= 0, got ", max_shift);
  TORCH_CHECK(images.dim() == 4, "random_shift: images must be [B, C, H, W], got ", images.sizes());
  if (max_shift == 0) return images;
  const int64_t B = images.size(0);
  // Drawn on the CPU generator whatever the images' device, so a seed gives the same shifts everywhere.
  auto dx = torch::randint(-max_shift, max_shift + 1, {B}, gen, torch::kLong);
  auto dy = torch::randint(-max_shift, max_shift + 1, {B}, gen, torch::kLong);
  return shift(images, dx, dy);
}

torch::Tensor random_hflip(const torch::Tensor& images, at::Generator& gen) {
  TORCH_CHECK(images.dim() == 4, "random_hflip: images must be [B, C, H, W], got ", images.sizes());
  const int64_t B = images.size(0);
  // Drawn on the CPU generator whatever the images' device, as random_shift's shifts.
  const auto mirrored = torch::randint(0, 2, {B}, gen, torch::kLong).to(images.device()).eq(1).view({B, 1, 1, 1});
  return torch::where(mirrored, images.flip({3}), images);
}

}  // namespace capsnet::data
