#pragma once
// `capsnet serve`: a local live capsule viewer. One embedded page (draw or upload a digit, see the
// capsule lengths, move the winning capsule's pose like the paper's Fig. 4 and watch the decoder,
// follow a training run's metrics.jsonl) and the JSON endpoints behind it, on cpp-httplib.
//
// The handlers are plain functions of (request body / query) -> ApiResponse so that they can be
// tested without sockets; LiveViewer puts them behind an HTTP server (httplib stays inside serve.cpp).

#include <torch/torch.h>

#include <cstddef>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "capsnet/models/capsnet.h"

namespace capsnet::apps {

/// What the server binds to and how much it accepts.
struct ServeOptions {
  /// Address to bind; loopback by default. Anything else exposes the model to the network.
  std::string host = "127.0.0.1";
  /// TCP port; 0 picks a free one (see LiveViewer::bind).
  int port = 8080;
  /// Directory whose metrics.jsonl files (at any depth) the training panel may read; empty: none.
  std::string runs_dir = "runs";
  /// Largest accepted request body; bigger ones get 413 before any parsing.
  std::size_t max_body_bytes = 64 * 1024;
  /// Largest metrics.jsonl served; only its last max_metrics_bytes are read for bigger files.
  std::size_t max_metrics_bytes = 4 * 1024 * 1024;
  /// Worker threads answering requests (the model itself runs one request at a time).
  int worker_threads = 4;
  /// Whole-request deadlines, in seconds, so that slow clients cannot hold the workers
  /// (apps/deadline_server.h): request line + headers + body, taking the response, an idle
  /// keep-alive connection, and the age after which a connection takes no new request.
  double request_seconds = 10, response_seconds = 10, idle_seconds = 5, connection_seconds = 60;
  /// Shown on the page (e.g. the checkpoint path).
  std::string model_label;
  /// Name of each class (train::read_input_spec); empty: "0".."K-1".
  std::vector<std::string> class_names;
};

/// An HTTP answer: status, body and its content type.
struct ApiResponse {
  int status = 200;
  std::string body;
  std::string content_type = "application/json";
};

/// The page: HTML + CSS + JS in one string, no external resources. `?selftest=1` runs a scripted
/// session (stroke -> predict -> bars + reconstruction -> slider -> decode) and writes the outcome into
/// `<pre id="selftest">` as JSON with "status": "selftest: ok" (or the error).
const std::string& live_viewer_page();

/// The handlers of the viewer's API around one model (with a decoder). Thread-safe: the model runs
/// under a mutex, in eval mode, without autograd.
class LiveViewerApi {
 public:
  /// Throws std::invalid_argument if the model has no decoder or has more than one image channel.
  LiveViewerApi(models::CapsNet model, ServeOptions options);

  /// GET /api/info -> {image_size, num_classes, digit_dim, model, classes, runs_dir, max_body_bytes}.
  ApiResponse info() const;
  /// The names of the model's classes (ServeOptions::class_names, else "0".."K-1").
  std::vector<std::string> class_names() const;
  /// POST /api/predict {pixels: [S*S] in [0,1], row-major, white ink on black} ->
  /// {lengths: [K], class, class_name, pose: [D], digit_caps: [K][D], reconstruction: [S*S]}.
  /// pose = v_class (paper Eq. 1 output of the longest capsule); reconstruction = decoder(mask(v, class)).
  /// 400 with {"error": ...} for bad JSON, a wrong count, or values outside [0, 1].
  ApiResponse predict(const std::string& body);
  /// POST /api/decode {class, pose: [D]} -> {reconstruction: [S*S]}: the decoder on a capsule set that is
  /// zero except v_class = pose (what masking by `class` feeds it). 400 for bad JSON / class / length.
  ApiResponse decode(const std::string& body);
  /// GET /api/runs -> {runs: [NAME...]}: directories under runs_dir (relative, '/'-separated, sorted)
  /// that hold a metrics.jsonl.
  ApiResponse runs() const;
  /// GET /api/metrics?run=NAME -> {run, records: [...], truncated}: the run's metrics.jsonl, one parsed
  /// object per line (unparsable lines, e.g. one being written, are skipped). 400 for a malformed name
  /// (empty, absolute, "..", backslash, NUL); 404 for a name that is not one of runs().
  ApiResponse metrics(const std::string& run) const;

  const ServeOptions& options() const { return options_; }

 private:
  models::CapsNet model_;
  ServeOptions options_;
  mutable std::mutex mutex_;
};

/// The API behind an HTTP server. Routes: GET / (the page), GET /api/info, POST /api/predict,
/// POST /api/decode, GET /api/runs, GET /api/metrics?run=NAME; everything else 404. POST bodies must be
/// application/json (415 otherwise, which also stops cross-site form posts) and at most
/// max_body_bytes (413). When bound to a loopback address, requests whose Host header is not a
/// loopback name get 403 (DNS-rebinding guard).
class LiveViewer {
 public:
  LiveViewer(models::CapsNet model, ServeOptions options);
  ~LiveViewer();
  LiveViewer(const LiveViewer&) = delete;
  LiveViewer& operator=(const LiveViewer&) = delete;

  /// Binds host:port (port 0: a free port) and returns the port; throws std::runtime_error naming the
  /// address if it cannot.
  int bind();
  /// Serves until stop(); binds first if bind() was not called. Blocking.
  void listen();
  /// Makes listen() return; safe from any thread.
  void stop();
  /// True once listen() accepts connections.
  bool running() const;
  /// "http://HOST:PORT/" of the bound server.
  std::string url() const;
  /// Connections closed because a client missed a deadline (ServeOptions::request_seconds, ...).
  int64_t timed_out_connections() const;
  /// Connections closed because a request was longer than max_body_bytes plus 64 KiB (any framing).
  int64_t oversized_connections() const;

  LiveViewerApi& api() { return api_; }

 private:
  struct Server;
  LiveViewerApi api_;
  std::unique_ptr<Server> server_;
  int port_ = -1;
};

}  // namespace capsnet::apps
