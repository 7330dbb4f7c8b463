#include <fmt/format.h>
#include <fmt/ranges.h>

#include <iostream>
#include <memory>

#include "capsnet/data/mnist.h"
#include "capsnet/train/checkpoint.h"
#include "apps/experiments/em.h"
#include "capsnet/train/export.h"
#include "capsnet/train/evaluate.h"
#include "capsnet/train/json_input.h"
#include "apps/runtime.h"
#include "apps/cli/commands.h"

namespace capsnet::apps::cli {

Subcommand add_eval(CLI::App& root) {
  struct Flags {
    DataFlags data;
    std::string checkpoint, split = "test", images, labels;
    int64_t limit = 0, batch_size = 250;
    bool json = false, no_progress = false;
    int threads = 0;
    std::string precision = "fp32";
  };
  auto f = std::make_shared<Flags>();
  auto* app = root.add_subcommand("eval", "Accuracy and confusion matrix of a checkpoint or weight file (CapsNet, or matrix capsules from capsnet em) on MNIST, Fashion-MNIST or an image folder");
  app->add_option("--checkpoint", f->checkpoint, "Checkpoint to evaluate (default: the shipped MNIST model, " + std::string(kShippedModel) + ")");
  add_data_flags(*app, f->data);
  add_image_folder_flags(*app, f->data, /*training=*/false);
  auto* images = app->add_option("--images", f->images,
                                 "Score this IDX image file instead of --data (N x S x S uint8, S the model's input "
                                 "side, e.g. a generated 40x40 test set); needs --labels");
  auto* labels = app->add_option("--labels", f->labels, "IDX label file of --images (N labels in 0..9)");
  images->needs(labels);
  labels->needs(images);
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
            const auto precision = parse_precision(f->precision);
            // Either network: a CapsNet, or matrix capsules with EM routing (capsnet em).
            const bool matrix = train::stored_model(f->checkpoint) == train::kMatrixCapsNetModel;
            models::CapsNet capsnet{nullptr};
            models::MatrixCapsNet matrix_caps{nullptr};
            int64_t image_size = 0, image_channels = 0;
            if (matrix) {
              matrix_caps = train::load_matrix_model(f->checkpoint);
              matrix_caps->set_precision(precision);
              image_size = matrix_caps->config.image_size;
              image_channels = matrix_caps->config.image_channels;
            } else {
              capsnet = train::load_model(f->checkpoint);
              capsnet->set_precision(precision);
              image_size = capsnet->config.image_size;
              image_channels = capsnet->config.image_channels;
            }
            const auto spec = train::read_input_spec(f->checkpoint);
            data::ImageSet set;
            if (!f->images.empty()) {
              if (image_channels != 1)
                throw std::invalid_argument(fmt::format("{}: IDX images have 1 channel, but the model takes {}",
                                                        f->images, image_channels));
              // Any labelled set whose side matches the model, e.g. a generated 40x40 test set.
              set = data::take(data::load_idx_set(f->images, f->labels), f->limit);
              if (set.images.size(1) != image_size)
                throw std::invalid_argument(fmt::format("{}: images are {}x{}, but the model {} takes {}x{}", f->images,
                                                        set.images.size(1), set.images.size(2), f->checkpoint,
                                                        image_size, image_size));
              const auto classes = static_cast<int64_t>(spec.class_names.size());
              if (set.size() > 0 && set.labels.max().item<int64_t>() >= classes)
                throw std::invalid_argument(fmt::format("{}: label {} is not a class of the model ({} classes)",
                                                        f->labels, set.labels.max().item<int64_t>(), classes));
            } else if (f->data.is_folder()) {
              if (matrix)
                throw std::invalid_argument(fmt::format(
                    "{}: matrix-capsule models are evaluated on IDX data (--dataset mnist or fashion-mnist)",
                    f->checkpoint));
              // The model's input side, and unless given the fit and split it was trained with.
              auto& d = f->data;
              d.folder.image_size = image_size;
              if (!app->count("--image-fit")) d.fit = spec.image_fit;
              if (!app->count("--test-fraction")) d.folder.test_fraction = spec.test_fraction;
              if (!app->count("--split-seed")) d.folder.split_seed = spec.split_seed;
              auto loaded = load_labelled_data(d, f->split == "train", f->split == "test", f->limit, f->limit,
                                               f->json ? std::cerr : std::cout);
              if (loaded.channels != image_channels)
                throw std::invalid_argument(fmt::format("{}: images with {} channel(s), but the model takes {}",
                                                        d.dir, loaded.channels, image_channels));
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
            const std::string split_name = f->images.empty() ? f->split : f->images;
            std::ostream* progress = f->no_progress || f->json ? nullptr : &std::cerr;
            train::EvalResult r;
            if (matrix) {
              auto e = experiments::evaluate_em(matrix_caps, set, /*count=*/0, f->batch_size, experiments::kFinalSpreadMargin,
                                          progress);
              r.examples = e.examples;
              r.accuracy = e.accuracy;
              r.loss = e.loss;
              r.confusion = e.confusion;
            } else {
              r = train::evaluate(capsnet, set, f->batch_size, progress);
            }
            const char* model_kind = matrix ? train::kMatrixCapsNetModel : train::kCapsNetModel;
            if (f->json) {
              nlohmann::json j = {{"checkpoint", f->checkpoint}, {"model", model_kind}, {"split", split_name},
                                  {"examples", r.examples},
                                  {"accuracy", r.accuracy},       {"error", 1 - r.accuracy}, {"loss", r.loss},
                                  {"classes", spec.class_names}};
              auto c = r.confusion.accessor<int64_t, 2>();
              for (int64_t i = 0; i < r.confusion.size(0); ++i) {
                std::vector<int64_t> row(c[i].data(), c[i].data() + r.confusion.size(1));
                j["confusion"].push_back(row);
              }
              std::cout << train::dump_json(j) << '\n';
            } else {
              std::cout << fmt::format("{} accuracy: {:.2f}% (error {:.2f}%, {} of {} wrong), {}loss {:.4f}\n", split_name,
                                       100 * r.accuracy, 100 * (1 - r.accuracy),
                                       r.examples - r.confusion.diag().sum().item<int64_t>(), r.examples,
                                       matrix ? "spread " : "", r.loss);
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
