#include "capsnet/models/transformer_front.h"

#include <fmt/format.h>

#include <stdexcept>

namespace capsnet::models::transformer_front {

int64_t network_side(bool stn, int64_t image_size, int64_t stn_size) {
  return stn && stn_size > 0 ? stn_size : image_size;
}

void validate(const char* owner, bool stn, int64_t stn_size) {
  if (stn_size < 0) throw std::invalid_argument(fmt::format("{}: stn_size must be >= 0, got {}", owner, stn_size));
  if (stn_size > 0 && !stn)
    throw std::invalid_argument(
        fmt::format("{}: stn_size {} needs stn (the transformer's output side)", owner, stn_size));
}

const char* side_field(bool stn, int64_t stn_size) { return stn && stn_size > 0 ? "stn_size" : "image_size"; }

nn::SpatialTransformer make(int64_t channels, int64_t image_size, int64_t network_side) {
  return nn::SpatialTransformer(nn::SpatialTransformerOptions(channels, image_size, image_size)
                                    .output_height(network_side)
                                    .output_width(network_side));
}

}  // namespace capsnet::models::transformer_front
