#include "capsnet/data/image_folder.h"

#include <ATen/Parallel.h>
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <map>
#include <optional>

#include "capsnet/data/files.h"

namespace capsnet::data {
namespace fs = std::filesystem;
namespace {

bool is_hidden(const fs::path& p) { return !p.filename().empty() && p.filename().string()[0] == '.'; }

/// The class directories of a tree, sorted by name (hidden ones skipped).
std::vector<fs::path> class_dirs(const fs::path& root) {
  std::vector<fs::path> dirs;
  for (const auto& e : fs::directory_iterator(root))
    if (e.is_directory() && !is_hidden(e.path())) dirs.push_back(e.path());
  std::sort(dirs.begin(), dirs.end());
  return dirs;
}

struct Tree {
  std::vector<std::string> names;                 // class directory names, sorted
  std::vector<std::vector<std::string>> files;    // per class: image files, sorted
  int64_t ignored = 0;                            // non-image files
};

/// Every image file under each class directory (recursively, sorted, hidden entries skipped).
Tree scan(const fs::path& root) {
  Tree t;
  for (const auto& dir : class_dirs(root)) {
    std::vector<std::string> files;
    for (auto it = fs::recursive_directory_iterator(dir, fs::directory_options::follow_directory_symlink);
         it != fs::recursive_directory_iterator(); ++it) {
      if (is_hidden(it->path())) {
        if (it->is_directory()) it.disable_recursion_pending();
        continue;
      }
      if (!it->is_regular_file()) continue;
      if (has_image_extension(it->path().string()))
        files.push_back(it->path().string());
      else
        ++t.ignored;
    }
    std::sort(files.begin(), files.end());
    t.names.push_back(escape_invalid_utf8(dir.filename().string()));  // a label, written to JSON
    t.files.push_back(std::move(files));
  }
  return t;
}

void check_classes(const Tree& t, const fs::path& root) {
  if (t.names.empty())
    throw std::invalid_argument(fmt::format(
        "{}: no class directories (an image folder holds one directory of PNG/JPEG files per class)", root.string()));
  for (size_t k = 0; k < t.names.size(); ++k)
    if (t.files[k].empty())
      throw std::invalid_argument(
          fmt::format("{}: class '{}' has no .png/.jpg/.jpeg files", (root / t.names[k]).string(), t.names[k]));
  if (t.names.size() < 2)
    throw std::invalid_argument(fmt::format("{}: only one class ('{}'); a classifier needs at least two",
                                            root.string(), t.names[0]));
}

struct Listing {
  std::vector<std::string> files;
  std::vector<int64_t> labels;
};

/// Decodes `files` in parallel into [N, C, S, S]. `reference` fixes C (and S when side == 0): the first
/// readable file. Returns the kept rows (all of them unless skip_unreadable dropped some).
struct Decoded {
  torch::Tensor images;           // [N_kept, C, S, S]
  std::vector<int64_t> kept;      // indices into files
  std::vector<std::string> skipped;
};

Decoded decode(const std::vector<std::string>& files, int64_t channels, int64_t side, Fit fit, bool exact_size,
               const std::string& reference, bool skip_unreadable) {
  const int64_t n = static_cast<int64_t>(files.size());
  auto out = torch::empty({n, channels, side, side}, torch::kUInt8);
  // One slot per file: an error message ("" = fine). Filled in parallel, read in file order, so the
  // error reported is the first file's whatever the thread timing.
  std::vector<std::string> unreadable(n), invalid(n);
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      torch::Tensor img;
      try {
        img = read_image(files[i]);
      } catch (const ImageError& e) {
        unreadable[i] = e.what();
        continue;
      }
      if (img.size(0) != channels) {
        invalid[i] = fmt::format(
            "{}: {} image ({} channel{}) but {} has {}: an image folder must be all grey or all colour "
            "(convert the files)",
            files[i], img.size(0) == 1 ? "grey" : "colour", img.size(0), img.size(0) == 1 ? "" : "s", reference,
            channels);
        continue;
      }
      if (exact_size && (img.size(1) != side || img.size(2) != side)) {
        invalid[i] = fmt::format(
            "{}: {}x{} image but {} is {}x{}; pass an image size (--image-size) to resize or pad them all",
            files[i], img.size(2), img.size(1), reference, side, side);
        continue;
      }
      out[i].copy_(fit_image(img, side, fit));
    }
  });
  Decoded d;
  for (int64_t i = 0; i < n; ++i) {
    if (!invalid[i].empty()) throw std::invalid_argument(invalid[i]);
    if (!unreadable[i].empty()) {
      if (!skip_unreadable) throw ImageError(unreadable[i] + " (skip such files with --skip-unreadable)");
      d.skipped.push_back(unreadable[i]);
      continue;
    }
    d.kept.push_back(i);
  }
  d.images = static_cast<int64_t>(d.kept.size()) == n ? out : out.index_select(0, torch::tensor(d.kept, torch::kLong));
  return d;
}

