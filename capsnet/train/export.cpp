#include "capsnet/train/export.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>

#include "capsnet/train/checkpoint.h"

namespace capsnet::train {
namespace {

void fsync_path(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY);
  if (fd >= 0) {
    ::fsync(fd);
    ::close(fd);
  }
}

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

c10::impl::GenericDict export_dict(models::CapsNet& model, int64_t step, const ExportOptions& options) {
  if (options.probe < 0)
    throw std::invalid_argument(fmt::format("export: probe must be >= 0, got {}", options.probe));
  const auto dtype = storage_dtype(options.storage);
  std::map<std::string, torch::Tensor> state;
  {
    torch::NoGradGuard no_grad;
    for (const auto& p : model->named_parameters()) {
      // Round the live weights to the stored type, so the probe below (and any later use of this
      // model) computes exactly what a loader of the file will.
      if (dtype != torch::kFloat32 && p.value().is_floating_point()) p.value().copy_(p.value().to(dtype));
      state[p.key()] = p.value().is_floating_point() ? p.value().to(dtype) : p.value();
    }
    for (const auto& b : model->named_buffers())
      state[b.key()] = b.value().is_floating_point() ? b.value().to(dtype) : b.value();
  }

  c10::impl::GenericDict d(c10::StringType::get(), c10::AnyType::get());  // str -> Any: a mixed Python dict
  d.insert("format", std::string(kWeightsFormat));
  d.insert("version", kWeightsVersion);
  d.insert("config", model->config.to_json().dump());
  d.insert("step", step);
  d.insert("state_dict", tensor_dict(state));
  d.insert("storage", weight_storage_name(options.storage));
  if (!options.card.is_null()) d.insert("card", options.card.dump());

  if (options.probe > 0) {
    const auto& c = model->config;
    torch::NoGradGuard no_grad;
    const bool was_training = model->is_training();
    model->eval();
    auto gen = at::make_generator<at::CPUGeneratorImpl>(options.probe_seed);
    auto images = torch::rand({options.probe, c.image_channels, c.image_size, c.image_size}, gen);  // [N, C, H, W]
    auto out = model(images);
    model->train(was_training);
    std::map<std::string, torch::Tensor> probe = {
        {"images", images}, {"digit_caps", out.digit_caps}, {"lengths", out.lengths}};
    if (out.reconstruction.defined()) probe["reconstruction"] = out.reconstruction;
    d.insert("probe", tensor_dict(probe));
  }
  return d;
}

int64_t save_weights(const std::string& path, models::CapsNet& model, int64_t step, const ExportOptions& options) {
  const std::vector<char> bytes = torch::pickle_save(c10::IValue(export_dict(model, step, options)));
  const auto parent = std::filesystem::path(path).parent_path();
  std::error_code ec;
  if (!parent.empty()) std::filesystem::create_directories(parent, ec);
  if (ec) throw ExportError(fmt::format("weights {}: cannot create directory {}: {}", path, parent.string(), ec.message()));
  const std::string tmp = fmt::format("{}.tmp.{}", path, ::getpid());
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    f.close();
    if (!f) {
      std::remove(tmp.c_str());
      throw ExportError(fmt::format("weights {}: write failed (cannot write {})", path, tmp));
    }
  }
  fsync_path(tmp);
  std::filesystem::rename(tmp, path, ec);  // atomic on POSIX: readers see the old or the new file
  if (ec) {
    std::remove(tmp.c_str());
    throw ExportError(fmt::format("weights {}: rename failed: {}", path, ec.message()));
  }
  fsync_path(parent.empty() ? "." : parent.string());
  return static_cast<int64_t>(bytes.size());
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
  const auto weights_in = try_read_weights(checkpoint_path);  // read once, used for the step and the model
  const int64_t step = weights_in ? weights_in->step : read_checkpoint_meta(checkpoint_path).step;
  auto model = weights_in ? model_from_weights(*weights_in, checkpoint_path) : load_model(checkpoint_path);
  ExportSummary s;
  s.step = step;
  s.tensors = static_cast<int64_t>(model->named_parameters().size() + model->named_buffers().size());
  s.parameters = models::count_parameters(*model);
  // The card carries what predict / eval / serve need beyond the config: class names, image fit, dataset.
  auto with_inputs = options;
  const auto spec = read_input_spec(checkpoint_path);
  if (with_inputs.card.is_null()) with_inputs.card = nlohmann::json::object();
  if (with_inputs.card.is_object()) {
    if (!with_inputs.card.contains("classes")) with_inputs.card["classes"] = spec.class_names;
    if (!with_inputs.card.contains("image_fit")) with_inputs.card["image_fit"] = spec.image_fit;
    if (!with_inputs.card.contains("dataset") && !spec.dataset.empty()) with_inputs.card["dataset"] = spec.dataset;
    if (spec.dataset == "image-folder") {
      with_inputs.card.emplace("test_fraction", spec.test_fraction);
      with_inputs.card.emplace("split_seed", spec.split_seed);
    }
  }
  s.bytes = save_weights(out_path, model, step, with_inputs);
  return s;
}

