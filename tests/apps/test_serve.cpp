// `capsnet serve`: the JSON handlers behind a real HTTP server on 127.0.0.1 (free port, own thread),
// driven with httplib::Client; answers compared with the model run directly.
#include <gtest/gtest.h>
#include <httplib.h>
#include <torch/torch.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <thread>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include "capsnet/train/checkpoint.h"
#include "apps/serve.h"
#include "test_helpers.h"

namespace capsnet {
namespace {

using nlohmann::json;
using testing::TempDir;

std::vector<float> floats(const json& j) { return j.get<std::vector<float>>(); }

void expect_close(const std::vector<float>& got, const torch::Tensor& want, double tol, const char* what) {
  auto w = want.detach().to(torch::kFloat).contiguous().view(-1);
  ASSERT_EQ(static_cast<int64_t>(got.size()), w.numel()) << what;
  for (int64_t i = 0; i < w.numel(); ++i) ASSERT_NEAR(got[i], w[i].item<float>(), tol) << what << "[" << i << "]";
}

class ServeHttp : public ::testing::Test {
 protected:
  void SetUp() override {
    torch::manual_seed(3);
    model = models::CapsNet(testing::tiny_config());  // 12x12 input, 10 capsules of 4D
    model->eval();
    runs = dir / "runs";
    std::filesystem::create_directories(runs + "/mnist");
    std::filesystem::create_directories(runs + "/ablation/r1");
    std::filesystem::create_directories(dir / "outside");
    {
      std::ofstream m(runs + "/mnist/metrics.jsonl");
      m << R"({"event":"start","step":0})" << '\n'
        << R"({"event":"train","step":50,"loss":0.5,"accuracy":0.4})" << '\n'
        << R"({"event":"train","step":100,"loss":0.2,"accuracy":0.9})" << '\n'
        << R"({"event":"train","st)";  // a line still being written
    }
    std::ofstream(runs + "/ablation/r1/metrics.jsonl") << R"({"event":"train","step":1,"loss":1})" << '\n';
    std::ofstream(dir / "outside/metrics.jsonl") << R"({"secret":true})" << '\n';
    std::filesystem::create_directory_symlink(dir / "outside", runs + "/linked");

    apps::ServeOptions options;
    options.port = 0;
    options.runs_dir = runs;
    options.worker_threads = 2;
    for (int64_t k = 0; k < model->config.num_classes; ++k) options.class_names.push_back("class " + std::to_string(k));
    viewer = std::make_unique<apps::LiveViewer>(model, options);
    port = viewer->bind();
    thread = std::thread([this] { viewer->listen(); });
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (!viewer->running() && std::chrono::steady_clock::now() < deadline)
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    ASSERT_TRUE(viewer->running());
    client = std::make_unique<httplib::Client>("127.0.0.1", port);
    client->set_read_timeout(10, 0);
  }
  void TearDown() override {
    if (viewer) viewer->stop();
    if (thread.joinable()) thread.join();
  }
  httplib::Result post(const std::string& path, const std::string& body) {
    return client->Post(path.c_str(), body, "application/json");
  }
  static json body_of(const httplib::Result& r) { return json::parse(r->body); }