ImageSet make_set(const Listing& l, const Decoded& d, const std::vector<std::string>& names) {
  std::vector<int64_t> labels;
  labels.reserve(d.kept.size());
  for (auto i : d.kept) labels.push_back(l.labels[i]);
  return {d.images, torch::tensor(labels, torch::kLong), names};
}

}  // namespace

bool is_image_folder(const std::string& dir) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return false;
  if (fs::is_directory(fs::path(dir) / "train", ec)) return true;
  for (const auto& sub : class_dirs(dir))
    for (const auto& e : fs::directory_iterator(sub))
      if (e.is_regular_file() && has_image_extension(e.path().string())) return true;
  return false;
}

ImageFolder load_image_folder(const std::string& dir, const ImageFolderOptions& options) {
  if (options.image_size < 0)
    throw std::invalid_argument(fmt::format("image_size must be >= 0, got {}", options.image_size));
  if (!(options.test_fraction >= 0 && options.test_fraction < 1))
    throw std::invalid_argument(fmt::format("test_fraction must be in [0, 1), got {}", options.test_fraction));
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) throw std::invalid_argument(fmt::format("{}: not a directory", dir));

  const fs::path root(dir);
  ImageFolder folder;
  folder.presplit = fs::is_directory(root / "train", ec) && fs::is_directory(root / "test", ec);
  const fs::path train_root = fs::is_directory(root / "train", ec) ? root / "train" : root;
  const Tree train_tree = scan(train_root);
  check_classes(train_tree, train_root);
  folder.class_names = train_tree.names;
  int64_t ignored = train_tree.ignored;

  Listing train, test;
  if (folder.presplit) {
    for (size_t k = 0; k < train_tree.names.size(); ++k)
      for (const auto& f : train_tree.files[k]) train.files.push_back(f), train.labels.push_back(k);
    const Tree test_tree = scan(root / "test");
    ignored += test_tree.ignored;
    for (size_t k = 0; k < test_tree.names.size(); ++k) {
      auto it = std::find(folder.class_names.begin(), folder.class_names.end(), test_tree.names[k]);
      if (it == folder.class_names.end())
        throw std::invalid_argument(fmt::format("{}: test class '{}' does not exist in {}",
                                                (root / "test" / test_tree.names[k]).string(), test_tree.names[k],
                                                train_root.string()));
      for (const auto& f : test_tree.files[k])
        test.files.push_back(f), test.labels.push_back(it - folder.class_names.begin());
    }
  } else {
    // Per class, a seeded permutation: the first round(n * fraction) files are the test split, so every
    // class is represented in both splits in proportion (each class keeps at least one training file).
    auto gen = at::make_generator<at::CPUGeneratorImpl>(options.split_seed);
    for (size_t k = 0; k < train_tree.names.size(); ++k) {
      const auto& files = train_tree.files[k];
      const int64_t n = static_cast<int64_t>(files.size());
      const int64_t n_test = std::min<int64_t>(n - 1, std::llround(n * options.test_fraction));
      auto order = torch::randperm(n, gen, torch::kLong);
      const auto* o = order.data_ptr<int64_t>();
      for (int64_t j = 0; j < n; ++j) {
        auto& l = j < n_test ? test : train;
        l.files.push_back(files[o[j]]);
        l.labels.push_back(static_cast<int64_t>(k));
      }
    }
  }

  // The first readable file fixes the channel count (and the side when no image_size is given).
  std::string reference;
  torch::Tensor first;
  for (const auto& f : train.files) {
    try {
      first = read_image(f);
      reference = f;
      break;
    } catch (const ImageError&) {
      if (!options.skip_unreadable) throw;
    }
  }
  if (!first.defined()) throw std::invalid_argument(fmt::format("{}: no readable image", dir));
  const int64_t channels = first.size(0);
  const bool exact = options.image_size == 0;
  if (exact && first.size(1) != first.size(2))
    throw std::invalid_argument(fmt::format(
        "{}: {}x{} is not square; pass an image size (--image-size) to resize or pad the images", reference,
        first.size(2), first.size(1)));
  const int64_t side = exact ? first.size(1) : options.image_size;

  auto dtrain = decode(train.files, channels, side, options.fit, exact, reference, options.skip_unreadable);
  auto dtest = decode(test.files, channels, side, options.fit, exact, reference, options.skip_unreadable);
  folder.train = make_set(train, dtrain, folder.class_names);
  folder.test = make_set(test, dtest, folder.class_names);
  if (folder.train.size() == 0) throw std::invalid_argument(fmt::format("{}: no readable training image", dir));
  for (const auto* d : {&dtrain, &dtest})
    for (const auto& s : d->skipped) folder.warnings.push_back("skipped " + s);
  if (ignored > 0)
    folder.warnings.push_back(
        fmt::format("{}: ignored {} file{} without a .png/.jpg/.jpeg name", dir, ignored, ignored == 1 ? "" : "s"));
  return folder;
}

