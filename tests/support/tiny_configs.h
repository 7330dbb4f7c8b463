#pragma once
// The small model configurations several test files share: each trains in milliseconds per step.
// Tests that need a particular width (e.g. conv2d_at's batch-swapped path) start from one of these
// and change the fields they need, so the reason stays beside the test.

#include <string>

#include "capsnet/models/baseline_cnn.h"
#include "capsnet/models/capspix2pix.h"
#include "capsnet/models/matrix_capsnet.h"
#include "capsnet/models/segcaps.h"

namespace capsnet::testing {

/// The baseline CNN at side x side, narrow (6, 5, 4 channels; 16 and 12 hidden units).
inline models::BaselineCnnConfig tiny_cnn_config(int64_t side = 12, bool pooling = true) {
  models::BaselineCnnConfig c;
  c.image_size = side;
  c.conv1_channels = 6;
  c.conv2_channels = 5;
  c.conv3_channels = 4;
  c.fc1_units = 16;
  c.fc2_units = 12;
  c.pooling = pooling;
  return c;
}

/// Matrix capsules with EM routing on 28x28 inputs: 4 types per capsule layer.
inline models::MatrixCapsNetConfig tiny_em_config(int64_t conv1_channels = 8) {
  models::MatrixCapsNetConfig c;
  c.conv1_channels = conv1_channels;
  c.primary_types = 4;
  c.conv1_caps_types = 4;
  c.conv2_caps_types = 4;
  return c;
}

/// SegCaps at image_size x image_size (12 by default); recon_weight 0 = no reconstruction branch.
inline models::SegCapsConfig tiny_segcaps_config(int64_t image_size = 12, double recon_weight = 0) {
  models::SegCapsConfig c;
  c.image_size = image_size;
  c.stem_channels = 4;
  c.stem_kernel = 3;
  c.primary_types = 2;
  c.primary_atoms = 3;
  c.types = 2;
  c.low_atoms = 3;
  c.high_atoms = 4;
  c.kernel = 3;
  c.seg_atoms = 4;
  c.recon_weight = recon_weight;
  return c;
}

/// CapsPix2pix (generator "caps") or pix2pix ("cnn") at 16x16.
inline models::Pix2pixConfig tiny_pix2pix_config(const std::string& generator, int64_t cnn_channels = 4,
                                                 int64_t disc_channels = 4) {
  models::Pix2pixConfig c;
  c.generator = generator;
  c.image_size = 16;
  c.z_dim = 2;
  c.stem_channels = 4;
  c.primary_types = 2;
  c.primary_atoms = 3;
  c.types = 2;
  c.atoms = 3;
  c.out_atoms = 4;
  c.kernel = 3;
  c.routing_iterations = 2;
  c.cnn_channels = cnn_channels;
  c.disc_channels = disc_channels;
  return c;
}

}  // namespace capsnet::testing
