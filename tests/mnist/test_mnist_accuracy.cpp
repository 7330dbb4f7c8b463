// Real data, real model: the paper's CapsNet trained on the first 24,000 MNIST training images for
// one pass must reach >= 97% accuracy on the full 10,000-image test set. A few minutes on 2 cores.
#include <gtest/gtest.h>

#include <filesystem>
#include <iostream>

#include "capsnet/data/mnist.h"
#include "capsnet/train/trainer.h"
#include "test_helpers.h"

namespace capsnet {
namespace {

TEST(MnistAccuracyTest, PaperModelReaches97PercentOnTheFullTestSet) {
  const std::string dir = CAPSNET_DATA_DIR;
  ASSERT_TRUE(std::filesystem::exists(dir + "/train-images-idx3-ubyte"))
      << "MNIST is missing from " << dir << ": run scripts/fetch_mnist.sh (scripts/test.sh does)";
  auto train_set = data::take(data::load_mnist(dir, data::Split::kTrain), 24000);
  auto test_set = data::load_mnist(dir, data::Split::kTest);
  ASSERT_EQ(test_set.size(), 10000);

  testing::TempDir out;
  train::TrainOptions o;  // the paper's model and the CLI's defaults: batch 100, Adam 1e-3, shifts of 2 px
  o.loop.out_dir = out.str();
  o.loop.epochs = 1;
  o.loop.checkpoint_every = 0;
  o.loop.progress = false;
  auto r = train::train(o, train_set, &test_set, std::cout);
  ASSERT_TRUE(r.test.has_value());
  std::cout << "test accuracy " << 100 * r.test->accuracy << "% after " << r.steps << " steps, "
            << r.images_per_second << " img/s\n";
  EXPECT_EQ(r.test->examples, 10000);
  EXPECT_GE(r.test->accuracy, 0.97);
}

}  // namespace
}  // namespace capsnet
