#pragma once
// Config I/O from one field list. A config struct lists its fields once:
//
//   template <class Self, class F>
//   static void fields(Self& c, F&& f) { f("image_size", c.image_size); f("stn", c.stn); ... }
//
// and gets JSON in both directions from here, so adding a field is one line in that list.

#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>
#include <type_traits>

namespace capsnet::models::config_io {

/// Every listed field under its name.
template <class Config>
nlohmann::json to_json(const Config& c) {
  nlohmann::json j = nlohmann::json::object();
  Config::fields(c, [&](const char* name, const auto& value) { j[name] = value; });
  return j;
}

/// A config from JSON: missing keys keep their defaults; an unknown key or a wrong type throws
/// std::invalid_argument naming it ("<what>: unknown key 'x'"). An integer may stand for a real, not
/// the reverse (reading 28.5 as an integer would truncate it). The result is validated.
template <class Config>
Config from_json(const nlohmann::json& j, const std::string& what) {
  if (!j.is_object()) throw std::invalid_argument(what + ": expected a JSON object");
  Config c;
  const auto known = to_json(c);
  for (const auto& [key, value] : j.items()) {
    if (!known.contains(key)) throw std::invalid_argument(what + ": unknown key '" + key + "'");
    if (value.type() != known[key].type() && !(value.is_number_integer() && known[key].is_number()))
      throw std::invalid_argument(what + ": wrong type for '" + key + "'");
  }
  Config::fields(c, [&](const char* name, auto& field) {
    if (j.contains(name)) field = j.at(name).template get<std::decay_t<decltype(field)>>();
  });
  c.validate();
  return c;
}

}  // namespace capsnet::models::config_io
