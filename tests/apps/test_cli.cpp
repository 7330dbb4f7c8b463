// End to end: the capsnet binary on a small generated MNIST-format set, and on bad input.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "capsnet/data/idx.h"
#include "capsnet/data/mnist.h"
#include "capsnet/kernels/precision.h"
#include "capsnet/viz/png.h"
#include "test_helpers.h"

namespace capsnet {
namespace {

using testing::run_command;
using testing::TempDir;

const std::string kCli = CAPSNET_CLI;

/// A fake MNIST directory (64 train / 32 test synthetic 28x28 digits) and one trained checkpoint,
/// shared by the tests of this suite to keep them fast.
class CliTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new TempDir();
    data_ = *dir_ / "mnist";
    testing::write_fake_mnist(data_, 64, 32);
    run_ = *dir_ / "run";
    train_ = run_command(kCli + " train --data " + data_ + " --out " + run_ +
                         " --steps 3 --batch-size 16 --checkpoint-every 2 --no-progress");
  }
  static void TearDownTestSuite() { delete dir_; }

  static TempDir* dir_;
  static std::string data_, run_;
  static testing::CommandResult train_;
};
TempDir* CliTest::dir_ = nullptr;
std::string CliTest::data_, CliTest::run_;
testing::CommandResult CliTest::train_;

void expect_contains(const std::string& text, const std::string& phrase) {
  EXPECT_NE(text.find(phrase), std::string::npos) << "expected \"" << phrase << "\" in:\n" << text;
}

TEST_F(CliTest, TrainWritesCheckpointMetricsAndAccuracy) {
  ASSERT_EQ(train_.status, 0) << train_.output;
  expect_contains(train_.output, "8215568 parameters");
  expect_contains(train_.output, "test accuracy:");
  EXPECT_TRUE(std::filesystem::exists(run_ + "/checkpoint.pt"));
  std::ifstream metrics(run_ + "/metrics.jsonl");
  std::string line;
  std::vector<std::string> events;
  while (std::getline(metrics, line)) events.push_back(nlohmann::json::parse(line)["event"]);
  ASSERT_GE(events.size(), 4u);
  EXPECT_EQ(events.front(), "start");
  EXPECT_EQ(events.back(), "end");
  EXPECT_NE(std::find(events.begin(), events.end(), "eval"), events.end());
}

TEST_F(CliTest, TrainingDefaultsToBf16WhereTheCpuHasItElseFp32WithANotice) {
  // --precision auto is train's default: the start event records what it resolved to on this CPU.
  ASSERT_EQ(train_.status, 0) << train_.output;
  std::ifstream metrics(run_ + "/metrics.jsonl");
  std::string line;
  ASSERT_TRUE(std::getline(metrics, line));
  const auto start = nlohmann::json::parse(line);
  const bool native = cpu_has_native_bf16();
  EXPECT_EQ(start["train"]["precision"], native ? "bf16" : "fp32") << line;
  const bool noticed = train_.output.find("--precision auto: this CPU has no native bf16") != std::string::npos;
  EXPECT_EQ(noticed, !native) << train_.output;
  auto help = run_command(kCli + " train --help");
  expect_contains(help.output, "auto");
  EXPECT_NE(help.output.find("=auto"), std::string::npos) << help.output;
}

TEST_F(CliTest, EvalPrintsAccuracyAndConfusionAsJson) {
  auto r = run_command(kCli + " eval --checkpoint " + run_ + "/checkpoint.pt --data " + data_ + " --json");
  ASSERT_EQ(r.status, 0) << r.output;
  auto j = nlohmann::json::parse(r.output.substr(r.output.find('{')));
  EXPECT_EQ(j["examples"], 32);
  int64_t total = 0;
  for (const auto& row : j["confusion"])
    for (const auto& c : row) total += c.get<int64_t>();
  EXPECT_EQ(total, 32);
  EXPECT_GE(j["accuracy"].get<double>(), 0.0);

  auto text = run_command(kCli + " eval --checkpoint " + run_ + "/checkpoint.pt --data " + data_ + " --no-progress");
  ASSERT_EQ(text.status, 0) << text.output;
  expect_contains(text.output, "test accuracy:");
  expect_contains(text.output, "true\\pred");
}

