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

}  // namespace

c10::impl::GenericDict export_dict(models::CapsNet& model, int64_t step, const ExportOptions& options) {
  if (options.probe < 0)
    throw std::invalid_argument(fmt::format("export: probe must be >= 0, got {}", options.probe));
  std::map<std::string, torch::Tensor> state;
  for (const auto& p : model->named_parameters()) state[p.key()] = p.value();
  for (const auto& b : model->named_buffers()) state[b.key()] = b.value();

  c10::impl::GenericDict d(c10::StringType::get(), c10::AnyType::get());  // str -> Any: a mixed Python dict
  d.insert("format", std::string(kWeightsFormat));
  d.insert("version", kWeightsVersion);
  d.insert("config", model->config.to_json().dump());
  d.insert("step", step);
  d.insert("state_dict", tensor_dict(state));

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
  if (out_path.empty()) throw std::invalid_argument("export: --out must not be empty");
  if (std::filesystem::is_directory(out_path))
    throw std::invalid_argument(fmt::format("export: --out {} is a directory; give a file name", out_path));
  std::error_code ec;
  if (std::filesystem::exists(out_path) && std::filesystem::equivalent(out_path, checkpoint_path, ec))
    throw std::invalid_argument(fmt::format("export: --out {} is the checkpoint itself", out_path));
  if (options.probe < 0)
    throw std::invalid_argument(fmt::format("export: --probe must be >= 0, got {}", options.probe));

  auto meta = read_checkpoint_meta(checkpoint_path);
  auto model = load_model(checkpoint_path);
  ExportSummary s;
  s.step = meta.step;
  s.tensors = static_cast<int64_t>(model->named_parameters().size() + model->named_buffers().size());
  s.parameters = models::count_parameters(*model);
  s.bytes = save_weights(out_path, model, meta.step, options);
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
  return w;
}

}  // namespace capsnet::train
