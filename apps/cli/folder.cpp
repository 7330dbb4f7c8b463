// `capsnet folder`: writes an image folder (DIR/train/<class>/*.png, DIR/test/<class>/...) from MNIST,
// Fashion-MNIST or the generated coloured digits, to try `--data DIR` or as a template for one's own.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <iostream>
#include <memory>

#include "capsnet/data/coloured_digits.h"
#include "capsnet/data/image_folder.h"
#include "capsnet/data/mnist.h"
#include "apps/runtime.h"
#include "apps/cli/commands.h"

namespace capsnet::apps::cli {

Subcommand add_folder(CLI::App& root) {
  struct Flags {
    DataFlags data;
    std::string out, kind = "digits";
    int64_t train_limit = 0, test_limit = 0, side = 32;
    uint64_t seed = 1;
    bool overwrite = false;
    int threads = 0;
  };
  auto f = std::make_shared<Flags>();
  auto* app = root.add_subcommand(
      "folder", "Write an image folder (OUT/train/<class>/*.png, OUT/test/<class>/...) from the IDX data or as "
                "generated coloured digits (3 x 32 x 32)");
  add_data_flags(*app, f->data);
  app->add_option("--out", f->out, "Directory to write")->required();
  app->add_option("--kind", f->kind,
                  "digits: the --dataset's images as grey PNGs; coloured: each digit in a random colour on a "
                  "random-colour background, centred on a --side canvas (RGB PNGs)")
      ->check(CLI::IsMember({"digits", "coloured"}))
      ->capture_default_str();
  app->add_option("--side", f->side, "coloured: canvas side (at least 28)")->capture_default_str();
  app->add_option("--seed", f->seed, "coloured: seed of the colours (test split: seed + 1)")->capture_default_str();
  app->add_option("--train-limit", f->train_limit, "Only the first N training images (0 = all)");
  app->add_option("--test-limit", f->test_limit, "Only the first N test images (0 = all)");
  add_overwrite_flag(*app, f->overwrite);
  add_threads_flag(*app, f->threads);

  return {app, [f]() {
            namespace fs = std::filesystem;
            if (f->threads > 0) set_threads(f->threads);
            if (fs::exists(f->out) && !fs::is_empty(f->out) && !f->overwrite)
              throw std::invalid_argument(fmt::format("{} exists and is not empty; pass --overwrite to replace it", f->out));
            if (f->kind == "coloured" && f->side < 28)
              throw std::invalid_argument(fmt::format("--side must be at least 28 (the digits' side), got {}", f->side));
            // Replacing --out must never touch the input: refuse an --out that is, holds or lies inside the data.
            const auto data_dir = f->data.resolved();
            if (fs::exists(f->out)) {
              const auto out_abs = fs::canonical(f->out), data_abs = fs::weakly_canonical(data_dir);
              auto inside = [](const fs::path& inner, const fs::path& outer) {
                auto [o, i] = std::mismatch(outer.begin(), outer.end(), inner.begin(), inner.end());
                return o == outer.end();
              };
              if (inside(data_abs, out_abs) || inside(out_abs, data_abs))
                throw std::invalid_argument(fmt::format(
                    "--out {} would replace the data it reads ({}): choose an --out outside it", f->out, data_dir));
            }
            // Directory names: a class name with '/' (Fashion-MNIST's "T-shirt/top") would be two levels.
            std::vector<std::string> names = data::class_names(f->data.dataset);
            for (auto& n : names) std::replace(n.begin(), n.end(), '/', '-');
            // Both splits are read (and checked) before anything is written; the folder is written beside
            // --out and takes its place only when complete, so a failure leaves the previous one as it was.
            std::vector<data::ImageSet> sets;
            for (const auto split : {data::Split::kTrain, data::Split::kTest}) {
              const bool train = split == data::Split::kTrain;
              auto set = data::take(data::load_mnist(data_dir, split), train ? f->train_limit : f->test_limit);
              set.class_names = names;
              if (f->kind == "coloured") set = data::coloured_digits(set, f->seed + (train ? 0 : 1), {f->side});
              sets.push_back(std::move(set));
            }
            const auto start = std::chrono::steady_clock::now();
            fs::path out = fs::path(f->out).lexically_normal();
            if (out.filename().empty()) out = out.parent_path();  // "X/" names X
            const fs::path staging = out.parent_path() / ("." + out.filename().string() + ".partial");
            fs::remove_all(staging);
            int64_t files = 0;
            try {
              files += data::write_image_folder(sets[0], (staging / "train").string());
              files += data::write_image_folder(sets[1], (staging / "test").string());
            } catch (...) {
              std::error_code ignored;
              fs::remove_all(staging, ignored);
              throw;
            }
            fs::remove_all(out);  // --overwrite (or empty): the previous folder goes only now
            fs::rename(staging, out);
            const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
            std::cout << fmt::format("wrote {} PNG files to {} in {:.1f} s: {}/train/<class>/, {}/test/<class>/ "
                                     "({} classes: {})\n",
                                     files, f->out, seconds, f->out, f->out, names.size(), fmt::join(names, ", "));
            return 0;
          }};
}

}  // namespace capsnet::apps::cli