  TempDir dir;
  std::string runs;
  models::CapsNet model{nullptr};
  std::unique_ptr<apps::LiveViewer> viewer;
  std::unique_ptr<httplib::Client> client;
  std::thread thread;
  int port = 0;
};

TEST_F(ServeHttp, PredictEqualsForwardAndDecodeOfPoseEqualsReconstruction) {
  const int64_t S = model->config.image_size, K = model->config.num_classes, D = model->config.digit_dim;
  auto image = torch::rand({1, 1, S, S});  // [1, 1, S, S]
  std::vector<float> pixels(image.data_ptr<float>(), image.data_ptr<float>() + S * S);
  auto r = post("/api/predict", json{{"pixels", pixels}}.dump());
  ASSERT_TRUE(r) << httplib::to_string(r.error());
  ASSERT_EQ(r->status, 200) << r->body;
  auto j = body_of(r);

  torch::NoGradGuard no_grad;
  auto want = model->forward(image);  // v: [1, K, D]
  const int64_t k = want.lengths[0].argmax().item<int64_t>();
  EXPECT_EQ(j["class"].get<int64_t>(), k);
  EXPECT_EQ(j["class_name"], "class " + std::to_string(k));  // the checkpoint's class names
  expect_close(floats(j["lengths"]), want.lengths[0], 1e-6, "lengths");
  expect_close(floats(j["pose"]), want.digit_caps[0][k], 1e-6, "pose");
  expect_close(floats(j["reconstruction"]), want.reconstruction[0], 1e-6, "reconstruction");
  ASSERT_EQ(j["digit_caps"].size(), static_cast<size_t>(K));
  expect_close(floats(j["digit_caps"][K - 1]), want.digit_caps[0][K - 1], 1e-6, "digit_caps");

  // Decoding the predicted pose of the predicted class reproduces the predicted reconstruction.
  auto d = post("/api/decode", json{{"class", k}, {"pose", j["pose"]}}.dump());
  ASSERT_TRUE(d);
  ASSERT_EQ(d->status, 200) << d->body;
  expect_close(floats(body_of(d)["reconstruction"]), want.reconstruction[0], 1e-6, "decode(pose)");

  // A moved pose against the decoder fed by hand: zeros except block k of the [K*D] input.
  auto pose = floats(j["pose"]);
  pose[1] += 0.25f;
  auto moved = post("/api/decode", json{{"class", k}, {"pose", pose}}.dump());
  ASSERT_EQ(moved->status, 200) << moved->body;
  auto input = torch::zeros({1, K * D});  // [1, K*D]
  for (int64_t i = 0; i < D; ++i) input[0][k * D + i] = pose[i];
  auto ref = model->decoder(input)[0];  // [S*S]
  auto got = floats(body_of(moved)["reconstruction"]);
  expect_close(got, ref, 1e-6, "decode(pose + delta)");
  EXPECT_GT((torch::tensor(got) - want.reconstruction[0]).abs().max().item<float>(), 1e-5)
      << "moving a pose dimension should change the reconstruction";
}

TEST_F(ServeHttp, OversizedBodyIs413) {
  const std::string big = "{\"pixels\":[" + std::string(70 * 1024, ' ') + "]}";
  auto r = post("/api/predict", big);
  ASSERT_TRUE(r) << httplib::to_string(r.error());
  EXPECT_EQ(r->status, 413);
  // The handler enforces the limit too (for callers that bypass the server).
  EXPECT_EQ(viewer->api().predict(big).status, 413);
  EXPECT_EQ(viewer->api().decode(big).status, 413);
}

TEST_F(ServeHttp, BadJsonAndBadShapesAre400WithAMessage) {
  const int64_t S = model->config.image_size, D = model->config.digit_dim;
  auto expect_400 = [&](const std::string& path, const std::string& body, const std::string& needle) {
    auto r = post(path, body);
    ASSERT_TRUE(r);
    EXPECT_EQ(r->status, 400) << path << " " << body;
    auto err = body_of(r).value("error", std::string());
    EXPECT_NE(err.find(needle), std::string::npos) << "error '" << err << "' should mention '" << needle << "'";
  };
  expect_400("/api/predict", "{pixels: [1, 2", "JSON");
  expect_400("/api/predict", "[1, 2, 3]", "object");
  expect_400("/api/predict", "{}", "pixels");
  expect_400("/api/predict", json{{"pixels", std::vector<float>(S * S - 1, 0.f)}}.dump(), "pixels");
  auto out_of_range = std::vector<float>(S * S, 0.f);
  out_of_range[7] = 2.f;
  expect_400("/api/predict", json{{"pixels", out_of_range}}.dump(), "'pixels'[7]");
  auto not_numbers = json{{"pixels", json::array()}};
  for (int64_t i = 0; i < S * S; ++i) not_numbers["pixels"].push_back("x");
  expect_400("/api/predict", not_numbers.dump(), "not a number");
  expect_400("/api/decode", json{{"class", 10}, {"pose", std::vector<float>(D, 0.f)}}.dump(), "'class'");
  expect_400("/api/decode", json{{"class", 1.5}, {"pose", std::vector<float>(D, 0.f)}}.dump(), "'class'");
  expect_400("/api/decode", json{{"class", 3}, {"pose", std::vector<float>(D + 1, 0.f)}}.dump(), "pose");
  expect_400("/api/decode", json{{"pose", std::vector<float>(D, 0.f)}}.dump(), "class");
  // A value nested 5,000 deep (within this server's --max-body) is refused before it is parsed: comparing,
  // copying and destroying such a value recurse once per level and crashed the server.
  const std::string deep = std::string(5000, '[') + std::string(5000, ']');
  expect_400("/api/decode", "{\"class\": " + deep + ", \"pose\": []}", "at most 64 levels");
  expect_400("/api/predict", "{\"pixels\": " + deep + "}", "at most 64 levels");
  EXPECT_EQ(client->Get("/api/runs")->status, 200) << "the server is still up";

  auto text = client->Post("/api/predict", "{}", "text/plain");
  ASSERT_TRUE(text);
  EXPECT_EQ(text->status, 415);
}

TEST_F(ServeHttp, RunsListAndMetricsWithoutTraversal) {
  auto r = client->Get("/api/runs");
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200);
  EXPECT_EQ(body_of(r)["runs"], json({"ablation/r1", "mnist"}));  // the symlinked run is not listed

