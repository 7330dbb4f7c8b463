#include <fmt/format.h>
#include <fmt/ranges.h>

#include <iostream>
#include <memory>

#include "capsnet/data/mnist.h"
#include "capsnet/train/checkpoint.h"
#include "capsnet/train/evaluate.h"
#include "apps/runtime.h"
#include "apps/cli/commands.h"

namespace capsnet::apps::cli {

Subcommand add_eval(CLI::App& root) {
  struct Flags {
    DataFlags data;
    std::string checkpoint, split = "test";
    int64_t limit = 0, batch_size = 250;
    bool json = false, no_progress = false;
    int threads = 0;
    std::string precision = "fp32";
  };
  auto f = std::make_shared<Flags>();
  auto* app = root.add_subcommand("eval", "Accuracy and confusion matrix of a checkpoint on MNIST, Fashion-MNIST or an image folder");
  app->add_option("--checkpoint", f->checkpoint, "Checkpoint to evaluate (default: the shipped MNIST model, " + std::string(kShippedModel) + ")");
  add_data_flags(*app, f->data);
  add_image_folder_flags(*app, f->data, /*training=*/false);
  app->add_option("--split", f->split, "test or train")
      ->check(CLI::IsMember({"test", "train"}))
      ->capture_default_str();
  app->add_option("--limit", f->limit, "Only the first N images (0 = all)")->check(CLI::NonNegativeNumber);
  app->add_option("--batch-size", f->batch_size, "Batch size")->check(CLI::PositiveNumber)->capture_default_str();
  app->add_flag("--json", f->json, "Print the result as one JSON object");
  app->add_flag("--no-progress", f->no_progress, "No progress bar");
  add_threads_flag(*app, f->threads);
  add_precision_flag(*app, f->precision);

  return {app, [f, app]() {
            f->checkpoint = checkpoint_or_shipped(f->checkpoint);
            if (f->threads > 0) set_threads(f->threads);
            auto model = train::load_model(f->checkpoint);
            model->set_precision(nn::parse_precision(f->precision));
            const auto spec = train::read_input_spec(f->checkpoint);
            data::ImageSet set;
            if (f->data.is_folder()) {
              // The model's input side, and unless given the fit and split it was trained with.
              auto& d = f->data;
              d.folder.image_size = model->config.image_size;
              if (!app->count("--image-fit")) d.fit = spec.image_fit;
              if (!app->count("--test-fraction")) d.folder.test_fraction = spec.test_fraction;
              if (!app->count("--split-seed")) d.folder.split_seed = spec.split_seed;
              auto loaded = load_labelled_data(d, f->split == "train", f->split == "test", f->limit, f->limit,
                                               f->json ? std::cerr : std::cout);
              if (loaded.channels != model->config.image_channels)
                throw std::invalid_argument(fmt::format("{}: images with {} channel(s), but the model takes {}",
                                                        d.dir, loaded.channels, model->config.image_channels));
              if (loaded.class_names != spec.class_names)
                throw std::invalid_argument(fmt::format(
                    "{}: classes ({}) differ from the model's ({})", d.dir, fmt::join(loaded.class_names, ", "),
                    fmt::join(spec.class_names, ", ")));
              set = f->split == "train" ? *loaded.train : *loaded.test;
              if (set.size() == 0) throw std::invalid_argument(fmt::format("{}: the {} split is empty", d.dir, f->split));
            } else {
              auto split = f->split == "train" ? data::Split::kTrain : data::Split::kTest;
              set = data::take(data::load_mnist(f->data.resolved(), split), f->limit);
            }
            auto r = train::evaluate(model, set, f->batch_size, f->no_progress || f->json ? nullptr : &std::cerr);
            if (f->json) {
              nlohmann::json j = {{"checkpoint", f->checkpoint}, {"split", f->split},   {"examples", r.examples},
                                  {"accuracy", r.accuracy},       {"error", 1 - r.accuracy}, {"loss", r.loss},
                                  {"classes", spec.class_names}};
              auto c = r.confusion.accessor<int64_t, 2>();
              for (int64_t i = 0; i < r.confusion.size(0); ++i) {
                std::vector<int64_t> row(c[i].data(), c[i].data() + r.confusion.size(1));
                j["confusion"].push_back(row);
              }
              std::cout << j.dump() << '\n';
            } else {
              std::cout << fmt::format("{} accuracy: {:.2f}% (error {:.2f}%, {} of {} wrong), loss {:.4f}\n", f->split,
                                       100 * r.accuracy, 100 * (1 - r.accuracy),
                                       r.examples - r.confusion.diag().sum().item<int64_t>(), r.examples, r.loss);
              std::cout << train::format_confusion(r.confusion);
              bool numbered = true;  // names "0".."K-1" need no legend
              for (size_t k = 0; k < spec.class_names.size(); ++k) numbered &= spec.class_names[k] == std::to_string(k);
              if (!numbered) {
                std::vector<std::string> legend;
                for (size_t k = 0; k < spec.class_names.size(); ++k)
                  legend.push_back(fmt::format("{} = {}", k, spec.class_names[k]));
                std::cout << fmt::format("classes: {}\n", fmt::join(legend, ", "));
              }
            }
            return 0;
          }};
}

}  // namespace capsnet::apps::cli
