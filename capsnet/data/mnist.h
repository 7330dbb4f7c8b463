#pragma once
// MNIST from its four standard IDX files.

#include <torch/torch.h>

#include <string>
#include <utility>
#include <vector>

namespace capsnet::data {

enum class Split { kTrain, kTest };

/// An in-memory image classification set.
struct ImageSet {
  torch::Tensor images;  // [N, H, W] uint8 (grey; 0 = background) or [N, C, H, W] uint8 (C channels)
  torch::Tensor labels;  // [N] int64
  /// Names of the classes, label i = class_names[i] (image folders: the directory names); empty for
  /// the IDX sets, whose names come from class_names(dataset).
  std::vector<std::string> class_names = {};
  int64_t size() const { return labels.size(0); }
  int64_t channels() const { return images.dim() == 4 ? images.size(1) : 1; }
  int64_t height() const { return images.size(images.dim() - 2); }
  int64_t width() const { return images.size(images.dim() - 1); }
};

/// Paths of the IDX files of `split` inside `dir` (train-images-idx3-ubyte, ... ; a ".gz" sibling is
/// accepted when the plain file is absent).
std::string mnist_images_path(const std::string& dir, Split split);
std::string mnist_labels_path(const std::string& dir, Split split);

/// Loads and validates one split: images [N, 28, 28] uint8, labels [N] int64 in [0, 9], same N.
/// Throws IdxError naming the file on any inconsistency, and a message that says how to fetch
/// the data (scripts/fetch_mnist.sh) when the directory or files are missing.
ImageSet load_mnist(const std::string& dir, Split split);

/// Any labelled IDX pair: images [N, side, side] uint8 (side 0: any square side) and labels [N] in
/// [0, 9], the same N (e.g. a generated 40x40 test set). IdxError naming the file and what it holds
/// otherwise; `what` prefixes the kind in the messages ("MNIST ").
ImageSet load_idx_set(const std::string& images_path, const std::string& labels_path, int64_t side = 0,
                      const std::string& what = "");

/// Names accepted by default_data_dir: "mnist", "fashion-mnist".
const std::vector<std::string>& dataset_names();

/// Default directory of a dataset: "data/mnist" (fetched by scripts/fetch_mnist.sh) or
/// "/usr/share/datasets/fashion-mnist" (Debian package dataset-fashion-mnist; gzipped IDX files).
/// Throws std::invalid_argument listing the names for any other.
std::string default_data_dir(const std::string& dataset);

/// The ten class names of a dataset ("0".."9" for MNIST; "T-shirt/top".."Ankle boot" for Fashion-MNIST).
const std::vector<std::string>& class_names(const std::string& dataset);

/// The first `n` examples (all of them when n <= 0 or n >= size); class names are kept.
ImageSet take(const ImageSet& set, int64_t n);

/// A fixed hold-out split, the same for every seed: (the first size - n examples, the last n examples);
/// the second is empty when n == 0. Throws std::invalid_argument when n < 0 or n >= size.
std::pair<ImageSet, ImageSet> split_tail(const ImageSet& set, int64_t n);

}  // namespace capsnet::data