  auto m = client->Get("/api/metrics?run=mnist");
  ASSERT_EQ(m->status, 200) << m->body;
  auto records = body_of(m)["records"];
  ASSERT_EQ(records.size(), 3u);  // the half-written line is skipped
  EXPECT_EQ(records[2]["step"], 100);
  EXPECT_EQ(client->Get("/api/metrics?run=ablation%2Fr1")->status, 200);

  EXPECT_EQ(client->Get("/api/metrics?run=nope")->status, 404);
  EXPECT_EQ(client->Get("/api/metrics?run=linked")->status, 404);
  for (const char* bad : {"..", "../outside", "mnist%2F..%2F..%2Foutside", "%2Fetc", "mnist%5C..", ""}) {
    auto b = client->Get((std::string("/api/metrics?run=") + bad).c_str());
    ASSERT_TRUE(b);
    EXPECT_EQ(b->status, 400) << bad;
    EXPECT_EQ(b->body.find("secret"), std::string::npos);
  }
  EXPECT_EQ(client->Get("/api/metrics")->status, 400);
  EXPECT_EQ(client->Get("/runs/mnist/metrics.jsonl")->status, 404);
  EXPECT_EQ(client->Get("/../outside/metrics.jsonl")->status, 404);
}

TEST_F(ServeHttp, PageIsSelfContainedAndHostHeaderIsChecked) {
  auto r = client->Get("/");
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200);
  EXPECT_EQ(r->get_header_value("Content-Type"), "text/html; charset=utf-8");
  EXPECT_NE(r->body.find("id=\"selftest\""), std::string::npos);
  EXPECT_NE(r->body.find("/api/predict"), std::string::npos);
  for (const char* external : {"http://", "https://", "<script src", "<link "})
    EXPECT_EQ(r->body.find(external), std::string::npos) << external;
  EXPECT_NE(r->get_header_value("Content-Security-Policy").find("default-src 'none'"), std::string::npos);

  auto info = body_of(client->Get("/api/info"));
  EXPECT_EQ(info["image_size"], model->config.image_size);
  EXPECT_EQ(info["digit_dim"], model->config.digit_dim);

  // DNS rebinding: a page from another origin resolving its name to 127.0.0.1 sends its own Host.
  auto rebound = client->Get("/api/info", httplib::Headers{{"Host", "evil.example:8080"}});
  ASSERT_TRUE(rebound);
  EXPECT_EQ(rebound->status, 403);
  EXPECT_EQ(client->Get("/api/info", httplib::Headers{{"Host", "localhost"}})->status, 200);
}

TEST(ServeApi, RejectsModelsWithoutDecoderAndBadOptions) {
  auto config = testing::tiny_config();
  config.reconstruction = false;
  EXPECT_THROW(apps::LiveViewerApi(models::CapsNet(config), {}), std::invalid_argument);
  apps::ServeOptions small;
  small.max_body_bytes = 10;
  try {
    apps::LiveViewerApi(models::CapsNet(testing::tiny_config()), small);
    FAIL() << "expected std::invalid_argument";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("max_body_bytes"), std::string::npos) << e.what();
  }
}

TEST(ServeCli, MissingCheckpointAndBadPortFailWithAMessage) {
  TempDir dir;
  auto missing = testing::run_command(std::string(CAPSNET_CLI) + " serve --port 0 --checkpoint " + (dir / "none.pt"));
  EXPECT_NE(missing.status, 0);
  EXPECT_NE(missing.output.find("none.pt"), std::string::npos) << missing.output;
  auto port = testing::run_command(std::string(CAPSNET_CLI) + " serve --port 70000");
  EXPECT_NE(port.status, 0);
  EXPECT_NE(port.output.find("--port"), std::string::npos) << port.output;
}

}  // namespace
}  // namespace capsnet