ExportedWeights read_weights(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw ExportError(fmt::format("weights {}: no such file or not readable", path));
  std::vector<char> bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  c10::IValue root;
  try {
    root = torch::pickle_load(bytes);
  } catch (const std::exception& e) {
    throw ExportError(fmt::format("weights {}: cannot be read (corrupt or truncated?): {}", path,
                                  std::string(e.what()).substr(0, 200)));
  }
  if (!root.isGenericDict()) throw ExportError(fmt::format("weights {}: not a capsnet weight file", path));
  auto d = root.toGenericDict();
  auto get = [&](const char* key) -> c10::IValue {
    auto it = d.find(c10::IValue(std::string(key)));
    if (it == d.end()) throw ExportError(fmt::format("weights {}: missing '{}' (not a capsnet weight file?)", path, key));
    return it->value();
  };
  auto format = get("format");
  if (!format.isString() || format.toStringRef() != kWeightsFormat)
    throw ExportError(fmt::format("weights {}: not a capsnet weight file", path));
  auto version = get("version");
  if (!version.isInt() || version.toInt() != kWeightsVersion)
    throw ExportError(fmt::format("weights {}: unsupported version", path));
  ExportedWeights w;
  auto config = get("config");
  auto step = get("step");
  if (!config.isString() || !step.isInt()) throw ExportError(fmt::format("weights {}: malformed header", path));
  try {
    w.config = nlohmann::json::parse(config.toStringRef());
  } catch (const nlohmann::json::exception& e) {
    throw ExportError(fmt::format("weights {}: config is not JSON: {}", path, e.what()));
  }
  w.step = step.toInt();
  w.state_dict = read_tensor_dict(path, "state_dict", get("state_dict"));
  if (d.contains(c10::IValue(std::string("probe")))) w.probe = read_tensor_dict(path, "probe", get("probe"));
  if (d.contains(c10::IValue(std::string("card")))) {
    auto card = get("card");
    if (!card.isString()) throw ExportError(fmt::format("weights {}: 'card' is not a string", path));
    try {
      w.card = nlohmann::json::parse(card.toStringRef());
    } catch (const nlohmann::json::exception& e) {
      throw ExportError(fmt::format("weights {}: card is not JSON: {}", path, e.what()));
    }
  }
  return w;
}

std::optional<ExportedWeights> try_read_weights(const std::string& path) {
  // Both formats are zip archives; a weight file is a single pickle (data.pkl) whose dict names its
  // format, a checkpoint is a TorchScript archive.
  try {
    return read_weights(path);
  } catch (const ExportError&) {
    return std::nullopt;
  }
}

bool is_weights_file(const std::string& path) { return try_read_weights(path).has_value(); }

models::CapsNet load_model_from_weights(const std::string& path) { return model_from_weights(read_weights(path), path); }

models::CapsNet model_from_weights(const ExportedWeights& w, const std::string& path) {
  models::CapsNetConfig config;
  try {
    config = models::CapsNetConfig::from_json(w.config);
  } catch (const std::exception& e) {
    throw ExportError(fmt::format("weights {}: bad model config: {}", path, e.what()));
  }
  models::CapsNet model(config);
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
  for (auto& p : model->named_parameters()) copy_in(p.key(), p.value()), ++expected;
  for (auto& b : model->named_buffers()) copy_in(b.key(), b.value()), ++expected;
  if (w.state_dict.size() != expected && problems.empty())
    problems.push_back(fmt::format("{} tensors in the file, {} in the model", w.state_dict.size(), expected));
  if (!problems.empty()) {
    std::string all;
    for (const auto& p : problems) all += (all.empty() ? "" : "; ") + p;
    throw ExportError(fmt::format("weights {}: state dict does not match the config: {}", path, all));
  }
  model->eval();
  return model;
}

}  // namespace capsnet::train
