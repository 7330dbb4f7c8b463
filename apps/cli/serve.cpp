#include <fmt/format.h>
#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>

#include <iostream>
#include <memory>
#include <stdexcept>
#include <thread>

#include "capsnet/train/checkpoint.h"
#include "apps/runtime.h"
#include "apps/serve.h"
#include "apps/cli/commands.h"

namespace capsnet::apps::cli {
namespace {

// SIGINT/SIGTERM write one byte to this pipe; a waiter thread reads it and stops the server from
// outside the handler. A handler (not a blocked mask and sigwait) because OpenBLAS starts its threads
// when the library loads, before main: a process-directed signal may be delivered to any of them.
int g_stop_pipe[2] = {-1, -1};

extern "C" void on_stop_signal(int) {
  const int saved = errno;
  const char byte = 1;
  [[maybe_unused]] auto n = ::write(g_stop_pipe[1], &byte, 1);
  errno = saved;
}

// Installs the handler for SIGINT and SIGTERM (a shell starts background jobs with SIGINT ignored;
// installing a handler overrides that).
void install_stop_handler() {
  if (::pipe2(g_stop_pipe, O_CLOEXEC) != 0) throw std::runtime_error("serve: cannot create the stop pipe");
  struct sigaction action {};
  action.sa_handler = on_stop_signal;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESTART;
  for (int sig : {SIGINT, SIGTERM}) ::sigaction(sig, &action, nullptr);
}

// Blocks until a stop signal arrives or wake_stop_waiter() is called.
void wait_for_stop() {
  char byte = 0;
  while (::read(g_stop_pipe[0], &byte, 1) < 0 && errno == EINTR) {
  }
}

void wake_stop_waiter() { on_stop_signal(0); }

}  // namespace

Subcommand add_serve(CLI::App& root) {
  struct Flags {
    std::string checkpoint;
    apps::ServeOptions serve;
    int threads = 1;
    std::string precision = "fp32";
  };
  auto f = std::make_shared<Flags>();
  auto* app = root.add_subcommand(
      "serve", "Local web viewer: draw a digit, see capsule lengths, tweak the pose, follow training");
  app->add_option("--checkpoint", f->checkpoint, "Trained checkpoint (with a decoder) (default: the shipped MNIST model, " + std::string(kShippedModel) + ")");
  app->add_option("--host", f->serve.host,
                  "Address to bind (127.0.0.1: this machine only; 0.0.0.0 exposes the model to the network)")
      ->capture_default_str();
  app->add_option("--port", f->serve.port, "TCP port (0: any free port)")
      ->check(CLI::Range(0, 65535))
      ->capture_default_str();
  app->add_option("--runs", f->serve.runs_dir, "Directory whose metrics.jsonl files the training panel shows")
      ->capture_default_str();
  app->add_option("--max-body", f->serve.max_body_bytes, "Largest accepted request body, bytes (larger: 413)")
      ->check(CLI::Range(1024, 16 * 1024 * 1024))
      ->capture_default_str();
  app->add_option("--request-timeout", f->serve.request_seconds,
                  "Seconds a client has to send a whole request (headers + body) and, separately, to take the "
                  "response; slower connections are closed")
      ->check(CLI::Range(0.001, 86400.0))
      ->capture_default_str();
  app->add_option("--threads", f->threads, "Intra-op threads for the model (0 = all cores)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  add_precision_flag(*app, f->precision);

  return {app, [f]() {
            // An empty address binds every interface with the Host-header check off: refuse it by name.
            if (f->serve.host.empty())
              throw std::invalid_argument("an empty --host is refused: give 127.0.0.1, or 0.0.0.0 for every interface");
            f->checkpoint = checkpoint_or_shipped(f->checkpoint);
            set_threads(f->threads);
            auto model = train::load_model(f->checkpoint);
            model->set_precision(precision_from_flag(f->precision));
            if (!model->config.reconstruction)
              throw std::invalid_argument(f->checkpoint +
                                          ": this checkpoint has no decoder; train without --no-reconstruction");
            f->serve.model_label = f->checkpoint;
            f->serve.class_names = train::read_input_spec(f->checkpoint).class_names;

            f->serve.response_seconds = f->serve.request_seconds;

            apps::LiveViewer viewer(model, f->serve);
            viewer.bind();
            if (f->serve.host != "127.0.0.1" && f->serve.host != "localhost" && f->serve.host != "::1")
              std::cerr << fmt::format(
                  "serve: warning: bound to {}, not loopback: anyone who can reach this port can use the "
                  "model and read the metrics under {}\n",
                  f->serve.host, f->serve.runs_dir);
            install_stop_handler();
            std::cout << fmt::format("capsnet serve: {} (model {}, runs {}); Ctrl-C stops\n", viewer.url(),
                                     f->checkpoint, f->serve.runs_dir)
                      << std::flush;

            std::atomic<bool> listen_returned{false};
            std::thread waiter([&viewer, &listen_returned] {
              wait_for_stop();
              // stop() does nothing until listen() has started: a signal right after the ready line
              // would be lost, so repeat it until listen() returns.
              while (!listen_returned) {
                viewer.stop();
                std::this_thread::sleep_for(std::chrono::milliseconds(20));
              }
            });
            viewer.listen();
            listen_returned = true;
            // listen() also returns on a socket error: wake the waiter so that it can be joined.
            wake_stop_waiter();
            waiter.join();
            std::cout << "capsnet serve: stopped\n";
            return 0;
          }};
}

}  // namespace capsnet::apps::cli
