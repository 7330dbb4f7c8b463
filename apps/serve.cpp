// One of the two translation units that include httplib.h (a heavy header), with deadline_server.cpp.
#include "apps/serve.h"

#include <fmt/format.h>
#include <httplib.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <stdexcept>

#include "apps/deadline_server.h"
#include "capsnet/train/json_input.h"

namespace capsnet::apps {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

// Invalid UTF-8 (e.g. a run folder named in Latin-1) is replaced, never a reason for a 500.
ApiResponse json_response(int status, const json& body) {
  return {status, body.dump(-1, ' ', false, json::error_handler_t::replace), "application/json"};
}
ApiResponse error_response(int status, const std::string& message) {
  return json_response(status, json{{"error", message}});
}

std::vector<float> to_vector(const torch::Tensor& t) {
  auto c = t.detach().to(torch::kFloat).contiguous();
  return std::vector<float>(c.data_ptr<float>(), c.data_ptr<float>() + c.numel());
}

/// Parses a JSON object body; std::nullopt (and `error` set) when it is not one.
std::optional<json> parse_object(const std::string& body, std::string& error) {
  auto j = train::parse_json_or_discarded(body);
  if (j.is_discarded()) {
    error = fmt::format("request body is not valid JSON of at most {} levels", train::kMaxJsonDepth);
    return std::nullopt;
  }
  if (!j.is_object()) {
    error = "request body must be a JSON object";
    return std::nullopt;
  }
  return j;
}

/// Reads `key` as an array of exactly `n` finite numbers (within [lo, hi]); empty string on success.
std::string read_numbers(const json& j, const std::string& key, size_t n, double lo, double hi,
                         std::vector<float>& out) {
  auto it = j.find(key);
  if (it == j.end()) return fmt::format("missing field '{}'", key);
  if (!it->is_array()) return fmt::format("'{}' must be an array of {} numbers", key, n);
  if (it->size() != n) return fmt::format("'{}' must have {} values, got {}", key, n, it->size());
  out.resize(n);
  for (size_t i = 0; i < n; ++i) {
    const auto& x = (*it)[i];
    if (!x.is_number()) return fmt::format("'{}'[{}] is not a number", key, i);
    const double v = x.get<double>();
    if (!std::isfinite(v) || v < lo || v > hi)
      return fmt::format("'{}'[{}] = {} is outside [{}, {}]", key, i, v, lo, hi);
    out[i] = static_cast<float>(v);
  }
  return {};
}

bool malformed_run_name(const std::string& run) {
  if (run.empty() || run.size() > 512) return true;
  if (run.find('\\') != std::string::npos || run.find('\0') != std::string::npos) return true;
  if (run.front() == '/') return true;
  // Any ".." component, wherever it is.
  size_t start = 0;
  while (start <= run.size()) {
    size_t end = run.find('/', start);
    if (end == std::string::npos) end = run.size();
    if (run.compare(start, end - start, "..") == 0) return true;
    start = end + 1;
  }
  return false;
}

std::vector<std::string> list_runs(const std::string& runs_dir) {
  std::vector<std::string> names;
  std::error_code ec;
  if (runs_dir.empty() || !fs::is_directory(runs_dir, ec)) return names;
  const fs::path root(runs_dir);
  // Symlinks are neither followed nor listed: the panel reads only files that live under runs_dir.
  fs::recursive_directory_iterator it(root, fs::directory_options::skip_permission_denied, ec), end;
  for (; !ec && it != end; it.increment(ec)) {
    if (it.depth() > 6) {
      it.disable_recursion_pending();
      continue;
    }
    const auto& entry = *it;
    if (entry.path().filename() != "metrics.jsonl") continue;
    if (!fs::is_regular_file(entry.symlink_status(ec))) continue;
    auto rel = entry.path().parent_path().lexically_relative(root).generic_string();
    names.push_back(rel.empty() ? "." : rel);
    if (names.size() >= 2000) break;
  }
  std::sort(names.begin(), names.end());
  return names;
}

bool is_loopback(const std::string& host) { return host == "127.0.0.1" || host == "localhost" || host == "::1"; }

/// The host part of a Host header ("127.0.0.1:8080" -> "127.0.0.1", "[::1]:80" -> "::1").
std::string host_of(const std::string& header) {
  if (!header.empty() && header.front() == '[') {
    auto close = header.find(']');
    return close == std::string::npos ? header : header.substr(1, close - 1);
  }
  auto colon = header.find(':');
  return colon == std::string::npos ? header : header.substr(0, colon);
}

}  // namespace

