#include "capsnet/data/mnist.h"

#include "capsnet/data/image_folder.h"

#include "capsnet/data/idx.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <filesystem>

namespace capsnet::data {

namespace fs = std::filesystem;

namespace {

constexpr int64_t kSide = 28;
constexpr int64_t kClasses = 10;

std::string resolve(const std::string& dir, const char* name) {
  const std::string plain = (fs::path(dir) / name).string();
  std::error_code ec;
  if (!fs::exists(plain, ec) && fs::exists(plain + ".gz", ec)) return plain + ".gz";
  return plain;
}

constexpr const char* kFashionDir = "/usr/share/datasets/fashion-mnist";

std::string fetch_hint(const std::string& dir) {
  if (dir.find("fashion") != std::string::npos)
    return "install Fashion-MNIST with 'apt-get install dataset-fashion-mnist' (files in " +
           std::string(kFashionDir) + ")";
  return fmt::format("run scripts/fetch_mnist.sh to download MNIST (scripts/fetch_mnist.sh {} for this "
                     "directory)", dir);
}

std::string shape_str(const torch::Tensor& t) {
  std::string s = "[";
  for (int64_t i = 0; i < t.dim(); ++i) s += (i ? ", " : "") + std::to_string(t.size(i));
  return s + "]";
}

}  // namespace

std::string mnist_images_path(const std::string& dir, Split split) {
  return resolve(dir, split == Split::kTrain ? "train-images-idx3-ubyte" : "t10k-images-idx3-ubyte");
}

std::string mnist_labels_path(const std::string& dir, Split split) {
  return resolve(dir, split == Split::kTrain ? "train-labels-idx1-ubyte" : "t10k-labels-idx1-ubyte");
}

ImageSet load_mnist(const std::string& dir, Split split) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec))
    throw IdxError(fmt::format("{}: MNIST directory not found; {}", dir, fetch_hint(dir)));
  const std::string images_path = mnist_images_path(dir, split);
  const std::string labels_path = mnist_labels_path(dir, split);
  for (const auto& p : {images_path, labels_path}) {
    const bool there = fs::exists(p, ec);
    // A symlink loop or a permission problem is not "missing": say what it is.
    if (ec && ec != std::errc::no_such_file_or_directory)
      throw IdxError(fmt::format("{}: cannot open: {}", p, ec.message()));
    if (!there && is_image_folder(dir))
      throw IdxError(fmt::format("{}: an image folder (class directories), not IDX files: `capsnet train`, `eval` "
                                 "and `predict` read image folders, this command needs MNIST's IDX files",
                                 dir));
    if (!there) throw IdxError(fmt::format("{}: MNIST file missing; {}", p, fetch_hint(dir)));
  }

  return load_idx_set(images_path, labels_path, kSide, "MNIST ");
}

ImageSet load_idx_set(const std::string& images_path, const std::string& labels_path, int64_t side,
                      const std::string& what) {
  ImageSet set{read_idx(images_path), read_idx(labels_path)};
  const bool square = set.images.dim() == 3 && set.images.size(1) == set.images.size(2);
  if (!square || (side > 0 && set.images.size(1) != side))
    throw IdxError(fmt::format("{}: expected {}images of shape [N, {}, {}], got {}", images_path, what,
                               side > 0 ? std::to_string(side) : "S", side > 0 ? std::to_string(side) : "S",
                               shape_str(set.images)));
  if (set.images.scalar_type() != torch::kUInt8)
    throw IdxError(fmt::format("{}: expected uint8 pixels, got {}", images_path, c10::toString(set.images.scalar_type())));
  if (set.labels.dim() != 1)
    throw IdxError(fmt::format("{}: expected {}labels of shape [N], got {}", labels_path, what,
                               shape_str(set.labels)));
  if (set.labels.size(0) != set.images.size(0))
    throw IdxError(fmt::format("{}: {} labels but {} has {} images", labels_path, set.labels.size(0),
                               images_path, set.images.size(0)));
  const auto labels = set.labels.to(torch::kLong);
  const auto bad = (labels >= kClasses).logical_or(labels < 0).nonzero();
  if (bad.size(0) > 0) {
    const int64_t i = bad[0][0].item<int64_t>();
    throw IdxError(fmt::format("{}: label {} at index {} is out of range [0, 9]", labels_path,
                               set.labels[i].item<int64_t>(), i));
  }
  set.labels = labels;
  return set;
}

const std::vector<std::string>& dataset_names() {
  static const std::vector<std::string> names = {"mnist", "fashion-mnist"};
  return names;
}

std::string default_data_dir(const std::string& dataset) {
  if (dataset == "mnist") return "data/mnist";
  if (dataset == "fashion-mnist") return kFashionDir;
  throw std::invalid_argument(
      fmt::format("unknown dataset '{}' (expected one of: {})", dataset, fmt::join(dataset_names(), ", ")));
}

const std::vector<std::string>& class_names(const std::string& dataset) {
  static const std::vector<std::string> digits = {"0", "1", "2", "3", "4", "5", "6", "7", "8", "9"};
  static const std::vector<std::string> fashion = {"T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
                                                   "Sandal",      "Shirt",   "Sneaker",  "Bag",   "Ankle boot"};
  if (dataset == "fashion-mnist") return fashion;
  default_data_dir(dataset);  // throws for an unknown name
  return digits;
}

ImageSet take(const ImageSet& set, int64_t n) {
  if (n <= 0 || n >= set.size()) return set;
  return {set.images.narrow(0, 0, n), set.labels.narrow(0, 0, n), set.class_names};
}

std::pair<ImageSet, ImageSet> split_tail(const ImageSet& set, int64_t n) {
  if (n < 0 || n >= set.size())
    throw std::invalid_argument(fmt::format("a hold-out of {} leaves no examples of {}", n, set.size()));
  const int64_t keep = set.size() - n;
  ImageSet head{set.images.narrow(0, 0, keep), set.labels.narrow(0, 0, keep), set.class_names};
  ImageSet tail{set.images.narrow(0, keep, n), set.labels.narrow(0, keep, n), set.class_names};
  return {head, tail};
}

}  // namespace capsnet::data
