#pragma once
// One place that turns a stored model config (a checkpoint's or a weight file's JSON) into a Config,
// rethrowing the config's own std::invalid_argument / json errors as the file type's error naming it.

#include <fmt/format.h>

#include <exception>
#include <nlohmann/json.hpp>
#include <string>

namespace capsnet::train {

/// Config::from_json(json); on failure throws Error("<what>: bad model config: ..."), e.g. what = "checkpoint PATH".
template <class Config, class Error>
Config parse_config(const nlohmann::json& json, const std::string& what) {
  try {
    return Config::from_json(json);
  } catch (const std::exception& e) {
    throw Error(fmt::format("{}: bad model config: {}", what, e.what()));
  }
}

}  // namespace capsnet::train