// ---------------------------------------------------------------------------------------------------
// LiveViewerApi

LiveViewerApi::LiveViewerApi(models::CapsNet model, ServeOptions options)
    : model_(std::move(model)), options_(std::move(options)) {
  if (!model_) throw std::invalid_argument("LiveViewerApi: model is null");
  if (!model_->config.reconstruction || !model_->decoder)
    throw std::invalid_argument("LiveViewerApi: the model has no decoder (trained with --no-reconstruction)");
  if (model_->config.image_channels != 1)
    throw std::invalid_argument(fmt::format("LiveViewerApi: image_channels must be 1, got {}",
                                            model_->config.image_channels));
  if (options_.max_body_bytes < 1024)
    throw std::invalid_argument(
        fmt::format("ServeOptions::max_body_bytes must be at least 1024, got {}", options_.max_body_bytes));
  if (options_.worker_threads < 1)
    throw std::invalid_argument(
        fmt::format("ServeOptions::worker_threads must be positive, got {}", options_.worker_threads));
  for (const auto& [name, seconds] : {std::pair{"request_seconds", options_.request_seconds},
                                      {"response_seconds", options_.response_seconds},
                                      {"idle_seconds", options_.idle_seconds},
                                      {"connection_seconds", options_.connection_seconds}})
    if (!(seconds >= 0.001 && seconds <= 86400))
      throw std::invalid_argument(fmt::format("ServeOptions::{} must be in [0.001, 86400], got {}", name, seconds));
  model_->eval();
}

std::vector<std::string> LiveViewerApi::class_names() const {
  const auto K = static_cast<size_t>(model_->config.num_classes);
  if (options_.class_names.size() == K) return options_.class_names;
  std::vector<std::string> names;
  for (size_t k = 0; k < K; ++k) names.push_back(std::to_string(k));
  return names;
}

ApiResponse LiveViewerApi::info() const {
  const auto& c = model_->config;
  return json_response(200, json{{"image_size", c.image_size},
                                 {"num_classes", c.num_classes},
                                 {"digit_dim", c.digit_dim},
                                 {"model", options_.model_label},
                                 {"classes", class_names()},
                                 {"runs_dir", options_.runs_dir},
                                 {"max_body_bytes", options_.max_body_bytes}});
}

ApiResponse LiveViewerApi::predict(const std::string& body) {
  if (body.size() > options_.max_body_bytes) return error_response(413, "request body too large");
  std::string error;
  auto j = parse_object(body, error);
  if (!j) return error_response(400, error);
  const int64_t S = model_->config.image_size;
  std::vector<float> pixels;
  error = read_numbers(*j, "pixels", static_cast<size_t>(S * S), 0.0, 1.0, pixels);
  if (!error.empty()) return error_response(400, error);

  models::CapsNetOutput out;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    torch::NoGradGuard no_grad;
    auto images = torch::from_blob(pixels.data(), {1, 1, S, S}, torch::kFloat).clone();  // [1, 1, S, S]
    out = model_->forward(images);
  }
  auto lengths = out.lengths[0];                       // [K]
  const int64_t k = lengths.argmax().item<int64_t>();  // the capsule the decoder saw
  json caps = json::array();
  for (int64_t i = 0; i < out.digit_caps.size(1); ++i) caps.push_back(to_vector(out.digit_caps[0][i]));
  return json_response(200, json{{"lengths", to_vector(lengths)},
                                 {"class", k},
                                 {"class_name", class_names()[k]},
                                 {"pose", to_vector(out.digit_caps[0][k])},
                                 {"digit_caps", std::move(caps)},
                                 {"reconstruction", to_vector(out.reconstruction[0])}});
}

