// --dataset: the dataset names, their default directories, Fashion-MNIST as shipped by Debian, and
// the CLI flags (--data overrides --dataset; unknown names and missing files are clear errors).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <string>

#include "capsnet/data/mnist.h"
#include "test_helpers.h"

namespace {

namespace fs = std::filesystem;
using capsnet::data::Split;
using capsnet::testing::run_command;
using capsnet::testing::TempDir;

constexpr const char* kFashionDir = "/usr/share/datasets/fashion-mnist";

TEST(Datasets, DefaultDirectories) {
  EXPECT_EQ(capsnet::data::default_data_dir("mnist"), "data/mnist");
  EXPECT_EQ(capsnet::data::default_data_dir("fashion-mnist"), kFashionDir);
  try {
    capsnet::data::default_data_dir("cifar10");
    FAIL() << "expected std::invalid_argument";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("unknown dataset 'cifar10' (expected one of: mnist, fashion-mnist)"),
              std::string::npos)
        << e.what();
  }
}

TEST(Datasets, ClassNames) {
  const auto& digits = capsnet::data::class_names("mnist");
  const auto& fashion = capsnet::data::class_names("fashion-mnist");
  ASSERT_EQ(digits.size(), 10u);
  ASSERT_EQ(fashion.size(), 10u);
  EXPECT_EQ(digits[7], "7");
  EXPECT_EQ(fashion[0], "T-shirt/top");
  EXPECT_EQ(fashion[9], "Ankle boot");
  EXPECT_THROW(capsnet::data::class_names("svhn"), std::invalid_argument);
}

// Debian's dataset-fashion-mnist (installed by scripts/setup.sh): gzipped IDX, read by the MNIST loader.
// Its test split is balanced (1000 per class), which MNIST's is not: a check that the right files were read.
TEST(Datasets, FashionMnistFromDebianPackage) {
  ASSERT_TRUE(fs::exists(std::string(kFashionDir) + "/t10k-labels-idx1-ubyte.gz"))
      << "Fashion-MNIST is missing: scripts/setup.sh installs it (apt-get install dataset-fashion-mnist)";
  const auto set = capsnet::data::load_mnist(kFashionDir, Split::kTest);
  ASSERT_EQ(set.size(), 10000);
  EXPECT_EQ(set.images.sizes(), torch::IntArrayRef({10000, 28, 28}));
  EXPECT_TRUE(torch::equal(torch::bincount(set.labels), torch::full({10}, 1000, torch::kLong)));
  EXPECT_EQ(set.labels[0].item<int64_t>(), 9);  // the first Fashion-MNIST test image is an ankle boot
}

TEST(Datasets, MissingFashionDirectoryTellsHowToInstall) {
  try {
    capsnet::data::load_mnist("/nonexistent/fashion-mnist", Split::kTest);
    FAIL() << "expected IdxError";
  } catch (const capsnet::data::IdxError& e) {
    EXPECT_NE(std::string(e.what()).find("apt-get install dataset-fashion-mnist"), std::string::npos) << e.what();
  }
}

#ifdef CAPSNET_CLI
TEST(Datasets, CliRejectsUnknownDataset) {
  const auto r = run_command(std::string(CAPSNET_CLI) + " eval --dataset cifar10");
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.output.find("--dataset"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("cifar10"), std::string::npos) << r.output;
}

// --data wins over --dataset: eval of a fresh checkpoint reads the generated files, not Fashion-MNIST
// (20 test images evaluated, not 10000).
TEST(Datasets, CliDataOverridesDataset) {
  TempDir dir;
  capsnet::testing::write_fake_mnist(dir / "data", 40, 20);
  const std::string cli = CAPSNET_CLI;
  auto train = run_command(cli + " train --data " + (dir / "data") + " --out " + (dir / "run") +
                           " --steps 1 --batch-size 20 --no-eval --no-progress --threads 1");
  ASSERT_EQ(train.status, 0) << train.output;
  auto eval = run_command(cli + " eval --dataset fashion-mnist --data " + (dir / "data") + " --checkpoint " +
                          (dir / "run") + "/checkpoint.pt --threads 1 --json");
  ASSERT_EQ(eval.status, 0) << eval.output;
  EXPECT_NE(eval.output.find("\"examples\":20"), std::string::npos) << eval.output;

  auto missing = run_command(cli + " eval --dataset fashion-mnist --data " + (dir / "nowhere") + " --checkpoint " +
                             (dir / "run") + "/checkpoint.pt --threads 1");
  EXPECT_NE(missing.status, 0);
  EXPECT_NE(missing.output.find("nowhere"), std::string::npos) << missing.output;
}
#endif

}  // namespace
