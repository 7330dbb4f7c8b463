#pragma once
// Coloured digits: MNIST digits painted in a random colour on a random-colour background, padded to a
// larger canvas. A generated stand-in for a 3-channel data set (CIFAR-10 and smallNORB cannot be
// downloaded here) that exercises the colour path end to end with a known answer: the class is the
// digit, the colours are nuisance.

#include <cstdint>

#include "capsnet/data/mnist.h"

namespace capsnet::data {

struct ColouredDigitsOptions {
  int64_t side = 32;            // canvas side; the digit is centred (side >= the source's side)
  double min_contrast = 96;     // least |luma(foreground) - luma(background)|, 0..255
};

/// source: grey digits [N, h, w] uint8 (e.g. MNIST). Returns [N, 3, side, side] uint8: per image a
/// background colour and a foreground colour drawn from `seed` (deterministic), blended by the digit's
/// intensity: pixel = bg + (fg - bg) * digit / 255. Labels and class names are the source's.
ImageSet coloured_digits(const ImageSet& source, uint64_t seed, const ColouredDigitsOptions& options = {});

}  // namespace capsnet::data