ApiResponse LiveViewerApi::decode(const std::string& body) {
  if (body.size() > options_.max_body_bytes) return error_response(413, "request body too large");
  std::string error;
  auto j = parse_object(body, error);
  if (!j) return error_response(400, error);
  const auto& c = model_->config;
  auto cls = j->find("class");
  if (cls == j->end()) return error_response(400, "missing field 'class'");
  if (!cls->is_number_integer() || cls->get<int64_t>() < 0 || cls->get<int64_t>() >= c.num_classes)
    return error_response(400, fmt::format("'class' must be an integer in [0, {}], got {}", c.num_classes - 1,
                                           cls->dump()));
  const int64_t k = cls->get<int64_t>();
  std::vector<float> pose;
  // Poses live in the unit ball; the bound only rejects nonsense, sliders stay far inside it.
  error = read_numbers(*j, "pose", static_cast<size_t>(c.digit_dim), -100.0, 100.0, pose);
  if (!error.empty()) return error_response(400, error);

  torch::Tensor recon;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    torch::NoGradGuard no_grad;
    auto v = torch::zeros({1, c.num_classes, c.digit_dim});                   // v: [1, K, D]
    v[0][k].copy_(torch::from_blob(pose.data(), {c.digit_dim}, torch::kFloat));  // only v_k survives the mask
    recon = model_->decode(v, torch::full({1}, k, torch::kLong));            // [1, S*S]
  }
  return json_response(200, json{{"class", k}, {"reconstruction", to_vector(recon[0])}});
}

ApiResponse LiveViewerApi::runs() const { return json_response(200, json{{"runs", list_runs(options_.runs_dir)}}); }

ApiResponse LiveViewerApi::metrics(const std::string& run) const {
  if (malformed_run_name(run))
    return error_response(400, "'run' must be a relative run name without '..', e.g. mnist or ablation/r3_recon");
  const auto names = list_runs(options_.runs_dir);
  if (!std::binary_search(names.begin(), names.end(), run))
    return error_response(404, fmt::format("no run named '{}' under the runs directory", run));
  const auto path = fs::path(options_.runs_dir) / run / "metrics.jsonl";
  std::ifstream in(path, std::ios::binary);
  if (!in) return error_response(404, fmt::format("cannot read metrics of run '{}'", run));
  in.seekg(0, std::ios::end);
  const auto size = static_cast<std::size_t>(std::max<std::streamoff>(0, in.tellg()));
  const bool truncated = size > options_.max_metrics_bytes;
  in.seekg(truncated ? static_cast<std::streamoff>(size - options_.max_metrics_bytes) : 0);
  std::string line;
  if (truncated) std::getline(in, line);  // a partial first line
  json records = json::array();
  while (std::getline(in, line)) {
    auto r = train::parse_json_or_discarded(line);
    if (!r.is_discarded() && r.is_object()) records.push_back(std::move(r));
  }
  return json_response(200, json{{"run", run}, {"records", std::move(records)}, {"truncated", truncated}});
}

// ---------------------------------------------------------------------------------------------------
// LiveViewer

struct LiveViewer::Server {
  explicit Server(ConnectionDeadlines deadlines) : http(deadlines) {}
  DeadlineServer http;
};

namespace {

ConnectionDeadlines deadlines_of(const ServeOptions& o) {
  auto ms = [](double seconds) { return std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000)); };
  return {ms(o.idle_seconds), ms(o.request_seconds), ms(o.response_seconds), ms(o.connection_seconds)};
}

}  // namespace

