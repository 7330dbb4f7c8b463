#include "capsnet/train/checkpoint.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>

namespace capsnet::train {
namespace {

constexpr const char* kFormat = "capsnet-checkpoint";
constexpr int64_t kVersion = 1;

void fsync_path(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY);
  if (fd >= 0) {
    ::fsync(fd);
    ::close(fd);
  }
}

torch::serialize::InputArchive open_archive(const std::string& path) {
  if (!std::filesystem::exists(path)) throw CheckpointError(fmt::format("checkpoint {}: no such file", path));
  torch::serialize::InputArchive archive;
  try {
    archive.load_from(path);
  } catch (const std::exception& e) {
    throw CheckpointError(fmt::format("checkpoint {}: cannot be read (corrupt or truncated?): {}", path,
                                      std::string(e.what()).substr(0, 200)));
  }
  return archive;
}

CheckpointMeta parse_meta(const std::string& path, torch::serialize::InputArchive& archive) {
  c10::IValue value;
  if (!archive.try_read("meta", value) || !value.isString())
    throw CheckpointError(fmt::format("checkpoint {}: no capsnet metadata (not a capsnet checkpoint?)", path));
  try {
    auto j = nlohmann::json::parse(value.toStringRef());
    if (j.value("format", "") != kFormat)
      throw CheckpointError(fmt::format("checkpoint {}: not a capsnet checkpoint", path));
    if (j.value("version", int64_t{0}) != kVersion)
      throw CheckpointError(fmt::format("checkpoint {}: unsupported version {}", path, j.value("version", 0)));
    CheckpointMeta meta;
    meta.step = j.at("step").get<int64_t>();
    meta.model_config = j.at("model");
    meta.train_options = j.value("train", nlohmann::json::object());
    return meta;
  } catch (const nlohmann::json::exception& e) {
    throw CheckpointError(fmt::format("checkpoint {}: malformed metadata: {}", path, e.what()));
  }
}

}  // namespace

void save_checkpoint(const std::string& path, models::CapsNet& model, torch::optim::Optimizer* optimizer,
                     const CheckpointMeta& meta) {
  torch::serialize::OutputArchive archive;
  nlohmann::json j = {{"format", kFormat},
                      {"version", kVersion},
                      {"step", meta.step},
                      {"model", meta.model_config},
                      {"train", meta.train_options}};
  archive.write("meta", c10::IValue(j.dump()));
  torch::serialize::OutputArchive model_archive;
  model->save(model_archive);
  archive.write("model", model_archive);
  if (optimizer) {
    torch::serialize::OutputArchive optimizer_archive;
    optimizer->save(optimizer_archive);
    archive.write("optimizer", optimizer_archive);
  }
  {
    auto gen = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    archive.write("rng_cpu", gen.get_state());
  }

  const auto parent = std::filesystem::path(path).parent_path();
  if (!parent.empty()) std::filesystem::create_directories(parent);
  const std::string tmp = fmt::format("{}.tmp.{}", path, ::getpid());
  try {
    archive.save_to(tmp);
  } catch (const std::exception& e) {
    std::remove(tmp.c_str());
    throw CheckpointError(fmt::format("checkpoint {}: write failed: {}", path, e.what()));
  }
  fsync_path(tmp);
  std::filesystem::rename(tmp, path);  // atomic on POSIX: readers see the old or the new file
  fsync_path(parent.empty() ? "." : parent.string());
}

CheckpointMeta read_checkpoint_meta(const std::string& path) {
  auto archive = open_archive(path);
  return parse_meta(path, archive);
}

CheckpointMeta load_checkpoint(const std::string& path, models::CapsNet& model, torch::optim::Optimizer* optimizer) {
  auto archive = open_archive(path);
  auto meta = parse_meta(path, archive);
  // Compared through from_json: a checkpoint written before a config field existed stores no key for
  // it, which means the field's default (e.g. "stn": false).
  if (models::CapsNetConfig::from_json(meta.model_config).to_json() != model->config.to_json())
    throw CheckpointError(fmt::format("checkpoint {}: model config {} does not match the model being loaded {}",
                                      path, meta.model_config.dump(), model->config.to_json().dump()));
  try {
    torch::serialize::InputArchive model_archive;
    archive.read("model", model_archive);
    model->load(model_archive);
    if (optimizer) {
      torch::serialize::InputArchive optimizer_archive;
      if (!archive.try_read("optimizer", optimizer_archive))
        throw CheckpointError(fmt::format("checkpoint {}: has no optimizer state (cannot resume)", path));
      optimizer->load(optimizer_archive);
    }
    torch::Tensor rng;
    if (archive.try_read("rng_cpu", rng)) {
      auto gen = at::detail::getDefaultCPUGenerator();
      std::lock_guard<std::mutex> lock(gen.mutex());
      gen.set_state(rng);
    }
  } catch (const CheckpointError&) {
    throw;
  } catch (const std::exception& e) {
    throw CheckpointError(fmt::format("checkpoint {}: incompatible or damaged contents: {}", path,
                                      std::string(e.what()).substr(0, 300)));
  }
  return meta;
}

models::CapsNet load_model(const std::string& path) {
  auto meta = read_checkpoint_meta(path);
  models::CapsNetConfig config;
  try {
    config = models::CapsNetConfig::from_json(meta.model_config);
  } catch (const std::exception& e) {
    throw CheckpointError(fmt::format("checkpoint {}: bad model config: {}", path, e.what()));
  }
  models::CapsNet model(config);
  load_checkpoint(path, model, nullptr);
  model->eval();
  return model;
}

}  // namespace capsnet::train
