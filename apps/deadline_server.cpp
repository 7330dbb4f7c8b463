#include "apps/deadline_server.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <optional>
#include <string>

namespace capsnet::apps {
namespace {

using Clock = std::chrono::steady_clock;

/// Waits until `sock` has `events` or `deadline` passes, in slices so that a stopped server is noticed.
/// true: ready.
bool wait_for(int sock, short events, Clock::time_point deadline, const std::atomic<socket_t>* server = nullptr) {
  constexpr auto kSlice = std::chrono::milliseconds(100);
  for (;;) {
    const auto now = Clock::now();
    if (now >= deadline) return false;
    if (server && *server == INVALID_SOCKET) return false;  // the server is stopping
    const auto wait = std::min<Clock::duration>(deadline - now, kSlice);
    pollfd p{sock, events, 0};
    const int n = ::poll(&p, 1, static_cast<int>(std::chrono::ceil<std::chrono::milliseconds>(wait).count()));
    if (n > 0) return true;  // ready, or an error / hang-up that the next recv or send reports
    if (n < 0 && errno != EINTR) return false;
  }
}

void address_of(int sock, bool peer, std::string& ip, int& port) {
  sockaddr_storage addr{};
  socklen_t len = sizeof(addr);
  const int rc = peer ? ::getpeername(sock, reinterpret_cast<sockaddr*>(&addr), &len)
                      : ::getsockname(sock, reinterpret_cast<sockaddr*>(&addr), &len);
  if (rc != 0) return;
  std::array<char, NI_MAXHOST> host{};
  std::array<char, NI_MAXSERV> serv{};
  if (::getnameinfo(reinterpret_cast<sockaddr*>(&addr), len, host.data(), host.size(), serv.data(), serv.size(),
                    NI_NUMERICHOST | NI_NUMERICSERV) == 0) {
    ip = host.data();
    port = std::atoi(serv.data());
  }
}

/// A socket as httplib's Stream, with an absolute deadline for reading the current request and one for
/// writing its response (started by its first byte), and a bound on the bytes read for the current request.
/// Reads are buffered because httplib reads the request line and headers one byte at a time.
class DeadlineStream final : public httplib::Stream {
 public:
  DeadlineStream(int sock, const ConnectionDeadlines& d) : sock_(sock), d_(d) {}

  /// A new request starts now (its first byte is readable or already buffered); it may take at most
  /// max_bytes bytes (request line, headers and body, in any framing).
  void begin_request(size_t max_bytes) {
    read_deadline_ = Clock::now() + d_.request;
    write_deadline_.reset();
    budget_ = max_bytes;
  }
  bool timed_out() const { return timed_out_; }
  bool over_budget() const { return over_budget_; }
  bool has_buffered() const { return begin_ < end_; }

  bool is_readable() const override { return has_buffered() || wait_for(sock_, POLLIN, read_deadline_); }
  bool is_writable() const override {
    return wait_for(sock_, POLLOUT, write_deadline_.value_or(Clock::now() + d_.response));
  }

  ssize_t read(char* ptr, size_t size) override {
    // httplib reads a request line or header up to its newline, and a chunked body or a GET's body
    // without its payload limit: the limit is here, on every byte of the request.
    if (budget_ == 0) {
      over_budget_ = true;
      return -1;
    }
    size = std::min(size, budget_);
    if (!has_buffered()) {
      if (!wait_for(sock_, POLLIN, read_deadline_)) {
        timed_out_ = Clock::now() >= read_deadline_;
        return -1;
      }
      ssize_t n;
      do n = ::recv(sock_, buffer_.data(), buffer_.size(), 0);
      while (n < 0 && errno == EINTR);
      if (n <= 0) return n;
      begin_ = 0;
      end_ = static_cast<size_t>(n);
    }
    const size_t n = std::min(size, end_ - begin_);
    std::copy_n(buffer_.data() + begin_, n, ptr);
    begin_ += n;
    budget_ -= n;
    return static_cast<ssize_t>(n);
  }

  ssize_t write(const char* ptr, size_t size) override {
    if (!write_deadline_) write_deadline_ = Clock::now() + d_.response;
    if (!wait_for(sock_, POLLOUT, *write_deadline_)) {
      timed_out_ = Clock::now() >= *write_deadline_;
      return -1;
    }
    ssize_t n;
    do n = ::send(sock_, ptr, size, MSG_NOSIGNAL);
    while (n < 0 && errno == EINTR);
    return n;
  }

  void get_remote_ip_and_port(std::string& ip, int& port) const override { address_of(sock_, true, ip, port); }
  void get_local_ip_and_port(std::string& ip, int& port) const override { address_of(sock_, false, ip, port); }
  socket_t socket() const override { return sock_; }

 private:
  int sock_;
  ConnectionDeadlines d_;
  Clock::time_point read_deadline_ = Clock::now();
  std::optional<Clock::time_point> write_deadline_;
  bool timed_out_ = false, over_budget_ = false;
  size_t budget_ = 0;
  std::array<char, 4096> buffer_{};
  size_t begin_ = 0, end_ = 0;
};

}  // namespace

bool DeadlineServer::process_and_close_socket(socket_t sock) {
  const auto opened = Clock::now();
  DeadlineStream stream(sock, deadlines_);
  bool ok = false;
  for (size_t served = 0; served < keep_alive_max_count_; ++served) {
    // A pipelined request may already be buffered; otherwise wait (bounded) for its first byte.
    if (!stream.has_buffered() && !wait_for(sock, POLLIN, Clock::now() + deadlines_.idle, &svr_sock_)) break;
    stream.begin_request(payload_max_length_ + kMaxHeadBytes);
    const bool last = served + 1 == keep_alive_max_count_ || Clock::now() - opened >= deadlines_.connection;
    bool closed = false;
    ok = process_request(stream, last, closed, [](httplib::Request&) {});
    if (stream.timed_out()) {
      ++timed_out_;
      break;
    }
    if (stream.over_budget()) {
      ++over_budget_;
      break;
    }
    if (!ok || closed || last) break;
  }
  ::shutdown(sock, SHUT_RDWR);
  ::close(sock);
  return ok;
}

}  // namespace capsnet::apps