TEST_F(CliTest, EvalScoresAnEnsembleAndEachMember) {
  const std::string models = std::string(CAPSNET_SOURCE_DIR) + "/models/";
  const std::string ours = run_ + "/checkpoint.pt", shipped = models + "capsnet-mnist/capsnet-mnist.pt";
  const auto accuracy_of = [&](const std::string& path) {
    auto r = run_command(kCli + " eval --checkpoint " + path + " --data " + data_ + " --json");
    EXPECT_EQ(r.status, 0) << r.output;
    return nlohmann::json::parse(r.output.substr(r.output.find('{')))["accuracy"].get<double>();
  };
  auto r = run_command(kCli + " eval --checkpoint " + ours + " --checkpoint " + shipped + " --data " + data_ + " --json");
  ASSERT_EQ(r.status, 0) << r.output;
  auto j = nlohmann::json::parse(r.output.substr(r.output.find('{')));
  EXPECT_EQ(j["model"], "capsnet-ensemble");
  EXPECT_EQ(j["examples"], 32);
  EXPECT_EQ(j["checkpoints"], (std::vector<std::string>{ours, shipped}));
  ASSERT_EQ(j["member_accuracy"].size(), 2u);
  EXPECT_DOUBLE_EQ(j["member_accuracy"][0].get<double>(), accuracy_of(ours));
  EXPECT_DOUBLE_EQ(j["member_accuracy"][1].get<double>(), accuracy_of(shipped));
  int64_t total = 0, right = 0;
  for (size_t i = 0; i < j["confusion"].size(); ++i)
    for (size_t k = 0; k < j["confusion"][i].size(); ++k) {
      total += j["confusion"][i][k].get<int64_t>();
      if (i == k) right += j["confusion"][i][k].get<int64_t>();
    }
  EXPECT_EQ(total, 32);
  EXPECT_DOUBLE_EQ(j["accuracy"].get<double>(), right / 32.0);
  // The same model twice is the model alone.
  auto twice = run_command(kCli + " eval --checkpoint " + ours + " --checkpoint " + ours + " --data " + data_ + " --json");
  ASSERT_EQ(twice.status, 0) << twice.output;
  EXPECT_DOUBLE_EQ(nlohmann::json::parse(twice.output.substr(twice.output.find('{')))["accuracy"].get<double>(),
                   accuracy_of(ours));
  auto text = run_command(kCli + " eval --checkpoint " + ours + " --checkpoint " + shipped + " --data " + data_ +
                          " --no-progress");
  ASSERT_EQ(text.status, 0) << text.output;
  expect_contains(text.output, "test accuracy of the ensemble of 2 models (capsule lengths averaged):");
  expect_contains(text.output, shipped);

  // Members that cannot be averaged with the first are refused in one line, naming the file.
  for (const auto& [other, phrase] : std::vector<std::pair<std::string, std::string>>{
           {models + "cnn-translated-mnist-40/cnn-translated-mnist-40.pt", "an ensemble takes CapsNet checkpoints"},
           {models + "capsnet-translated-mnist-40/capsnet-translated-mnist-40.pt", "must share input and classes"}}) {
    auto bad = run_command(kCli + " eval --checkpoint " + ours + " --checkpoint " + other + " --data " + data_);
    EXPECT_NE(bad.status, 0) << bad.output;
    expect_contains(bad.output, phrase);
    expect_contains(bad.output, other);
    EXPECT_EQ(bad.output.find("Exception raised from"), std::string::npos) << bad.output;
  }
}

