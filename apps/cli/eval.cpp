#include <fmt/format.h>

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
  auto* app = root.add_subcommand("eval", "Accuracy and confusion matrix of a checkpoint on MNIST");
  app->add_option("--checkpoint", f->checkpoint, "Checkpoint to evaluate (default: the shipped MNIST model, " + std::string(kShippedModel) + ")");
  add_data_flags(*app, f->data);
  app->add_option("--split", f->split, "test or train")
      ->check(CLI::IsMember({"test", "train"}))
      ->capture_default_str();
  app->add_option("--limit", f->limit, "Only the first N images (0 = all)")->check(CLI::NonNegativeNumber);
  app->add_option("--batch-size", f->batch_size, "Batch size")->check(CLI::PositiveNumber)->capture_default_str();
  app->add_flag("--json", f->json, "Print the result as one JSON object");
  app->add_flag("--no-progress", f->no_progress, "No progress bar");
  add_threads_flag(*app, f->threads);
  add_precision_flag(*app, f->precision);

  return {app, [f]() {
            f->checkpoint = checkpoint_or_shipped(f->checkpoint);
            if (f->threads > 0) set_threads(f->threads);
            auto model = train::load_model(f->checkpoint);
            model->set_precision(nn::parse_precision(f->precision));
            auto split = f->split == "train" ? data::Split::kTrain : data::Split::kTest;
            auto set = data::take(data::load_mnist(f->data.resolved(), split), f->limit);
            auto r = train::evaluate(model, set, f->batch_size, f->no_progress || f->json ? nullptr : &std::cerr);
            if (f->json) {
              nlohmann::json j = {{"checkpoint", f->checkpoint}, {"split", f->split},   {"examples", r.examples},
                                  {"accuracy", r.accuracy},       {"error", 1 - r.accuracy}, {"loss", r.loss}};
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
            }
            return 0;
          }};
}

}  // namespace capsnet::apps::cli
