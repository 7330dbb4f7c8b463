#pragma once
// Image-folder datasets, the torchvision ImageFolder convention: one directory per class whose name is
// the class name, PNG or JPEG files inside. Either pre-split (DIR/train/<class>/..., DIR/test/<class>/...)
// or one tree (DIR/<class>/...) split into train and test by a seeded fraction of every class.
// The whole set is decoded once, in parallel, into one uint8 tensor in memory: an epoch then costs no I/O.

#include <torch/torch.h>

#include <string>
#include <vector>

#include "capsnet/data/image_file.h"
#include "capsnet/data/mnist.h"

namespace capsnet::data {

struct ImageFolderOptions {
  /// Side S of the model's square input; every image is brought to S x S by `fit`. 0 = the images'
  /// own size, which must then be square and the same for all of them.
  int64_t image_size = 0;
  Fit fit = Fit::kResize;
  /// One tree (no train/ and test/): this share of every class, drawn with split_seed, is the test split.
  double test_fraction = 0.1;
  uint64_t split_seed = 0;
  /// Unreadable or corrupt files: false = throw naming the file; true = skip it with a warning.
  bool skip_unreadable = false;
};

/// A loaded image folder. Both splits have images [N, C, S, S] uint8 and the same class_names.
struct ImageFolder {
  ImageSet train, test;
  std::vector<std::string> class_names;  // sorted directory names; label i = class_names[i]
  std::vector<std::string> warnings;     // skipped files, ignored non-image files (counts)
  bool presplit = false;                 // train/ and test/ directories (else: split by test_fraction)
};

/// Whether `dir` looks like an image folder (a train/ directory, or class directories holding images)
/// rather than a directory of IDX files.
bool is_image_folder(const std::string& dir);

/// Loads an image folder. Throws std::invalid_argument naming the directory or file for: no class
/// directories, a single class, an empty class, a test class unknown to train, images whose channel
/// count differs from the first image's (grey vs colour), sizes that differ without image_size, and
/// (without skip_unreadable) unreadable files (ImageError).
ImageFolder load_image_folder(const std::string& dir, const ImageFolderOptions& options = {});

/// Decodes `paths` in parallel and fits each to [channels, side, side] (convert_channels, fit_image):
/// uint8 [N, channels, side, side]. For prediction, where one file per class is not required.
/// Throws the first file's ImageError, or with `errors` given fills (*errors)[i] with file i's error
/// ("" when it loaded; its row is then zeros) and throws nothing.
torch::Tensor load_image_files(const std::vector<std::string>& paths, int64_t channels, int64_t side, Fit fit,
                               std::vector<std::string>* errors = nullptr);

/// Writes `set` as DIR/<class>/<index>.png (index zero-padded to sort in order; images [N, H, W] or
/// [N, C, H, W] uint8, C = 1 or 3); class names from set.class_names, else "0".."K-1". Creates DIR.
/// Returns the number of files written. Used to turn IDX or generated sets into image folders.
int64_t write_image_folder(const ImageSet& set, const std::string& dir);

}  // namespace capsnet::data