TEST_F(CliTest, EvalValScoresTheLastTrainingImages) {
  const std::string ours = run_ + "/checkpoint.pt";
  auto r = run_command(kCli + " eval --checkpoint " + ours + " --data " + data_ + " --val 16 --json");
  ASSERT_EQ(r.status, 0) << r.output;
  auto j = nlohmann::json::parse(r.output.substr(r.output.find('{')));
  EXPECT_EQ(j["examples"], 16);
  EXPECT_EQ(j["split"], "validation");
  // The same images as an IDX file: the last 16 of the 64 training images.
  auto train = data::load_mnist(data_, data::Split::kTrain);
  ASSERT_EQ(train.size(), 64);
  const std::string images = dir_->str() + "/tail-images", labels = dir_->str() + "/tail-labels";
  data::write_idx(images, train.images.narrow(0, 48, 16).contiguous());
  data::write_idx(labels, train.labels.narrow(0, 48, 16).to(torch::kUInt8));
  auto idx = run_command(kCli + " eval --checkpoint " + ours + " --images " + images + " --labels " + labels + " --json");
  ASSERT_EQ(idx.status, 0) << idx.output;
  auto k = nlohmann::json::parse(idx.output.substr(idx.output.find('{')));
  EXPECT_EQ(k["confusion"], j["confusion"]);
  EXPECT_DOUBLE_EQ(k["loss"].get<double>(), j["loss"].get<double>());

  for (const auto& [args, phrase] : std::vector<std::pair<std::string, std::string>>{
           {" --val 64", "not less than the 64 training images"}, {" --val 8 --split train", "--split"}}) {
    auto bad = run_command(kCli + " eval --checkpoint " + ours + " --data " + data_ + args);
    EXPECT_NE(bad.status, 0) << args << "\n" << bad.output;
    expect_contains(bad.output, phrase);
  }
}

TEST_F(CliTest, PredictClassifiesIdxAndPng) {
  auto r = run_command(kCli + " predict --checkpoint " + run_ + "/checkpoint.pt --limit 3 --json " + data_ +
                       "/t10k-images-idx3-ubyte");
  ASSERT_EQ(r.status, 0) << r.output;
  std::istringstream lines(r.output);
  int n = 0;
  for (std::string line; std::getline(lines, line);) {
    if (line.empty() || line[0] != '{') continue;
    auto j = nlohmann::json::parse(line);
    EXPECT_GE(j["prediction"].get<int>(), 0);
    EXPECT_LE(j["prediction"].get<int>(), 9);
    EXPECT_EQ(j["lengths"].size(), 10u);
    ++n;
  }
  EXPECT_EQ(n, 3);

  // A 56x56 black-on-white PNG: inverted and resized automatically.
  const auto png = *dir_ / "digit.png";
  auto img = torch::full({56, 56}, 255, torch::kUInt8);
  img.narrow(0, 10, 36).narrow(1, 24, 8).fill_(0);
  viz::write_png_gray(png, img);
  auto p = run_command(kCli + " predict --checkpoint " + run_ + "/checkpoint.pt " + png);
  ASSERT_EQ(p.status, 0) << p.output;
  expect_contains(p.output, png + ": ");
}

TEST_F(CliTest, ReconstructWritesTheFigure) {
  const auto png = dir_->str() + "/recon.png";
  auto r = run_command(kCli + " reconstruct --checkpoint " + run_ + "/checkpoint.pt --data " + data_ +
                       " --correct 3 --wrong 2 --out " + png);
  ASSERT_EQ(r.status, 0) << r.output;
  expect_contains(r.output, "(l,p,r)=");
  auto figure = viz::read_png_gray(png);
  // Panels are 56 px wide (28 px zoomed 2x), 4 px apart, at most 9 per row.
  const int64_t panels = std::count(r.output.begin(), r.output.end(), '=');
  ASSERT_GE(panels, 1);
  const int64_t cols = std::min<int64_t>(panels, 9);
  EXPECT_EQ(figure.size(1), cols * (56 + 4) + 4);
  const int64_t rows = (panels + 8) / 9, panel_height = 14 + 56 + 2 + 56;  // caption, input, gap, reconstruction
  EXPECT_EQ(figure.size(0), rows * (panel_height + 4) + 4);
}

