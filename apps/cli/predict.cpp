#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <memory>
#include <type_traits>
#include <variant>
#include <utility>

#include "capsnet/data/idx.h"
#include "capsnet/data/image_file.h"
#include "capsnet/data/transforms.h"
#include "capsnet/train/checkpoint.h"
#include "capsnet/train/export.h"
#include "capsnet/train/json_input.h"
#include "apps/runtime.h"
#include "apps/cli/commands.h"

namespace capsnet::apps::cli {
namespace {
namespace fs = std::filesystem;

/// One thing to classify: an image file, or the images of an IDX file (a batch of rows).
struct Source {
  std::string path;
  bool idx = false;
};

/// Expands the inputs: a directory becomes its image files (recursively, sorted); a file whose name
/// ends in .png/.jpg/.jpeg is an image, any other file an IDX image file.
std::vector<Source> expand_inputs(const std::vector<std::string>& inputs) {
  std::vector<Source> out;
  for (const auto& in : inputs) {
    if (fs::is_directory(in)) {
      std::vector<std::string> files;
      for (const auto& e : fs::recursive_directory_iterator(in, fs::directory_options::follow_directory_symlink))
        if (e.is_regular_file() && data::has_image_extension(e.path().string())) files.push_back(e.path().string());
      if (files.empty()) throw std::invalid_argument(fmt::format("{}: no .png/.jpg/.jpeg files in this directory", in));
      std::sort(files.begin(), files.end());
      for (auto& f : files) out.push_back({std::move(f), false});
    } else {
      out.push_back({in, !data::has_image_extension(in)});
    }
  }
  return out;
}

/// CSV field: quoted when it holds a comma, a quote or a line break.
std::string csv_field(const std::string& s) {
  if (s.find_first_of(",\"\n\r") == std::string::npos) return s;
  std::string q = "\"";
  for (char c : s) q += c == '"' ? std::string("\"\"") : std::string(1, c);
  return q + "\"";
}

/// The network of a checkpoint or weight file as predict uses it: what it takes, and per batch each
/// class's score and pose. CapsNet scores are capsule lengths |v|, matrix capsules' (capsnet em) their
/// activations a, the baseline CNN's its softmax probabilities p (no pose); the prediction is the largest.
struct Classifier {
  train::LoadedModel net;  // kind, network, input spec
  int64_t pose_dim = 0;
  std::string score;       // "length" | "activation" | "probability": the name of the score in every output format
  std::string score_sign;  // how the text format writes it: "|v|" | "a" | "p"
  std::string scores;      // the plural: the JSON key and text label of all classes' scores
  /// images: [n, C, S, S] float in [0, 1] -> scores [n, K], poses [n, K, pose_dim].
  std::function<std::pair<torch::Tensor, torch::Tensor>(const torch::Tensor&)> forward;
};

Classifier load_classifier(const std::string& path, Precision precision) {
  Classifier c{train::load_any_model(path), 0, {}, {}, {}, {}};
  c.net.set_precision(precision);
  std::visit(
      [&c](auto model) {
        using Model = decltype(model);
        if constexpr (std::is_same_v<Model, models::MatrixCapsNet>) {
          c.pose_dim = 16;  // a 4x4 pose matrix, row-major
          c.score = "activation";
          c.score_sign = "a";
          c.scores = "activations";
          c.forward = [model](const torch::Tensor& images) mutable {
            auto o = model(images);
            return std::make_pair(o.activations, o.poses.flatten(2));  // [n, K], [n, K, 16]
          };
        } else if constexpr (std::is_same_v<Model, models::BaselineCnn>) {
          c.score = "probability";
          c.score_sign = "p";
          c.scores = "probabilities";
          c.forward = [model](const torch::Tensor& images) mutable {
            auto p = torch::softmax(model(images).to(torch::kFloat), 1);       // [n, K]
            return std::make_pair(p, p.new_empty({p.size(0), p.size(1), 0}));  // no poses
          };
        } else {
          c.pose_dim = model->config.digit_dim;
          c.score = "length";
          c.score_sign = "|v|";
          c.scores = "lengths";
          c.forward = [model](const torch::Tensor& images) mutable {
            auto o = model(images);
            return std::make_pair(o.lengths, o.digit_caps);  // [n, K], [n, K, D]
          };
        }
      },
      c.net.network);
  return c;
}

/// Writes one line per image in the chosen format.
class PredictionWriter {
 public:
  PredictionWriter(std::ostream& out, std::string format, std::vector<std::string> classes, bool pose,
                   const Classifier& model)
      : out_(out),
        format_(std::move(format)),
        classes_(std::move(classes)),
        pose_(pose),
        score_(model.score),
        scores_(model.scores),
        sign_(model.score_sign) {
    if (format_ != "csv") return;
    out_ << "input,class,label," << score_;
    for (const auto& c : classes_) out_ << "," << csv_field(score_ + "_" + c);
    if (pose_)
      for (int64_t d = 0; d < model.pose_dim; ++d) out_ << ",pose_" << d;
    out_ << '\n';
  }

