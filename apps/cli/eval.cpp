#include <fmt/format.h>
#include <fmt/ranges.h>

#include <iostream>
#include <functional>
#include <memory>
#include <type_traits>
#include <variant>

#include "capsnet/data/mnist.h"
#include "capsnet/train/checkpoint.h"
#include "apps/experiments/em.h"
#include "capsnet/train/export.h"
#include "capsnet/train/evaluate.h"
#include "capsnet/train/json_input.h"
#include "apps/runtime.h"
#include "apps/cli/commands.h"

namespace capsnet::apps::cli {

namespace {

struct EvalFlags {
  DataFlags data;
  std::vector<std::string> checkpoints;  // more than one: their ensemble
  std::string checkpoint, split = "test", images, labels;  // checkpoint: the first (named in messages)
  int64_t limit = 0, batch_size = 250, val = 0;
  bool json = false, no_progress = false;
  int threads = 0;
  std::string precision = "fp32";
};

/// The network of a checkpoint or weight file, as eval scores it.
struct ScoredModel {
  train::LoadedModel net;  // kind, network, input spec
  std::string loss_name;  // how the text output names the loss: "" or "spread " (EM)
  std::function<train::EvalResult(const data::ImageSet&, int64_t batch_size, std::ostream* progress)> evaluate;
};

ScoredModel load_scored_model(const std::string& path, Precision precision) {
  ScoredModel m{train::load_any_model(path), "", nullptr};
  m.net.set_precision(precision);
  std::visit(
      [&m](auto model) {
        if constexpr (std::is_same_v<decltype(model), models::MatrixCapsNet>) {
          m.loss_name = "spread ";
          m.evaluate = [model](const data::ImageSet& set, int64_t batch_size, std::ostream* progress) mutable {
            auto e = experiments::evaluate_em(model, set, /*count=*/0, batch_size, experiments::kFinalSpreadMargin,
                                              progress);
            train::EvalResult r;
            r.examples = e.examples;
            r.accuracy = e.accuracy;
            r.loss = e.loss;
            r.confusion = e.confusion;
            return r;
          };
        } else {  // CapsNet or the baseline CNN
          m.evaluate = [model](const data::ImageSet& set, int64_t batch_size, std::ostream* progress) mutable {
            return train::evaluate(model, set, batch_size, progress);
          };
        }
      },
      m.net.network);
  return m;
}

/// Any labelled IDX set whose side matches the model, e.g. a generated 40x40 test set.
data::ImageSet idx_eval_set(const EvalFlags& f, const ScoredModel& m) {
  if (m.net.image_channels() != 1)
    throw std::invalid_argument(
        fmt::format("{}: IDX images have 1 channel, but the model takes {}", f.images, m.net.image_channels()));
  auto set = data::take(data::load_idx_set(f.images, f.labels), f.limit);
  if (set.images.size(1) != m.net.image_size())
    throw std::invalid_argument(fmt::format("{}: images are {}x{}, but the model {} takes {}x{}", f.images,
                                            set.images.size(1), set.images.size(2), f.checkpoint, m.net.image_size(),
                                            m.net.image_size()));
  const auto classes = static_cast<int64_t>(m.net.spec.class_names.size());
  if (set.size() > 0 && set.labels.max().item<int64_t>() >= classes)
    throw std::invalid_argument(fmt::format("{}: label {} is not a class of the model ({} classes)", f.labels,
                                            set.labels.max().item<int64_t>(), classes));
  return set;
}

/// A split of an image folder, read at the model's side and (unless given) with the fit and split it was
/// trained with.
data::ImageSet folder_eval_set(EvalFlags& f, const CLI::App& app, const ScoredModel& m) {
  const auto& spec = m.net.spec;
  if (m.net.kind == train::kMatrixCapsNetModel)
    throw std::invalid_argument(fmt::format(
        "{}: matrix-capsule models are evaluated on IDX data (--dataset mnist or fashion-mnist)", f.checkpoint));
  auto& d = f.data;
  d.folder.image_size = m.net.image_size();
  if (!app.count("--image-fit")) d.fit = spec.image_fit;
  if (!app.count("--test-fraction")) d.folder.test_fraction = spec.test_fraction;
  if (!app.count("--split-seed")) d.folder.split_seed = spec.split_seed;
  auto loaded = load_labelled_data(d, f.split == "train", f.split == "test", f.limit, f.limit,
                                   f.json ? std::cerr : std::cout);
  if (loaded.channels != m.net.image_channels())
    throw std::invalid_argument(fmt::format("{}: images with {} channel(s), but the model takes {}", d.dir,
                                            loaded.channels, m.net.image_channels()));
  if (loaded.class_names != spec.class_names)
    throw std::invalid_argument(fmt::format("{}: classes ({}) differ from the model's ({})", d.dir,
                                            fmt::join(loaded.class_names, ", "), fmt::join(spec.class_names, ", ")));
  auto set = f.split == "train" ? *loaded.train : *loaded.test;
  if (set.size() == 0) throw std::invalid_argument(fmt::format("{}: the {} split is empty", d.dir, f.split));
  return set;
}

/// The set eval scores: --images/--labels, an image folder, or an MNIST-format split.
data::ImageSet eval_set(EvalFlags& f, const CLI::App& app, const ScoredModel& m) {
  if (!f.images.empty()) return idx_eval_set(f, m);
  if (f.data.is_folder()) return folder_eval_set(f, app, m);
  if (m.net.image_size() != 28)
    throw std::invalid_argument(fmt::format("{}: the model takes {}x{} images, but --dataset is 28x28; score a set "
                                            "of its side with --images/--labels (e.g. from capsnet affine "
                                            "--write-sets)",
                                            f.checkpoint, m.net.image_size(), m.net.image_size()));
  if (f.val > 0) {  // the validation split of capsnet train --val N: the last N training images
    const auto train_set = data::load_mnist(f.data.resolved(), data::Split::kTrain);
    if (f.val >= train_set.size())
      throw std::invalid_argument(fmt::format("--val {} is not less than the {} training images of {}", f.val,
                                              train_set.size(), f.data.resolved()));
    return data::take(data::split_tail(train_set, f.val).second, f.limit);
  }
  auto split = f.split == "train" ? data::Split::kTrain : data::Split::kTest;
  return data::take(data::load_mnist(f.data.resolved(), split), f.limit);
}

/// A [K, K] int64 confusion matrix as JSON rows.
nlohmann::json confusion_rows(const torch::Tensor& confusion) {
  nlohmann::json rows = nlohmann::json::array();
  auto c = confusion.accessor<int64_t, 2>();
  for (int64_t i = 0; i < confusion.size(0); ++i)
    rows.push_back(std::vector<int64_t>(c[i].data(), c[i].data() + confusion.size(1)));
  return rows;
}

/// The name of the scored set in the output.
std::string split_name(const EvalFlags& f) {
  if (!f.images.empty()) return f.images;
  if (f.val > 0) return "validation";
  return f.split;
}

/// Every --checkpoint as a CapsNet of the first one's input and classes, for an ensemble.
std::vector<models::CapsNet> ensemble_members(const EvalFlags& f, const ScoredModel& first, Precision precision) {
  std::vector<models::CapsNet> members;
  for (const auto& path : f.checkpoints) {
    auto m = path == f.checkpoint ? first : load_scored_model(path, precision);
    const auto* net = std::get_if<models::CapsNet>(&m.net.network);
    if (net == nullptr)
      throw std::invalid_argument(fmt::format("{}: an ensemble takes CapsNet checkpoints; this file holds {}", path,
                                              train::describe_model_kind(m.net.kind)));
    if (m.net.image_size() != first.net.image_size() || m.net.image_channels() != first.net.image_channels() ||
        m.net.spec.class_names != first.net.spec.class_names)
      throw std::invalid_argument(fmt::format(
          "{}: an ensemble's models must share input and classes: it takes {}x{}x{} images of classes ({}), {} "
          "takes {}x{}x{} of ({})",
          path, m.net.image_channels(), m.net.image_size(), m.net.image_size(), fmt::join(m.net.spec.class_names, ", "),
          f.checkpoint, first.net.image_channels(), first.net.image_size(), first.net.image_size(),
          fmt::join(first.net.spec.class_names, ", ")));
    members.push_back(*net);
  }
  return members;
}

void print_ensemble(const EvalFlags& f, const ScoredModel& first, const train::EnsembleResult& e) {
  const auto& r = e.ensemble;
  if (f.json) {
    nlohmann::json j = {{"checkpoints", f.checkpoints},   {"model", "capsnet-ensemble"},
                        {"split", split_name(f)},         {"examples", r.examples},
                        {"accuracy", r.accuracy},         {"error", 1 - r.accuracy},
                        {"member_accuracy", e.member_accuracy}, {"classes", first.net.spec.class_names}};
    j["confusion"] = confusion_rows(r.confusion);
    std::cout << train::dump_json(j) << '\n';
    return;
  }
  for (size_t m = 0; m < f.checkpoints.size(); ++m)
    std::cout << fmt::format("  {:.2f}%  {}\n", 100 * e.member_accuracy[m], f.checkpoints[m]);
  std::cout << fmt::format("{} accuracy of the ensemble of {} models (capsule lengths averaged): {:.2f}% (error "
                           "{:.2f}%, {} of {} wrong)\n",
                           split_name(f), f.checkpoints.size(), 100 * r.accuracy, 100 * (1 - r.accuracy),
                           r.examples - r.confusion.diag().sum().item<int64_t>(), r.examples);
  std::cout << train::format_confusion(r.confusion);
}

void print_eval(const EvalFlags& f, const ScoredModel& m, const std::string& split_name, const train::EvalResult& r) {
  const auto& spec = m.net.spec;
  if (f.json) {
    nlohmann::json j = {{"checkpoint", f.checkpoint}, {"model", m.net.kind},  {"split", split_name},
                        {"examples", r.examples},     {"accuracy", r.accuracy}, {"error", 1 - r.accuracy},
                        {"loss", r.loss},             {"classes", spec.class_names}};
    j["confusion"] = confusion_rows(r.confusion);
    std::cout << train::dump_json(j) << '\n';
    return;
  }
  std::cout << fmt::format("{} accuracy: {:.2f}% (error {:.2f}%, {} of {} wrong), {}loss {:.4f}\n", split_name,
                           100 * r.accuracy, 100 * (1 - r.accuracy),
                           r.examples - r.confusion.diag().sum().item<int64_t>(), r.examples, m.loss_name, r.loss);
  std::cout << train::format_confusion(r.confusion);
  bool numbered = true;  // names "0".."K-1" need no legend
  for (size_t k = 0; k < spec.class_names.size(); ++k) numbered &= spec.class_names[k] == std::to_string(k);
  if (!numbered) {
    std::vector<std::string> legend;
    for (size_t k = 0; k < spec.class_names.size(); ++k) legend.push_back(fmt::format("{} = {}", k, spec.class_names[k]));
    std::cout << fmt::format("classes: {}\n", fmt::join(legend, ", "));
  }
}

}  // namespace

Subcommand add_eval(CLI::App& root) {
  auto f = std::make_shared<EvalFlags>();
  auto* app = root.add_subcommand("eval", "Accuracy and confusion matrix of a checkpoint or weight file (CapsNet, matrix capsules from capsnet em, or the baseline CNN of capsnet affine / stn) on MNIST, Fashion-MNIST, an image folder or any IDX set");
  app->add_option("--checkpoint", f->checkpoints,
                  "Checkpoint or weight file to evaluate (default: the shipped MNIST model, " +
                      std::string(kShippedModel) +
                      "); given more than once (CapsNets of one input side and class list), their ensemble: each "
                      "image's capsule lengths averaged over the models, each model's own accuracy beside it");
  add_data_flags(*app, f->data);
  add_image_folder_flags(*app, f->data, /*training=*/false);
  auto* images = app->add_option("--images", f->images,
                                 "Score this IDX image file instead of --data (N x S x S uint8, S the model's input "
                                 "side, e.g. a generated 40x40 test set); needs --labels");
  auto* labels = app->add_option("--labels", f->labels, "IDX label file of --images (N labels in 0..9)");
  images->needs(labels);
  labels->needs(images);
  auto* split = app->add_option("--split", f->split, "test or train")
                    ->check(CLI::IsMember({"test", "train"}))
                    ->capture_default_str();
  app->add_option("--val", f->val,
                  "Score the last N training images instead: the validation split that capsnet train --val N held "
                  "out (MNIST-format data)")
      ->check(CLI::NonNegativeNumber)
      ->excludes(split)
      ->excludes(images);
  app->add_option("--limit", f->limit, "Only the first N images (0 = all)")->check(CLI::NonNegativeNumber);
  app->add_option("--batch-size", f->batch_size, "Batch size")->check(CLI::PositiveNumber)->capture_default_str();
  app->add_flag("--json", f->json, "Print the result as one JSON object");
  app->add_flag("--no-progress", f->no_progress, "No progress bar");
  add_threads_flag(*app, f->threads);
  add_precision_flag(*app, f->precision);

  return {app, [f, app]() {
            if (f->checkpoints.empty()) f->checkpoints.emplace_back();
            for (auto& c : f->checkpoints) c = checkpoint_or_shipped(c);
            f->checkpoint = f->checkpoints.front();
            if (f->val > 0 && f->data.is_folder())
              throw std::invalid_argument("--val scores MNIST-format data; image folders take --split");
            if (f->threads > 0) set_threads(f->threads);
            const auto precision = precision_from_flag(f->precision);
            const auto model = load_scored_model(f->checkpoint, precision);
            std::ostream* progress = f->no_progress || f->json ? nullptr : &std::cerr;
            if (f->checkpoints.size() > 1) {
              auto members = ensemble_members(*f, model, precision);
              const auto set = eval_set(*f, *app, model);
              print_ensemble(*f, model, train::evaluate_ensemble(members, set, f->batch_size, progress));
              return 0;
            }
            const auto set = eval_set(*f, *app, model);
            const auto r = model.evaluate(set, f->batch_size, progress);
            print_eval(*f, model, split_name(*f), r);
            return 0;
          }};
}

}  // namespace capsnet::apps::cli