namespace capsnet {
namespace {

TEST_F(ServeHttp, ASecondServerOnTheSamePortIsRefused) {
  apps::ServeOptions options;
  options.port = port;  // the port the fixture's server listens on
  options.runs_dir = runs;
  apps::LiveViewer second(model, options);
  try {
    second.bind();
    FAIL() << "a second server bound port " << port;
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("in use"), std::string::npos) << e.what();
  }
}

TEST_F(ServeHttp, ARunFolderWithANonUtf8NameDoesNotBreakTheRunList) {
  const std::string latin1 = runs + "/caf\xe9";  // "café" in Latin-1: not valid UTF-8
  std::filesystem::create_directories(latin1);
  std::ofstream(latin1 + "/metrics.jsonl") << R"({"event":"train","step":1,"loss":1})" << '\n';
  auto r = client->Get("/api/runs");
  ASSERT_TRUE(r) << httplib::to_string(r.error());
  EXPECT_EQ(r->status, 200) << r->body;
  auto names = body_of(r)["runs"];
  EXPECT_GE(names.size(), 3u) << r->body;  // mnist, ablation/r1 and the odd one, replaced characters and all
}

/// A raw TCP connection to 127.0.0.1:port (closed on destruction).
struct RawConnection {
  explicit RawConnection(int port) {
    fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(static_cast<uint16_t>(port));
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    connected = ::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
  }
  ~RawConnection() { ::close(fd); }
  bool send_text(const std::string& s) { return ::send(fd, s.data(), s.size(), MSG_NOSIGNAL) == ssize_t(s.size()); }
  int fd = -1;
  bool connected = false;
};

/// Sends `head`, then one more byte every `gap` until the server closes the connection (a send fails or
/// the server answers and hangs up) or `give_up` passes. Returns seconds from the first byte to the close
/// (or give_up's length if it never closed) and the bytes the server sent.
std::pair<double, std::string> trickle(int port, const std::string& head, std::chrono::milliseconds gap,
                                       std::chrono::seconds give_up) {
  RawConnection c(port);
  EXPECT_TRUE(c.connected);
  const auto start = std::chrono::steady_clock::now();
  std::string answer;
  c.send_text(head);
  while (std::chrono::steady_clock::now() - start < give_up) {
    std::this_thread::sleep_for(gap);
    char buf[4096];
    ssize_t n;
    while ((n = ::recv(c.fd, buf, sizeof(buf), MSG_DONTWAIT)) > 0) answer.append(buf, static_cast<size_t>(n));
    if (n == 0 || !c.send_text("X")) break;  // closed by the server
  }
  return {std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), answer};
}

// A server for one test: any free port, no runs directory, two workers.
apps::ServeOptions bare_server_options() {
  apps::ServeOptions options;
  options.port = 0;
  options.runs_dir = "";
  options.worker_threads = 2;
  return options;
}

TEST(ServeDeadlines, SlowClientsAreCutOffAtTheRequestDeadlineAndDoNotStarveOthers) {
  torch::manual_seed(3);
  models::CapsNet model(testing::tiny_config());
  auto options = bare_server_options();
  options.request_seconds = 1;  // header + body, whole request
  apps::LiveViewer viewer(model, options);
  const int port = viewer.bind();
  std::thread server([&] { viewer.listen(); });
  while (!viewer.running()) std::this_thread::sleep_for(std::chrono::milliseconds(5));

  // Two slowloris clients take both workers: headers one byte every 200 ms (each byte well inside
  // any per-recv timeout), and a body dribbled after a complete header.
  const std::string slow_headers = "GET /api/info HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ";
  const std::string slow_body =
      "POST /api/predict HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
      "Content-Length: 1000\r\n\r\n[";
  std::pair<double, std::string> headers_result, body_result;
  std::thread a([&] { headers_result = trickle(port, slow_headers, std::chrono::milliseconds(200), std::chrono::seconds(8)); });
  std::thread b([&] { body_result = trickle(port, slow_body, std::chrono::milliseconds(200), std::chrono::seconds(8)); });
  std::this_thread::sleep_for(std::chrono::milliseconds(300));  // both are being served now

  // A well-behaved client still gets its answer, within a deadline's length.
  const auto t0 = std::chrono::steady_clock::now();
  httplib::Client client("127.0.0.1", port);
  client.set_read_timeout(10, 0);
  auto r = client.Get("/api/info");
  const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  a.join();
  b.join();
  ASSERT_TRUE(r) << httplib::to_string(r.error());
  EXPECT_EQ(r->status, 200);
  EXPECT_LT(waited, 3.0);

  // Each slow client was closed about one deadline after its first byte, not after 8 s of trickling.
  for (const auto* res : {&headers_result, &body_result}) {
    EXPECT_GE(res->first, 0.9);
    EXPECT_LT(res->first, 3.0);
    EXPECT_EQ(res->second.find("200 OK"), std::string::npos) << res->second;
  }
  EXPECT_EQ(viewer.timed_out_connections(), 2);
  viewer.stop();
  server.join();
}

