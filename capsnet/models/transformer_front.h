#pragma once
// The optional spatial transformer in front of a classifier (CapsNet, baseline CNN): one square
// transformer from the image_size x image_size input to a network_side x network_side output, which is
// what the classifier behind it is built for. Both model configs spell it with the same two fields,
// `stn` and `stn_size`, and share these rules.

#include <cstdint>

#include "capsnet/nn/spatial_transformer.h"

namespace capsnet::models::transformer_front {

/// Side of the image the classifier sees: stn_size with a transformer that resamples (stn and
/// stn_size > 0), else image_size.
int64_t network_side(bool stn, int64_t image_size, int64_t stn_size);

/// Throws std::invalid_argument "<owner>: stn_size ..." when stn_size < 0 or is set without stn.
void validate(const char* owner, bool stn, int64_t stn_size);

/// The name of the field that sets the classifier's input side, for error messages: "stn_size" when
/// the transformer resamples, else "image_size".
const char* side_field(bool stn, int64_t stn_size);

/// A transformer from channels x image_size^2 to channels x network_side^2.
nn::SpatialTransformer make(int64_t channels, int64_t image_size, int64_t network_side);

}  // namespace capsnet::models::transformer_front
