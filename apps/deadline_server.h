#pragma once
// An httplib::Server whose connections have whole-request deadlines, not per-byte timeouts.
//
// httplib's own timeouts restart at every recv, so a client that sends one byte every 2 s holds a
// worker thread for as long as it likes (slowloris). This server runs each connection itself: the
// request line, headers and body must arrive within `request`, the response must be taken within
// `response`, an idle keep-alive connection is closed after `idle`, and no new request starts on a
// connection older than `connection`. A worker is therefore free again after at most
// idle + request + handler + response, whatever the client does. Everything else (routing,
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

  /// Connections closed because a deadline passed (request or response), since start.
  int64_t timed_out_connections() const { return timed_out_.load(); }

 private:
  // httplib calls this (virtually) on a worker thread for every accepted socket.
  bool process_and_close_socket(socket_t sock) override;

  ConnectionDeadlines deadlines_;
  std::atomic<int64_t> timed_out_{0};
};

}  // namespace capsnet::apps