// --recon-weight weights the reconstruction term of the loss: the same first step (same seed,
// batch and weights) records exactly 20x the reconstruction loss at 0.01 as at the default 0.0005.
TEST_F(CliTest, ReconstructionScaleWeightsTheReconstructionLoss) {
  auto first_reconstruction_loss = [&](const std::string& name, const std::string& extra) {
    const std::string out = dir_->str() + "/" + name;
    auto r = run_command(kCli + " train --data " + data_ + " --out " + out +
                         " --steps 1 --batch-size 16 --log-every 1 --no-eval --no-progress --precision fp32" + extra);
    EXPECT_EQ(r.status, 0) << r.output;
    std::ifstream metrics(out + "/metrics.jsonl");
    for (std::string line; std::getline(metrics, line);) {
      const auto j = nlohmann::json::parse(line);
      if (j.value("event", "") == "train") return j["reconstruction_loss"].get<double>();
    }
    ADD_FAILURE() << "no train record in " << out;
    return 0.0;
  };
  const double paper = first_reconstruction_loss("scale-default", "");
  const double authors = first_reconstruction_loss("scale-0.01", " --recon-weight 0.01");
  ASSERT_GT(paper, 0.0);
  EXPECT_NEAR(authors / paper, 20.0, 1e-4);
  auto r = run_command(kCli + " train --data " + data_ + " --steps 1 --no-reconstruction --recon-weight 0.01");
  EXPECT_NE(r.status, 0);
  expect_contains(r.output, "--no-reconstruction excludes --recon-weight");
}

TEST_F(CliTest, ResumeContinuesFromTheCheckpointStep) {
  auto r = run_command(kCli + " train --data " + data_ + " --out " + dir_->str() + "/resumed --steps 4 --batch-size 16" +
                       " --no-progress --no-eval --resume " + run_ + "/checkpoint.pt");
  ASSERT_EQ(r.status, 0) << r.output;
  expect_contains(r.output, "resumed from");
  expect_contains(r.output, "trained steps 3..4");
}

TEST_F(CliTest, BadInputGivesAClearErrorAndNonZeroStatus) {
  struct Case {
    std::string args, phrase;
  };
  const std::string ckpt = run_ + "/checkpoint.pt";
  std::filesystem::create_directories(dir_->str() + "/truncated");
  for (const auto* name : {"train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte",
                           "t10k-labels-idx1-ubyte"})
    std::filesystem::copy_file(data_ + "/" + name, dir_->str() + "/truncated/" + name);
  std::filesystem::resize_file(dir_->str() + "/truncated/train-images-idx3-ubyte", 1000);
  std::ofstream(dir_->str() + "/bad.pt") << "not a checkpoint";

  const std::vector<Case> cases = {
      {"frobnicate", "frobnicate"},
      {"train --bogus-flag", "--bogus-flag"},
      {"train --batch-size 0 --data " + data_, "batch-size"},
      {"train --batch-size abc --data " + data_, "batch-size"},
      {"train --data " + dir_->str() + "/nowhere --steps 1", "fetch_mnist.sh"},
      {"train --data " + dir_->str() + "/truncated --steps 1", "truncated"},
      {"train --data " + data_ + " --resume " + dir_->str() + "/missing.pt", "missing.pt"},
      {"eval --checkpoint " + dir_->str() + "/bad.pt --data " + data_, "bad.pt"},
      {"eval --checkpoint " + ckpt + " --split validation --data " + data_, "validation"},
      {"predict --checkpoint " + ckpt + " " + dir_->str() + "/bad.pt", "bad.pt"},
      {"predict --checkpoint " + ckpt, "inputs"},
  };
  for (const auto& c : cases) {
    auto r = run_command(kCli + " " + c.args);
    EXPECT_NE(r.status, 0) << c.args << "\n" << r.output;
    expect_contains(r.output, c.phrase);
    EXPECT_EQ(r.output.find("Exception raised from"), std::string::npos) << r.output;
  }
}

TEST_F(CliTest, HelpListsEveryCommand) {
  auto r = run_command(kCli + " help");
  ASSERT_EQ(r.status, 0) << r.output;
  for (const auto* cmd : {"train", "eval", "predict", "help"}) expect_contains(r.output, cmd);
  auto t = run_command(kCli + " help train");
  ASSERT_EQ(t.status, 0) << t.output;
  expect_contains(t.output, "--routing-iters");
  expect_contains(t.output, "--resume");
}

}  // namespace
}  // namespace capsnet