  /// scores: [K] float; pose: [D] float (the predicted class's capsule).
  void write(const std::string& input, const torch::Tensor& scores, const torch::Tensor& pose) {
    std::vector<double> sv(scores.data_ptr<float>(), scores.data_ptr<float>() + scores.numel());
    const int64_t p = std::max_element(sv.begin(), sv.end()) - sv.begin();
    const std::string& name = classes_[p];
    std::vector<double> pv;
    if (pose_) pv.assign(pose.data_ptr<float>(), pose.data_ptr<float>() + pose.numel());
    if (format_ == "jsonl") {
      nlohmann::json j{{"input", input}, {"class", name}, {"prediction", p}, {score_, sv[p]}, {scores_, sv}};
      if (pose_) j["pose"] = pv;
      out_ << train::dump_json(j) << '\n';
    } else if (format_ == "csv") {
      out_ << csv_field(input) << ',' << csv_field(name) << ',' << p << ',' << fmt::format("{:.6g}", sv[p]);
      for (double v : sv) out_ << fmt::format(",{:.6g}", v);
      for (double v : pv) out_ << fmt::format(",{:.6g}", v);
      out_ << '\n';
    } else {
      out_ << fmt::format("{}: {} ({} = {:.3f}; {} {:.2f})", input, name, sign_, sv[p], scores_, fmt::join(sv, " "));
      if (pose_) out_ << fmt::format(" pose {:.3f}", fmt::join(pv, " "));
      out_ << '\n';
    }
  }

 private:
  std::ostream& out_;
  std::string format_;
  std::vector<std::string> classes_;
  bool pose_;
  std::string score_, scores_, sign_;
};

struct PredictFlags {
  std::string checkpoint, invert = "auto", format = "text", output, fit;
  std::vector<std::string> inputs;
  int64_t limit = 20, batch_size = 256;
  bool json = false, pose = false;
  int threads = 0;
  std::string precision = "fp32";
};

void add_predict_flags(CLI::App& app, PredictFlags& f) {
  app.add_option("inputs", f.inputs,
                 "PNG/JPEG files, directories (every .png/.jpg/.jpeg below, sorted) and/or IDX image files "
                 "([N, S, S] uint8)")
      ->required()
      ->check(CLI::ExistingPath);
  app.add_option("--checkpoint", f.checkpoint, "Trained checkpoint (default: the shipped MNIST model, " + std::string(kShippedModel) + ")");
  app.add_option("--limit", f.limit, "At most N images from each IDX file (0 = all)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_option("--invert", f.invert,
                 "Grey images: invert to white-on-black (auto: when the background is light and the model was "
                 "trained on MNIST or Fashion-MNIST)")
      ->check(CLI::IsMember({"auto", "yes", "no"}))
      ->capture_default_str();
  app.add_option("--image-fit", f.fit,
                 "Images of another size: resize or pad (default: what the model was trained with)")
      ->check(CLI::IsMember({"resize", "pad"}));
  app.add_option("--batch-size", f.batch_size,
                 "Images per forward pass: memory stays bounded by one batch whatever the input size")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--format", f.format, "text, csv (a header, one row per image) or jsonl (one JSON object per image)")
      ->check(CLI::IsMember({"text", "csv", "jsonl"}))
      ->capture_default_str();
  app.add_flag("--json", f.json, "Same as --format jsonl");
  app.add_flag("--pose", f.pose, "Also write the predicted class's capsule: its pose vector (e.g. 16 numbers) or, for matrix capsules, its 4x4 pose matrix row by row");
  app.add_option("--output", f.output, "Write the predictions to this file instead of stdout");
  add_threads_flag(app, f.threads);
  add_precision_flag(app, f.precision);
}

/// Classifies the inputs in batches and writes one line per image; counts what it could not read.
class Predictor {
 public:
  Predictor(const PredictFlags& f, const Classifier& model, std::ostream& out, std::string out_name)
      : f_(f),
        model_(model),
        fit_(data::parse_fit(f.fit.empty() ? model.net.spec.image_fit : f.fit)),
        // Digit models were trained on white-on-black: a light grey background means a scan to invert.
        digit_model_(model.net.spec.dataset != "image-folder"),
        out_(out),
        out_name_(std::move(out_name)),
        writer_(out, f.format, model.net.spec.class_names, f.pose, model) {}

