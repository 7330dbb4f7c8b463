#include "capsnet/train/export.h"
#include "capsnet/train/json_input.h"

#include <fmt/format.h>

#include <zlib.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <set>

#include "capsnet/data/files.h"
#include "capsnet/train/checkpoint.h"
#include "capsnet/train/parse_config.h"
#include "capsnet/train/zip_bounds.h"

namespace capsnet::train {
namespace {

c10::Dict<std::string, at::Tensor> tensor_dict(const std::map<std::string, torch::Tensor>& tensors) {
  c10::Dict<std::string, at::Tensor> d;
  // Contiguous CPU copies: the pickled storage must hold exactly the tensor's elements.
  for (const auto& [name, t] : tensors) d.insert(name, t.detach().to(torch::kCPU).contiguous().clone());
  return d;
}

std::map<std::string, torch::Tensor> read_tensor_dict(const std::string& path, const char* key,
                                                      const c10::IValue& value) {
  if (!value.isGenericDict())
    throw ExportError(fmt::format("weights {}: '{}' is not a dict", path, key));
  std::map<std::string, torch::Tensor> out;
  for (const auto& entry : value.toGenericDict()) {
    if (!entry.key().isString() || !entry.value().isTensor())
      throw ExportError(fmt::format("weights {}: '{}' must map names to tensors", path, key));
    out[entry.key().toStringRef()] = entry.value().toTensor();
  }
  return out;
}

// The checksum of a weight file: CRC-32 of its entries in a canonical order (sorted keys; strings,
// integers, and each tensor's name, dtype, shape and bytes), every entry but "crc32" itself. It is
// computed from the values, not the file's bytes, so Python's torch.load still gets a plain dict and
// any change to what a loader would see (a weight, the config, the card, the step) is caught.
class ContentCrc {
 public:
  void bytes(const void* data, size_t n) {
    const auto* p = static_cast<const Bytef*>(data);
    while (n > 0) {  // zlib's length is a uInt
      const auto chunk = static_cast<uInt>(std::min<size_t>(n, size_t{1} << 30));
      crc_ = ::crc32(crc_, p, chunk);
      p += chunk;
      n -= chunk;
    }
  }
  void integer(int64_t v) { bytes(&v, sizeof v); }
  void text(const std::string& s) {
    integer(static_cast<int64_t>(s.size()));
    bytes(s.data(), s.size());
  }
  /// Throws ExportError for a value no weight file holds.
  void value(const std::string& path, const c10::IValue& v) {
    if (v.isString()) {
      integer('s');
      text(v.toStringRef());
    } else if (v.isInt()) {
      integer('i');
      integer(v.toInt());
    } else if (v.isGenericDict()) {
      std::vector<std::pair<std::string, c10::IValue>> entries;
      for (const auto& e : v.toGenericDict()) {
        if (!e.key().isString()) throw ExportError(fmt::format("weights {}: corrupt (a dict key is not a string)", path));
        entries.emplace_back(e.key().toStringRef(), e.value());
      }
      std::sort(entries.begin(), entries.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
      integer('d');
      integer(static_cast<int64_t>(entries.size()));
      for (const auto& [key, inner] : entries) {
        text(key);
        value(path, inner);
      }
    } else if (v.isTensor()) {
      const auto t = v.toTensor().contiguous();
      integer('t');
      integer(static_cast<int64_t>(t.scalar_type()));
      integer(t.dim());
      for (int64_t d : t.sizes()) integer(d);
      bytes(t.data_ptr(), t.nbytes());
    } else {
      throw ExportError(fmt::format("weights {}: corrupt (an entry of type {} is in no weight file)", path,
                                    v.tagKind()));
    }
  }
  int64_t get() const { return static_cast<int64_t>(crc_); }

 private:
  uLong crc_ = ::crc32(0L, Z_NULL, 0);
};

constexpr const char* kChecksumKey = "crc32";

// The file is not a weight file at all (missing, not a pickle, not our dict): try_read_weights says
// nullopt and the caller tries it as a checkpoint. Any later problem is a damaged weight file and is
// reported as such.
class NotWeightsError : public ExportError {
 public:
  using ExportError::ExportError;
};

int64_t content_crc(const std::string& path, const c10::impl::GenericDict& d) {
  c10::impl::GenericDict without(c10::StringType::get(), c10::AnyType::get());
  for (const auto& e : d)
    if (!(e.key().isString() && e.key().toStringRef() == kChecksumKey)) without.insert(e.key(), e.value());
  ContentCrc crc;
  crc.value(path, c10::IValue(without));
  return crc.get();
}

torch::ScalarType storage_dtype(WeightStorage storage) {
  switch (storage) {
    case WeightStorage::kFloat16: return torch::kFloat16;
    case WeightStorage::kBFloat16: return torch::kBFloat16;
    default: return torch::kFloat32;
  }
}

}  // namespace

WeightStorage parse_weight_storage(const std::string& name) {
  if (name == "fp32") return WeightStorage::kFloat32;
  if (name == "fp16") return WeightStorage::kFloat16;
  if (name == "bf16") return WeightStorage::kBFloat16;
  throw std::invalid_argument(fmt::format("export: storage must be fp32, fp16 or bf16, got '{}'", name));
}

std::string weight_storage_name(WeightStorage storage) {
  switch (storage) {
    case WeightStorage::kFloat16: return "fp16";
    case WeightStorage::kBFloat16: return "bf16";
    default: return "fp32";
  }
}

namespace {

// The probe's outputs of one network on images [N, C, H, W] (eval mode, no gradients).
using ProbeOutputs = std::function<std::map<std::string, torch::Tensor>(const torch::Tensor& images)>;

// export_dict for either network: `config` and `image` describe its input side, `probe_outputs` its
// reference outputs.
c10::impl::GenericDict weights_dict(torch::nn::Module& model, const char* kind, const nlohmann::json& config,
                                    int64_t image_channels, int64_t image_size, int64_t step,
                                    const ExportOptions& options, const ProbeOutputs& probe_outputs) {
  if (options.probe < 0)
    throw std::invalid_argument(fmt::format("export: probe must be >= 0, got {}", options.probe));
  const auto dtype = storage_dtype(options.storage);
  std::map<std::string, torch::Tensor> state;
  {
    torch::NoGradGuard no_grad;
    for (const auto& p : model.named_parameters()) {
      // Round the live weights to the stored type, so the probe below (and any later use of this
      // model) computes exactly what a loader of the file will.
      if (dtype != torch::kFloat32 && p.value().is_floating_point()) p.value().copy_(p.value().to(dtype));
      state[p.key()] = p.value().is_floating_point() ? p.value().to(dtype) : p.value();
    }
    for (const auto& b : model.named_buffers())
      state[b.key()] = b.value().is_floating_point() ? b.value().to(dtype) : b.value();
  }

  c10::impl::GenericDict d(c10::StringType::get(), c10::AnyType::get());  // str -> Any: a mixed Python dict
  d.insert("format", std::string(kWeightsFormat));
  d.insert("version", kWeightsVersion);
  d.insert("model", std::string(kind));
  d.insert("config", dump_json(config));
  d.insert("step", step);
  d.insert("state_dict", tensor_dict(state));
  d.insert("storage", weight_storage_name(options.storage));
  if (!options.card.is_null()) d.insert("card", dump_json(options.card));

  if (options.probe > 0) {
    torch::NoGradGuard no_grad;
    const bool was_training = model.is_training();
    model.eval();
    auto gen = at::make_generator<at::CPUGeneratorImpl>(options.probe_seed);
    auto images = torch::rand({options.probe, image_channels, image_size, image_size}, gen);  // [N, C, H, W]
    auto probe = probe_outputs(images);
    model.train(was_training);
    probe["images"] = images;
    d.insert("probe", tensor_dict(probe));
  }
  return d;
}

// Writes a dict of weights_dict plus its checksum.
int64_t write_weights(const std::string& path, c10::impl::GenericDict d) {
  d.insert(kChecksumKey, content_crc(path, d));
  const std::vector<char> bytes = torch::pickle_save(c10::IValue(d));
  try {
    write_file_atomically(path, bytes);  // the checkpoints' writer: also removes orphaned temp files
  } catch (const std::runtime_error& e) {
    throw ExportError(fmt::format("weights {}: {}", path, e.what()));
  }
  return static_cast<int64_t>(bytes.size());
}

}  // namespace

c10::impl::GenericDict export_dict(models::CapsNet& model, int64_t step, const ExportOptions& options) {
  const auto& c = model->config;
  return weights_dict(*model, kCapsNetModel, c.to_json(), c.image_channels, c.image_size, step, options,
                      [&](const torch::Tensor& images) {
                        auto out = model(images);
                        std::map<std::string, torch::Tensor> probe = {{"digit_caps", out.digit_caps},
                                                                      {"lengths", out.lengths}};
                        if (out.reconstruction.defined()) probe["reconstruction"] = out.reconstruction;
                        return probe;
                      });
}

c10::impl::GenericDict export_dict(models::MatrixCapsNet& model, int64_t step, const ExportOptions& options) {
  const auto& c = model->config;
  return weights_dict(*model, kMatrixCapsNetModel, c.to_json(), c.image_channels, c.image_size, step, options,
                      [&](const torch::Tensor& images) {
                        auto out = model(images);
                        return std::map<std::string, torch::Tensor>{{"poses", out.poses},
                                                                    {"activations", out.activations}};
                      });
}

c10::impl::GenericDict export_dict(models::BaselineCnn& model, int64_t step, const ExportOptions& options) {
  const auto& c = model->config;
  return weights_dict(*model, kBaselineCnnModel, c.to_json(), c.image_channels, c.image_size, step, options,
                      [&](const torch::Tensor& images) {
                        return std::map<std::string, torch::Tensor>{{"logits", model(images)}};
                      });
}

int64_t save_weights(const std::string& path, models::CapsNet& model, int64_t step, const ExportOptions& options) {
  return write_weights(path, export_dict(model, step, options));
}

int64_t save_weights(const std::string& path, models::MatrixCapsNet& model, int64_t step,
                     const ExportOptions& options) {
  return write_weights(path, export_dict(model, step, options));
}

int64_t save_weights(const std::string& path, models::BaselineCnn& model, int64_t step,
                     const ExportOptions& options) {
  return write_weights(path, export_dict(model, step, options));
}

ExportSummary export_checkpoint(const std::string& checkpoint_path, const std::string& out_path,
                                const ExportOptions& options) {
  if (out_path.empty()) throw std::invalid_argument("export: the output path must not be empty");
  if (std::filesystem::is_directory(out_path))
    throw std::invalid_argument(fmt::format("export: the output path {} is a directory; give a file name", out_path));
  std::error_code ec;
  if (std::filesystem::exists(out_path) && std::filesystem::equivalent(out_path, checkpoint_path, ec))
    throw std::invalid_argument(fmt::format("export: the output path {} is the checkpoint itself", out_path));
  if (options.probe < 0)
    throw std::invalid_argument(fmt::format("export: probe must be >= 0, got {}", options.probe));

  // A weight file (e.g. the shipped model) re-exports too: to another storage type, or with a probe.
  // The file is read once, for the step, the input spec and the model.
  auto loaded = load_any_model(checkpoint_path);
  // The card carries what predict / eval / serve need beyond the config: class names, image fit, dataset.
  auto with_inputs = options;
  const auto& spec = loaded.spec;
  if (with_inputs.card.is_null()) with_inputs.card = nlohmann::json::object();
  if (with_inputs.card.is_object()) {
    if (!with_inputs.card.contains("classes")) with_inputs.card["classes"] = spec.class_names;
    if (!with_inputs.card.contains("image_fit")) with_inputs.card["image_fit"] = spec.image_fit;
    if (!with_inputs.card.contains("dataset") && !spec.dataset.empty()) with_inputs.card["dataset"] = spec.dataset;
    if (spec.dataset == "image-folder") {
      with_inputs.card.emplace("test_fraction", spec.test_fraction);
      with_inputs.card.emplace("split_seed", spec.split_seed);
    }
    // A MultiMNIST checkpoint's options (batch size, seed, the pairs' generator and overlay): what
    // `capsnet multimnist --eval-only` reads from a checkpoint, so that it reads the weight file alike.
    // A weight file re-exported keeps them.
    const auto& train_options = loaded.train_options;
    if (loaded.weight_file ? train_options.is_object()
                           : train_options.is_object() &&
                                 train_options.value("task", std::string()).rfind("multimnist", 0) == 0)
      with_inputs.card.emplace("train_options", train_options);
  }
  ExportSummary s;
  s.step = loaded.step;
  std::visit(
      [&](auto& model) {
        s.tensors = static_cast<int64_t>(model->named_parameters().size() + model->named_buffers().size());
        s.parameters = models::count_parameters(*model);
        s.bytes = save_weights(out_path, model, loaded.step, with_inputs);
      },
      loaded.network);
  return s;
}

ExportedWeights read_weights(const std::string& path) {
  if (const auto why = data::unreadable_reason(path); !why.empty())
    throw NotWeightsError(fmt::format("weights {}: cannot open: {}", path, why));
  std::ifstream f(path, std::ios::binary);
  if (!f) throw NotWeightsError(fmt::format("weights {}: no such file or not readable", path));
  std::vector<char> bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  // As not-weights: the checkpoint reader that try_read_weights' callers fall back to refuses it too.
  if (const auto why = zip_expansion_problem(bytes.data(), bytes.size()); !why.empty())
    throw NotWeightsError(fmt::format("weights {}: corrupt or hostile: {}; refused before reading", path, why));
  c10::IValue root;
  try {
    root = torch::pickle_load(bytes);
  } catch (const std::exception& e) {
    throw NotWeightsError(fmt::format("weights {}: cannot be read (corrupt or truncated?): {}", path,
                                      std::string(e.what()).substr(0, 200)));
  }
  if (!root.isGenericDict()) throw NotWeightsError(fmt::format("weights {}: not a capsnet weight file", path));
  auto d = root.toGenericDict();
  auto get = [&](const char* key) -> c10::IValue {
    auto it = d.find(c10::IValue(std::string(key)));
    if (it == d.end()) throw ExportError(fmt::format("weights {}: missing '{}' (not a capsnet weight file?)", path, key));
    return it->value();
  };
  const auto format = d.find(c10::IValue(std::string("format")));
  if (format == d.end() || !format->value().isString() || format->value().toStringRef() != kWeightsFormat)
    throw NotWeightsError(fmt::format("weights {}: not a capsnet weight file", path));
  auto version = get("version");
  if (!version.isInt() || version.toInt() != kWeightsVersion)
    throw ExportError(fmt::format("weights {}: unsupported version", path));
  // Only capsnet export writes these files: an unknown entry is a damaged key (it could be the
  // checksum's own, which would otherwise turn a checked file into an unchecked one).
  for (const auto& e : d) {
    static const std::set<std::string> known = {"format",  "version", "model", "config", "step",
                                                "state_dict", "storage", "card", "probe",  kChecksumKey};
    if (!e.key().isString() || !known.count(e.key().toStringRef()))
      throw ExportError(fmt::format("weights {}: corrupt (unknown entry {})", path,
                                    e.key().isString() ? "'" + e.key().toStringRef() + "'" : "of another type"));
  }
  // Files written before the checksum (e.g. the shipped model, whose SHA-256 is pinned) load unchecked.
  if (d.contains(c10::IValue(std::string(kChecksumKey)))) {
    const auto stored = get(kChecksumKey);
    if (!stored.isInt() || stored.toInt() != content_crc(path, d))
      throw ExportError(fmt::format("weights {}: corrupt (checksum mismatch: the file was damaged after it was "
                                    "written)",
                                    path));
  }
  ExportedWeights w;
  if (d.contains(c10::IValue(std::string("model")))) {  // absent in files written before it: a CapsNet
    const auto model = get("model");
    if (!model.isString() || (model.toStringRef() != kCapsNetModel && model.toStringRef() != kMatrixCapsNetModel &&
                              model.toStringRef() != kBaselineCnnModel))
      throw ExportError(fmt::format("weights {}: unknown model (expected '{}', '{}' or '{}')", path, kCapsNetModel,
                                    kMatrixCapsNetModel, kBaselineCnnModel));
    w.model = model.toStringRef();
  }
  auto config = get("config");
  auto step = get("step");
  if (!config.isString() || !step.isInt()) throw ExportError(fmt::format("weights {}: malformed header", path));
  try {
    w.config = parse_json(config.toStringRef(), fmt::format("weights {}: config", path));
  } catch (const std::invalid_argument& e) {
    throw ExportError(e.what());
  }
  w.step = step.toInt();
  w.state_dict = read_tensor_dict(path, "state_dict", get("state_dict"));
  if (d.contains(c10::IValue(std::string("probe")))) w.probe = read_tensor_dict(path, "probe", get("probe"));
  if (d.contains(c10::IValue(std::string("card")))) {
    auto card = get("card");
    if (!card.isString()) throw ExportError(fmt::format("weights {}: 'card' is not a string", path));
    try {
      w.card = parse_json(card.toStringRef(), fmt::format("weights {}: card", path));
    } catch (const std::invalid_argument& e) {
      throw ExportError(e.what());
    }
  }
  return w;
}

std::optional<ExportedWeights> try_read_weights(const std::string& path) {
  // Both formats are zip archives; a weight file is a single pickle (data.pkl) whose dict names its
  // format, a checkpoint is a TorchScript archive. A checkpoint of version 3 says so in its last bytes:
  // not read whole and unpickled here only to be refused (the MultiMNIST model's: 136 MB).
  if (has_checkpoint_trailer(path)) return std::nullopt;
  try {
    return read_weights(path);
  } catch (const NotWeightsError&) {
    return std::nullopt;
  }
}

bool is_weights_file(const std::string& path) {
  try {
    return try_read_weights(path).has_value();
  } catch (const ExportError&) {
    return true;  // a weight file, damaged
  }
}

models::CapsNet load_model_from_weights(const std::string& path) { return model_from_weights(read_weights(path), path); }

namespace {

// Copies the file's tensors into `model` (converted to its dtypes): every name and shape must match.
void copy_state_in(const ExportedWeights& w, const std::string& path, torch::nn::Module& model) {
  torch::NoGradGuard no_grad;
  std::vector<std::string> problems;
  auto copy_in = [&](const std::string& name, torch::Tensor& dst) {
    auto it = w.state_dict.find(name);
    if (it == w.state_dict.end()) return problems.push_back("missing " + name);
    if (it->second.sizes() != dst.sizes())
      return problems.push_back(fmt::format("{}: file has {}, model expects {}", name, c10::str(it->second.sizes()), c10::str(dst.sizes())));
    dst.copy_(it->second.to(dst.scalar_type()));
  };
  size_t expected = 0;
  for (auto& p : model.named_parameters()) copy_in(p.key(), p.value()), ++expected;
  for (auto& b : model.named_buffers()) copy_in(b.key(), b.value()), ++expected;
  if (w.state_dict.size() != expected && problems.empty())
    problems.push_back(fmt::format("{} tensors in the file, {} in the model", w.state_dict.size(), expected));
  if (!problems.empty()) {
    std::string all;
    for (const auto& p : problems) all += (all.empty() ? "" : "; ") + p;
    throw ExportError(fmt::format("weights {}: state dict does not match the config: {}", path, all));
  }
  model.eval();
}

}  // namespace

std::string describe_model_kind(const std::string& kind) {
  if (kind == kMatrixCapsNetModel) return "matrix capsules with EM routing (capsnet em)";
  if (kind == kBaselineCnnModel) return "the baseline CNN";
  return "a CapsNet";
}

namespace {

// ExportError when the file holds another network than `wanted`.
void expect_kind(const ExportedWeights& w, const std::string& path, const char* wanted) {
  if (w.model != wanted)
    throw ExportError(fmt::format("weights {}: holds {}, not {}; eval, export and predict take it, this command "
                                  "does not",
                                  path, describe_model_kind(w.model), describe_model_kind(wanted)));
}

}  // namespace

namespace {

// The network of `kind` that the weights describe, their tensors copied in (eval mode).
template <class Model, class Config>
Model build_from_weights(const ExportedWeights& w, const std::string& path, const char* kind) {
  expect_kind(w, path, kind);
  Model model(parse_config<Config, ExportError>(w.config, fmt::format("weights {}", path)));
  copy_state_in(w, path, *model);
  return model;
}

}  // namespace

models::CapsNet model_from_weights(const ExportedWeights& w, const std::string& path) {
  return build_from_weights<models::CapsNet, models::CapsNetConfig>(w, path, kCapsNetModel);
}

models::MatrixCapsNet matrix_model_from_weights(const ExportedWeights& w, const std::string& path) {
  return build_from_weights<models::MatrixCapsNet, models::MatrixCapsNetConfig>(w, path, kMatrixCapsNetModel);
}

models::BaselineCnn baseline_cnn_from_weights(const ExportedWeights& w, const std::string& path) {
  return build_from_weights<models::BaselineCnn, models::BaselineCnnConfig>(w, path, kBaselineCnnModel);
}

}  // namespace capsnet::train
