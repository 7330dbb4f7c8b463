#include "capsnet/data/mnist.h"
#include "apps/cli/commands.h"
#include "capsnet/kernels/precision.h"
#include "apps/precision_probe.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <chrono>
#include <fstream>
#include <iostream>
#include <stdexcept>

namespace capsnet::apps::cli {

void add_threads_flag(CLI::App& app, int& threads) {
  app.add_option("--threads", threads, "Intra-op threads (0 = all cores)")->check(CLI::NonNegativeNumber);
}

void add_precision_flag(CLI::App& app, std::string& precision) {
  app.add_option("--precision", precision,
                 "Compute precision of the convolutions and decoder: fp32, bf16 (AVX512_BF16/AMX CPUs; fp32 "
                 "weights, fp32 routing and losses) or auto (bf16 where it is measured faster than fp32 on "
                 "this CPU: a one-second probe, cached)")
      ->check(CLI::IsMember({"fp32", "bf16", "auto"}))
      ->capture_default_str();
}

void add_training_precision_flag(CLI::App& app, std::string& precision) {
  // Training defaults to auto: bf16 trained the paper's model to the same first-epoch test accuracy as
  // fp32 (99.02% both, same seed) at 1.6x its speed (docs/kernels.md).
  precision = "auto";
  add_precision_flag(app, precision);
}

Precision precision_from_flag(const std::string& precision) {
  if (precision == "auto") return resolve_auto_precision(std::cerr);  // measured once per machine
  return parse_precision(precision);
}

void write_text_file(const std::string& path, const std::string& text) {
  std::ofstream out(path);
  if (!out) throw std::runtime_error("cannot write " + path);
  out << text;
  if (!out.flush()) throw std::runtime_error("could not write " + path);
}

std::string DataFlags::resolved() const { return dir.empty() ? data::default_data_dir(dataset) : dir; }

void add_data_flags(CLI::App& app, DataFlags& flags) {
  app.add_option("--dataset", flags.dataset,
                 "Image set: mnist (data/mnist, scripts/fetch_mnist.sh) or fashion-mnist "
                 "(Debian package dataset-fashion-mnist)")
      ->check(CLI::IsMember(data::dataset_names()))
      ->capture_default_str();
  app.add_option("--data", flags.dir,
                 "Directory with the four IDX files (default: the --dataset's directory), or for train/eval an "
                 "image folder: DIR/train/<class>/*.png|jpg and DIR/test/<class>/..., or DIR/<class>/... split "
                 "by --test-fraction");
}

bool DataFlags::is_folder() const { return !dir.empty() && data::is_image_folder(dir); }

void add_image_folder_flags(CLI::App& app, DataFlags& flags, bool training) {
  const std::string stored = training ? "" : " (default: what the model was trained with)";
  if (training)
    app.add_option("--image-size", flags.folder.image_size,
                   "Image folders: side S of the model's input, every image resized or padded to S x S "
                   "(0 = the images' own size; they must then all be square and equal)");
  std::vector<CLI::Option*> with_defaults;
  with_defaults.push_back(app.add_option("--image-fit", flags.fit,
                 "Image folders: resize (bilinear, aspect not kept) or pad (centred on black; larger sides "
                 "centre-cropped) images of another size" + stored)
      ->check(CLI::IsMember({"resize", "pad"})));
  with_defaults.push_back(app.add_option(
      "--test-fraction", flags.folder.test_fraction,
      "Image folders without train/ and test/: share of every class held out as the test split" + stored));
  with_defaults.push_back(
      app.add_option("--split-seed", flags.folder.split_seed, "Image folders: seed of the train/test split" + stored));
  if (training)
    for (auto* o : with_defaults) o->capture_default_str();
  app.add_flag("--skip-unreadable", flags.folder.skip_unreadable,
               "Image folders: skip unreadable or corrupt files with a warning (default: stop, naming the file)");
}

LabelledData load_labelled_data(const DataFlags& flags, bool train, bool test, int64_t train_limit,
                                int64_t test_limit, std::ostream& log) {
  LabelledData d;
  if (!flags.is_folder()) {
    const auto dir = flags.resolved();
    if (train) d.train = data::take(data::load_mnist(dir, data::Split::kTrain), train_limit);
    if (test) d.test = data::take(data::load_mnist(dir, data::Split::kTest), test_limit);
    d.class_names = data::class_names(flags.dataset);
    return d;
  }
  auto options = flags.folder;
  options.fit = data::parse_fit(flags.fit);
  const auto start = std::chrono::steady_clock::now();
  auto folder = data::load_image_folder(flags.dir, options);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  for (const auto& w : folder.warnings) log << "warning: " << w << '\n';
  d.folder = true;
  d.class_names = folder.class_names;
  d.channels = folder.train.channels();
  d.side = folder.train.height();
  log << fmt::format("image folder {}: {} classes ({}{}), {} training and {} test images ({}), {}x{}x{} ({}), "
                     "decoded in {:.1f} s\n",
                     flags.dir, folder.class_names.size(),
                     fmt::join(folder.class_names.begin(),
                               folder.class_names.begin() + std::min<size_t>(folder.class_names.size(), 5), ", "),
                     folder.class_names.size() > 5 ? ", ..." : "", folder.train.size(), folder.test.size(),
                     folder.presplit ? "train/ and test/"
                                     : fmt::format("{:g}% of each class held out, seed {}",
                                                   100 * options.test_fraction, options.split_seed),
                     d.channels, d.side, d.side, flags.folder.image_size > 0 ? flags.fit : "own size", seconds);
  // A folder's rows are sorted by class, so "the first N" would be the first classes only: a limit
  // keeps a seeded random N instead (in the folder's order).
  auto subset = [&](const data::ImageSet& set, int64_t n) {
    if (n <= 0 || n >= set.size()) return set;
    auto gen = at::make_generator<at::CPUGeneratorImpl>(options.split_seed);
    auto keep = std::get<0>(torch::randperm(set.size(), gen, torch::kLong).narrow(0, 0, n).sort());
    return data::ImageSet{set.images.index_select(0, keep), set.labels.index_select(0, keep), set.class_names};
  };
  if (train) d.train = subset(folder.train, train_limit);
  if (test) d.test = subset(folder.test, test_limit);
  return d;
}

}  // namespace capsnet::apps::cli