/// Resident memory of this process, in MB (/proc/self/status).
double resident_mb() {
  std::ifstream status("/proc/self/status");
  for (std::string line; std::getline(status, line);)
    if (line.rfind("VmRSS:", 0) == 0) return std::stod(line.substr(6)) / 1024;
  return 0;
}

/// Sends `head`, then `filler` repeatedly as fast as the server takes it, until a send fails (the server
/// closed the connection) or `limit` bytes are sent. Returns the bytes sent after `head`.
size_t flood(int port, const std::string& head, const std::string& filler, size_t limit) {
  RawConnection c(port);
  EXPECT_TRUE(c.connected);
  timeval timeout{5, 0};  // a server that stops reading without closing: a send blocks, then fails
  ::setsockopt(c.fd, SOL_SOCKET, SO_SNDTIMEO, &timeout, sizeof timeout);
  if (!c.send_text(head)) return 0;
  size_t sent = 0;
  while (sent < limit && c.send_text(filler)) sent += filler.size();
  return sent;
}

TEST(ServeLimits, EveryPartOfARequestIsBoundedWhateverItsFraming) {
  torch::manual_seed(3);
  models::CapsNet model(testing::tiny_config());
  const auto options = bare_server_options();
  apps::LiveViewer viewer(model, options);  // --max-body 64 KiB: a request may read 128 KiB in all
  const int port = viewer.bind();
  std::thread server([&] { viewer.listen(); });
  while (!viewer.running()) std::this_thread::sleep_for(std::chrono::milliseconds(5));

  const double rss_before = resident_mb();
  const std::string kib(1024, 'a');
  constexpr size_t kFlood = 256u << 20;  // 256 MiB offered by each abusive client
  const std::string chunk = "400\r\n" + kib + "\r\n";
  const struct {
    const char* what;
    std::string head, filler;
  } abuses[] = {
      {"a request line without a newline", "GET /", kib},
      {"endless headers", "GET /api/info HTTP/1.1\r\nHost: 127.0.0.1\r\n", "X-Pad: " + kib + "\r\n"},
      {"a chunked POST", "POST /api/predict HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n\r\n",
       chunk},
      {"a GET with a body", "GET /api/info HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 268435456\r\n\r\n", kib},
  };
  for (const auto& abuse : abuses) {
    const auto sent = flood(port, abuse.head, abuse.filler, kFlood);
    // Closed once past its bound: what it got through is the bound plus the sockets' buffers.
    EXPECT_LT(sent, 32u << 20) << abuse.what;
  }
  EXPECT_GE(viewer.oversized_connections(), 3);  // the GET's body may be left unread instead
  // The server still answers, and the bursts left no memory behind.
  httplib::Client client("127.0.0.1", port);
  auto r = client.Get("/api/info");
  ASSERT_TRUE(r) << httplib::to_string(r.error());
  EXPECT_EQ(r->status, 200);
  EXPECT_LT(resident_mb() - rss_before, 50.0);
  viewer.stop();
  server.join();
}

TEST(ServeDeadlines, BadDeadlinesAreRefusedByName) {
  models::CapsNet model(testing::tiny_config());
  apps::ServeOptions options;
  options.request_seconds = 0;
  try {
    apps::LiveViewerApi api(model, options);
    FAIL() << "request_seconds = 0 accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("request_seconds"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace capsnet