  /// An image file joins the pending batch; an IDX file is classified at once, batch by batch.
  void add(const Source& s) {
    if (!s.idx) {
      pending_.push_back(s.path);
      if (static_cast<int64_t>(pending_.size()) == f_.batch_size) flush_files();
      return;
    }
    flush_files();  // keep the output in input order
    classify_idx(s.path);
  }

  /// Classifies the pending image files and checks that everything was written.
  void finish() {
    flush_files();
    out_.flush();  // the CSV header of an empty input set is written here
    check_written();
  }

  int64_t written() const { return written_; }
  int64_t unreadable() const { return unreadable_; }

 private:
  // A full disk (or /dev/full) fails the stream, not the program: checked after every batch and at the
  // end, so predictions that were not written are never reported as written.
  void check_written() {
    if (!out_)
      throw std::runtime_error(
          fmt::format("cannot write the predictions to {} (disk full or I/O error)", out_name_));
  }

  // An input that cannot be read is reported on stderr and skipped; the others are all classified.
  void skip(const std::string& why) {
    std::cerr << "predict: skipped " << why << "\n";
    ++unreadable_;
  }

  // images: uint8 [n, C, S, S]; names: one per row.
  void run_batch(const torch::Tensor& images, const std::vector<std::string>& names) {
    torch::NoGradGuard no_grad;
    auto [scores_out, poses] = model_.forward(data::to_float(images));  // [n, K], [n, K, D]
    auto scores = scores_out.to(torch::kFloat).contiguous();
    auto pred = scores.argmax(1);                                                                  // [n]
    auto pose = poses.index({torch::arange(pred.size(0)), pred}).to(torch::kFloat).contiguous();  // [n, D]
    for (size_t b = 0; b < names.size(); ++b) writer_.write(names[b], scores[b], pose[b]);
    written_ += static_cast<int64_t>(names.size());
    out_.flush();
    check_written();
  }

  void flush_files() {
    if (pending_.empty()) return;
    std::vector<std::string> errors;
    // images: [n, C, S, S]
    auto images = data::load_image_files(pending_, model_.net.image_channels(), model_.net.image_size(), fit_, &errors);
    std::vector<int64_t> good;
    std::vector<std::string> names;
    for (size_t i = 0; i < pending_.size(); ++i) {
      if (errors[i].empty()) {
        good.push_back(static_cast<int64_t>(i));
        names.push_back(pending_[i]);
      } else {
        skip(errors[i]);
      }
    }
    pending_.clear();
    if (good.empty()) return;
    if (good.size() < errors.size()) images = images.index_select(0, torch::tensor(good));
    if (model_.net.image_channels() == 1 && (f_.invert == "yes" || (f_.invert == "auto" && digit_model_))) {
      for (int64_t i = 0; i < images.size(0); ++i) {
        const bool light = images[i].to(torch::kFloat).mean().item<double>() > 127.5;
        if (f_.invert == "yes" || light) images[i] = 255 - images[i];
      }
    }
    run_batch(images, names);
  }

