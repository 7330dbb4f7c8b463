#pragma once
// An httplib::Server whose connections have whole-request deadlines, not per-byte timeouts.
//
// httplib's own timeouts restart at every recv, so a client that sends one byte every 2 s holds a
// worker thread for as long as it likes (slowloris). This server runs each connection itself: the
// request line, headers and body must arrive within `request`, the response must be taken within
// `response`, an idle keep-alive connection is closed after `idle`, and no new request starts on a
// connection older than `connection`. A worker is therefore free again after at most
// idle + request + handler + response, whatever the client does. A request may also read at most
// the payload limit (set_payload_max_length) plus kMaxHeadBytes, whatever its framing (a request line
// without a newline, endless headers, a chunked body or a GET's body): past that the connection is
// closed, so an abusive request holds at most that much memory. Everything else (routing,
// handlers, limits) is httplib's: requests go through its protected process_request.

#include <httplib.h>

#include <atomic>
#include <chrono>
#include <cstdint>

namespace capsnet::apps {

struct ConnectionDeadlines {
  std::chrono::milliseconds idle{5000};          // waiting for the first byte of a request
  std::chrono::milliseconds request{10000};      // first byte .. end of body
  std::chrono::milliseconds response{10000};     // first byte of the response .. its last
  std::chrono::milliseconds connection{60000};   // no new request on a connection older than this
};

class DeadlineServer : public httplib::Server {
 public:
  explicit DeadlineServer(ConnectionDeadlines deadlines = {}) : deadlines_(deadlines) {}

  /// Bytes a request may take beyond its payload limit: the request line and headers, and the framing
  /// of a chunked body.
  static constexpr size_t kMaxHeadBytes = 64 * 1024;

  /// Connections closed because a deadline passed (request or response), since start.
  int64_t timed_out_connections() const { return timed_out_.load(); }
  /// Connections closed because a request was longer than its payload limit plus kMaxHeadBytes.
  int64_t oversized_connections() const { return over_budget_.load(); }

 private:
  // httplib calls this (virtually) on a worker thread for every accepted socket.
  bool process_and_close_socket(socket_t sock) override;

  ConnectionDeadlines deadlines_;
  std::atomic<int64_t> timed_out_{0}, over_budget_{0};
};

}  // namespace capsnet::apps