int64_t write_image_folder(const ImageSet& set, const std::string& dir) {
  const int64_t n = set.size();
  if (!set.images.defined() || (set.images.dim() != 3 && set.images.dim() != 4) || set.images.size(0) != n)
    throw std::invalid_argument("write_image_folder: images must be [N, H, W] or [N, C, H, W] with N labels");
  const int64_t K = n == 0 ? 0 : set.labels.max().item<int64_t>() + 1;
  if (!set.class_names.empty() && static_cast<int64_t>(set.class_names.size()) < K)
    throw std::invalid_argument(fmt::format("write_image_folder: label {} has no class name ({} names)", K - 1,
                                            set.class_names.size()));
  auto name_of = [&](int64_t k) { return set.class_names.empty() ? std::to_string(k) : set.class_names[k]; };
  for (int64_t k = 0; k < K; ++k) {
    const auto name = name_of(k);
    if (name.empty() || name == "." || name == ".." || name.find('/') != std::string::npos || name[0] == '.')
      throw std::invalid_argument(fmt::format("write_image_folder: class name '{}' is not a directory name", name));
  }
  const int width = static_cast<int>(std::to_string(std::max<int64_t>(n - 1, 0)).size());
  const auto images = set.images.dim() == 3 ? set.images.unsqueeze(1) : set.images;  // [N, C, H, W]
  const auto* labels = set.labels.contiguous().data_ptr<int64_t>();
  for (int64_t k = 0; k < K; ++k) fs::create_directories(fs::path(dir) / name_of(k));
  std::vector<std::string> errors(n);
  at::parallel_for(0, n, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      try {
        write_image_png((fs::path(dir) / name_of(labels[i]) / fmt::format("{:0{}}.png", i, width)).string(), images[i]);
      } catch (const std::exception& e) {
        errors[i] = e.what();
      }
    }
  });
  for (const auto& e : errors)
    if (!e.empty()) throw ImageError(e);
  return n;
}

torch::Tensor load_image_files(const std::vector<std::string>& paths, int64_t channels, int64_t side, Fit fit,
                               std::vector<std::string>* errors_out) {
  TORCH_CHECK(channels == 1 || channels == 3, "load_image_files: channels must be 1 or 3, got ", channels);
  const int64_t n = static_cast<int64_t>(paths.size());
  auto out = torch::zeros({n, channels, side, side}, torch::kUInt8);
  std::vector<std::string> errors(n);
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      try {
        out[i].copy_(fit_image(convert_channels(read_image(paths[i]), channels), side, fit));
      } catch (const ImageError& e) {
        errors[i] = e.what();
      }
    }
  });
  if (errors_out != nullptr) {
    *errors_out = std::move(errors);
    return out;
  }
  for (const auto& e : errors)
    if (!e.empty()) throw ImageError(e);
  return out;
}

}  // namespace capsnet::data