  void classify_idx(const std::string& path) {
    const int64_t side = model_.net.image_size(), channels = model_.net.image_channels();
    torch::Tensor images;
    try {
      images = data::read_idx(path, f_.limit);  // only the rows used (--limit)
    } catch (const data::IdxError& e) {
      return skip(e.what());
    }
    if (images.dim() == 2) images = images.unsqueeze(0);
    if (images.dim() == 3) images = images.unsqueeze(1);
    if (images.dim() != 4 || images.size(1) != channels || images.size(2) != side || images.size(3) != side)
      return skip(fmt::format("{}: expected IDX images [N, {}, {}]{}, got {}", path, side, side,
                              channels == 1 ? "" : fmt::format(" with {} channels", channels),
                              fmt::join(images.sizes(), "x")));
    // Batched: activations of one batch at a time (the 60k-image file in ~0.5 GB, not ~90 GB).
    const int64_t n = images.size(0);
    for (int64_t start = 0; start < n; start += f_.batch_size) {
      const int64_t len = std::min(f_.batch_size, n - start);
      std::vector<std::string> names;
      for (int64_t i = start; i < start + len; ++i) names.push_back(n == 1 ? path : fmt::format("{}[{}]", path, i));
      run_batch(images.narrow(0, start, len), names);
    }
  }

  const PredictFlags& f_;
  const Classifier& model_;
  data::Fit fit_;
  bool digit_model_;
  std::ostream& out_;
  std::string out_name_;
  PredictionWriter writer_;
  std::vector<std::string> pending_;  // image files waiting for a full batch
  int64_t written_ = 0, unreadable_ = 0;
};

int run_predict(PredictFlags& f) {
  f.checkpoint = checkpoint_or_shipped(f.checkpoint);
  if (f.json) f.format = "jsonl";
  if (!f.output.empty()) {  // every file predict reads: folders expanded to their images
    std::vector<std::string> inputs{f.checkpoint};
    for (const auto& s : expand_inputs(f.inputs)) inputs.push_back(s.path);
    check_not_an_input(f.output, inputs);
  }
  if (f.threads > 0) set_threads(f.threads);
  const auto model = load_classifier(f.checkpoint, precision_from_flag(f.precision));
  if (f.pose && model.pose_dim == 0)
    throw std::invalid_argument(
        fmt::format("--pose: {} holds the baseline CNN, which has no capsule poses", f.checkpoint));
  const auto sources = expand_inputs(f.inputs);

  std::ofstream file;
  if (!f.output.empty()) {
    const auto parent = fs::path(f.output).parent_path();
    if (!parent.empty()) fs::create_directories(parent);
    file.open(f.output);
    if (!file) throw std::runtime_error("cannot write " + f.output);
  }
  std::ostream& out = f.output.empty() ? std::cout : file;
  Predictor predictor(f, model, out, f.output.empty() ? "standard output" : f.output);
  for (const auto& s : sources) predictor.add(s);
  predictor.finish();
  if (!f.output.empty()) {
    file.close();
    if (!file) throw std::runtime_error(fmt::format("cannot write the predictions to {} (disk full or I/O error)",
                                                    f.output));
    std::cerr << fmt::format("wrote {} predictions to {} ({})\n", predictor.written(), f.output, f.format);
  }
  // The exit status says that some inputs were not classified (1).
  if (const int64_t n = predictor.unreadable(); n > 0) {
    std::cerr << fmt::format("predict: {} input{} could not be read (listed above); the other predictions were "
                             "written\n",
                             n, n == 1 ? "" : "s");
    return 1;
  }
  return 0;
}

}  // namespace

Subcommand add_predict(CLI::App& root) {
  auto f = std::make_shared<PredictFlags>();
  auto* app = root.add_subcommand("predict", "Classify image files (PNG, JPEG), folders of them, or IDX image files with a CapsNet, matrix capsules (capsnet em) or the baseline CNN (capsnet affine / stn)");
  add_predict_flags(*app, *f);
  return {app, [f]() { return run_predict(*f); }};
}

}  // namespace capsnet::apps::cli