LiveViewer::LiveViewer(models::CapsNet model, ServeOptions options)
    : api_(std::move(model), std::move(options)), server_(std::make_unique<Server>(deadlines_of(api_.options()))) {
  auto& http = server_->http;
  const auto& opt = api_.options();
  const int threads = opt.worker_threads;
  http.new_task_queue = [threads] { return new httplib::ThreadPool(static_cast<size_t>(threads)); };
  http.set_payload_max_length(opt.max_body_bytes);
  http.set_keep_alive_max_count(100);  // read and write timeouts: the deadlines of DeadlineServer
  // httplib's default also sets SO_REUSEPORT, which lets a second server bind the same port and take
  // half the requests. SO_REUSEADDR alone restarts fast after a stop and refuses a busy port.
  http.set_socket_options([](socket_t sock) {
    int yes = 1;
    ::setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, reinterpret_cast<char*>(&yes), sizeof(yes));
  });
  http.set_default_headers({{"X-Content-Type-Options", "nosniff"},
                            {"Cache-Control", "no-store"},
                            {"Referrer-Policy", "no-referrer"},
                            {"X-Frame-Options", "DENY"}});

  const bool loopback = is_loopback(opt.host);
  http.set_pre_routing_handler([loopback](const httplib::Request& req, httplib::Response& res) {
    if (loopback && !is_loopback(host_of(req.get_header_value("Host")))) {
      auto r = error_response(403, "Host header must name a loopback address (server bound to loopback)");
      res.status = r.status;
      res.set_content(r.body, r.content_type.c_str());
      return httplib::Server::HandlerResponse::Handled;
    }
    return httplib::Server::HandlerResponse::Unhandled;
  });
  http.set_exception_handler([](const httplib::Request&, httplib::Response& res, std::exception_ptr ep) {
    std::string what = "internal error";
    try {
      std::rethrow_exception(ep);
    } catch (const std::exception& e) {
      what = e.what();
    } catch (...) {
    }
    auto r = error_response(500, what);
    res.status = r.status;
    res.set_content(r.body, r.content_type.c_str());
  });
  http.set_error_handler(httplib::Server::Handler([](const httplib::Request&, httplib::Response& res) {
    if (!res.body.empty()) return;  // a handler already explained the status
    auto r = error_response(res.status, res.status == 413   ? "request body too large"
                                        : res.status == 404 ? "not found"
                                                            : "request failed");
    res.set_content(r.body, r.content_type.c_str());
  }));

  auto send = [](httplib::Response& res, const ApiResponse& r) {
    res.status = r.status;
    res.set_content(r.body, r.content_type.c_str());
  };
  auto json_post = [this, send](ApiResponse (LiveViewerApi::*handler)(const std::string&)) {
    return [this, send, handler](const httplib::Request& req, httplib::Response& res) {
      const auto type = req.get_header_value("Content-Type");
      if (type.rfind("application/json", 0) != 0)
        return send(res, error_response(415, "POST bodies must be sent as Content-Type: application/json"));
      send(res, (api_.*handler)(req.body));
    };
  };

  http.Get("/", [](const httplib::Request&, httplib::Response& res) {
    res.set_header("Content-Security-Policy",
                   "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
                   "img-src data: blob:; connect-src 'self'; base-uri 'none'; form-action 'none'");
    res.set_content(live_viewer_page(), "text/html; charset=utf-8");
  });
  http.Get("/api/info", [this, send](const httplib::Request&, httplib::Response& res) { send(res, api_.info()); });
  http.Get("/api/runs", [this, send](const httplib::Request&, httplib::Response& res) { send(res, api_.runs()); });
  http.Get("/api/metrics", [this, send](const httplib::Request& req, httplib::Response& res) {
    if (!req.has_param("run")) return send(res, error_response(400, "missing query parameter 'run'"));
    send(res, api_.metrics(req.get_param_value("run")));
  });
  http.Post("/api/predict", json_post(&LiveViewerApi::predict));
  http.Post("/api/decode", json_post(&LiveViewerApi::decode));
}

LiveViewer::~LiveViewer() {
  if (server_) server_->http.stop();
}

int LiveViewer::bind() {
  if (port_ >= 0) return port_;
  const auto& opt = api_.options();
  if (opt.port < 0 || opt.port > 65535)
    throw std::invalid_argument(fmt::format("--port must be in [0, 65535], got {}", opt.port));
  if (opt.port == 0) {
    port_ = server_->http.bind_to_any_port(opt.host);
    if (port_ < 0) throw std::runtime_error(fmt::format("cannot bind {} (any port)", opt.host));
  } else {
    if (!server_->http.bind_to_port(opt.host, opt.port))
      throw std::runtime_error(fmt::format("cannot bind {}:{} (in use, or not an address of this machine)",
                                           opt.host, opt.port));
    port_ = opt.port;
  }
  return port_;
}

void LiveViewer::listen() {
  bind();
  server_->http.listen_after_bind();
}

void LiveViewer::stop() { server_->http.stop(); }

bool LiveViewer::running() const { return server_->http.is_running(); }

int64_t LiveViewer::timed_out_connections() const { return server_->http.timed_out_connections(); }
int64_t LiveViewer::oversized_connections() const { return server_->http.oversized_connections(); }

std::string LiveViewer::url() const {
  const auto& host = api_.options().host;
  const bool v6 = host.find(':') != std::string::npos;
  return fmt::format("http://{}{}{}:{}/", v6 ? "[" : "", host, v6 ? "]" : "", port_);
}

}  // namespace capsnet::apps
