#include <fmt/format.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <numeric>
#include <stdexcept>

#include "capsnet/data/mnist.h"
#include "capsnet/data/transforms.h"
#include "capsnet/train/checkpoint.h"
#include "capsnet/train/json_input.h"
#include "apps/runtime.h"
#include "capsnet/viz/perturbation.h"
#include "capsnet/viz/png.h"
#include "apps/cli/commands.h"

namespace capsnet::apps::cli {
namespace {

/// The first correctly classified test example of each class (the first example of the class, with a
/// warning, when the model gets none of them right). Returns test-set indices in class order.
std::vector<int64_t> first_correct_per_class(models::CapsNet& model, const data::ImageSet& set) {
  const int64_t K = model->config.num_classes;
  std::vector<int64_t> correct(K, -1), any(K, -1);
  int64_t found = 0;
  torch::NoGradGuard no_grad;
  model->eval();
  for (int64_t start = 0; start < set.size() && found < K; start += 250) {
    const int64_t len = std::min<int64_t>(250, set.size() - start);
    auto images = data::to_float(set.images.narrow(0, start, len));  // [len, 1, 28, 28]
    auto pred = model(images).lengths.argmax(1);                      // [len]
    for (int64_t k = 0; k < len; ++k) {
      const int64_t l = set.labels[start + k].item<int64_t>();
      if (l < 0 || l >= K) continue;
      if (any[l] < 0) any[l] = start + k;
      if (correct[l] < 0 && pred[k].item<int64_t>() == l) {
        correct[l] = start + k;
        ++found;
      }
    }
  }
  std::vector<int64_t> picked;
  for (int64_t l = 0; l < K; ++l) {
    if (correct[l] >= 0) {
      picked.push_back(correct[l]);
    } else if (any[l] >= 0) {
      std::cerr << fmt::format("perturb: no test digit of class {} is classified correctly; using test[{}]\n", l,
                               any[l]);
      picked.push_back(any[l]);
    } else {
      std::cerr << fmt::format("perturb: the test set has no digit of class {}; skipped\n", l);
    }
  }
  return picked;
}

}  // namespace

Subcommand add_perturb(CLI::App& root) {
  struct Flags {
    DataFlags data;
    std::string checkpoint, out = "runs/perturb";
    std::vector<int64_t> indices;
    bool use_label = false;
    double max_offset = 0.25;
    int64_t zoom = 2;
    int threads = 0;
    std::string precision = "fp32";
  };
  auto f = std::make_shared<Flags>();
  auto* app = root.add_subcommand(
      "perturb",
      "What capsule dimensions encode (paper Fig. 4): decode a digit's capsule with each dimension moved by "
      "-0.25..+0.25, one 16x11 PNG per digit");
  app->add_option("--checkpoint", f->checkpoint, "Trained checkpoint (with a decoder) (default: the shipped MNIST model, " + std::string(kShippedModel) + ")");
  add_data_flags(*app, f->data);
  app->add_option("--out", f->out, "Output directory (perturb_<index>_class<k>.png, perturb.json)")
      ->capture_default_str();
  app->add_option("--index", f->indices,
                  "Test-set indices to show (default: the first correctly classified digit of each class)");
  app->add_flag("--use-label", f->use_label, "Perturb the capsule of the label instead of the predicted one");
  app->add_option("--max-offset", f->max_offset, "Largest offset; 5 equal steps on each side of 0")
      ->check(CLI::Range(1e-6, 10.0))
      ->capture_default_str();
  app->add_option("--zoom", f->zoom, "Pixel size of the reconstructions in the PNG")
      ->check(CLI::Range(1, 8))
      ->capture_default_str();
  add_threads_flag(*app, f->threads);
  add_precision_flag(*app, f->precision);

  return {app, [f]() {
            f->checkpoint = checkpoint_or_shipped(f->checkpoint);
            if (f->threads > 0) set_threads(f->threads);
            auto model = train::load_model(f->checkpoint);
            model->set_precision(precision_from_flag(f->precision));
            if (!model->config.reconstruction)
              throw std::invalid_argument(f->checkpoint +
                                          ": this checkpoint has no decoder; train without --no-reconstruction");
            auto set = data::load_mnist(f->data.resolved(), data::Split::kTest);
            for (int64_t i : f->indices)
              if (i < 0 || i >= set.size())
                throw std::invalid_argument(fmt::format(
                    "--index {} is out of range: the test set has {} images (0..{})", i, set.size(), set.size() - 1));
            std::vector<int64_t> indices;
            for (int64_t i : f->indices)  // a repeated index would only overwrite its own PNG
              if (std::find(indices.begin(), indices.end(), i) == indices.end()) indices.push_back(i);
            if (indices.empty()) indices = first_correct_per_class(model, set);
            if (indices.empty()) throw std::invalid_argument("no test digits to show");
            std::filesystem::create_directories(f->out);

            viz::PerturbationOptions options;
            options.offsets = viz::symmetric_offsets(f->max_offset, 5);
            viz::PerturbationFigureLayout layout;
            layout.zoom = f->zoom;
            nlohmann::json report = {{"checkpoint", f->checkpoint},
                                     {"data", f->data.resolved()},
                                     {"capsule", f->use_label ? "label" : "prediction"},
                                     {"offsets", options.offsets},
                                     {"digits", nlohmann::json::array()}};
            for (int64_t index : indices) {
              const int64_t label = set.labels[index].item<int64_t>();
              options.capsule = f->use_label ? std::optional<int64_t>(label) : std::nullopt;
              auto image = data::to_float(set.images.narrow(0, index, 1))[0];  // [1, 28, 28]
              auto p = viz::perturb_capsule(model, image, options);
              auto change = viz::dimension_sensitivity(p);  // [D]
              std::vector<double> change_v(change.data_ptr<float>(), change.data_ptr<float>() + change.numel());
              std::vector<int64_t> order(change_v.size());
              std::iota(order.begin(), order.end(), 0);
              std::stable_sort(order.begin(), order.end(),
                               [&](int64_t a, int64_t b) { return change_v[a] > change_v[b]; });

              const auto name = fmt::format("perturb_{}_class{}.png", index, p.capsule);
              const auto path = (std::filesystem::path(f->out) / name).string();
              auto figure = viz::perturbation_figure(p, layout);
              viz::write_png_gray(path, figure);
              report["digits"].push_back({{"index", index},
                                          {"label", label},
                                          {"prediction", p.prediction},
                                          {"capsule", p.capsule},
                                          {"capsule_length", p.lengths[p.capsule].item<double>()},
                                          {"png", name},
                                          {"mean_abs_change", change_v},
                                          {"dimensions_by_change", order}});
              std::string top;
              for (size_t r = 0; r < std::min<size_t>(3, order.size()); ++r)
                top += fmt::format("{}{} ({:.3f})", r ? ", " : "", order[r], change_v[order[r]]);
              std::cout << fmt::format(
                  "test[{}] label {} prediction {} capsule {} |v|={:.3f}: wrote {} ({}x{} px); most change: dims {}\n",
                  index, label, p.prediction, p.capsule, p.lengths[p.capsule].item<double>(), path, figure.size(1),
                  figure.size(0), top);
            }
            const auto json_path = (std::filesystem::path(f->out) / "perturb.json").string();
            write_text_file(json_path, train::dump_json(report, 1) + "\n");
            std::cout << fmt::format("wrote {} ({} digits, offsets {} .. {})\n", json_path, indices.size(),
                                     options.offsets.front(), options.offsets.back());
            return 0;
          }};
}

}  // namespace capsnet::apps::cli
