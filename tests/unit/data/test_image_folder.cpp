// Image files (PNG, JPEG), image-folder datasets, coloured digits, and training from a folder.
#include <gtest/gtest.h>

#include <filesystem>
#include <algorithm>
#include <fstream>
#include <functional>
#include <map>
#include <sstream>

#include "capsnet/data/coloured_digits.h"
#include "capsnet/data/image_file.h"
#include "capsnet/data/image_folder.h"
#include "capsnet/data/mnist.h"
#include "capsnet/train/checkpoint.h"
#include "capsnet/train/trainer.h"
#include "test_helpers.h"

namespace capsnet {
namespace {

namespace fs = std::filesystem;
using data::Fit;
using testing::TempDir;

torch::Tensor random_image(int64_t c, int64_t h, int64_t w, uint64_t seed) {
  torch::manual_seed(seed);
  return torch::randint(0, 256, {c, h, w}, torch::kUInt8);
}

void expect_throws_containing(const std::function<void()>& f, const std::vector<std::string>& parts) {
  try {
    f();
    ADD_FAILURE() << "no exception";
  } catch (const std::exception& e) {
    for (const auto& p : parts) EXPECT_NE(std::string(e.what()).find(p), std::string::npos) << e.what() << " / " << p;
  }
}

TEST(ImageFileTest, PngRoundTripsGreyAndColourExactly) {
  TempDir dir;
  for (int64_t c : {1, 3}) {
    auto img = random_image(c, 7, 5, c);
    const auto path = dir / ("img" + std::to_string(c) + ".png");
    data::write_image_png(path, img);
    auto back = data::read_image(path);
    EXPECT_EQ(back.sizes(), img.sizes());
    EXPECT_TRUE(torch::equal(back, img));
  }
}

TEST(ImageFileTest, JpegDecodesCloseToTheEncodedImage) {
  TempDir dir;
  // A smooth image (JPEG is lossy; on smooth content quality 100 stays within a few levels).
  auto ramp = (torch::arange(16).view({1, 16}) * 8 + torch::arange(16).view({16, 1}) * 4).to(torch::kUInt8);
  for (int64_t c : {1, 3}) {
    auto img = c == 1 ? ramp.unsqueeze(0) : torch::stack({ramp, 255 - ramp, torch::div(ramp, 2, "floor")});
    const auto path = dir / ("img" + std::to_string(c) + ".jpg");
    data::write_image_jpeg(path, img.contiguous(), 100);
    auto back = data::read_image(path);
    ASSERT_EQ(back.sizes(), img.sizes());
    const auto err = (back.to(torch::kFloat) - img.to(torch::kFloat)).abs();
    // Colour JPEGs subsample chroma (4:2:0), so single pixels may be off by ~10; a swapped or
    // misread channel would be off by ~100 everywhere.
    EXPECT_LE(err.max().item<float>(), 12) << "channels " << c;
    EXPECT_LE(err.mean().item<float>(), 2) << "channels " << c;
  }
}

TEST(ImageFileTest, RecognisesTheFormatByContentAndNamesBadFiles) {
  TempDir dir;
  // A PNG named .jpg still reads (the first bytes decide).
  data::write_image_png(dir / "really_png.jpg", random_image(3, 4, 4, 1));
  EXPECT_EQ(data::read_image(dir / "really_png.jpg").size(0), 3);
  {
    std::ofstream(dir / "text.png") << "hello, not an image";
  }
  expect_throws_containing([&] { data::read_image(dir / "text.png"); }, {"text.png", "neither PNG nor JPEG"});
  // A truncated PNG and a truncated JPEG.
  data::write_image_png(dir / "full.png", random_image(3, 32, 32, 2));
  data::write_image_jpeg(dir / "full.jpg", random_image(3, 32, 32, 3));
  for (const std::string name : {"full.png", "full.jpg"}) {
    std::ifstream in(dir / name, std::ios::binary);
    std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    // A third of the file, and all but the last tenth (libjpeg only warns and fills in grey there).
    for (const size_t keep : {bytes.size() / 3, bytes.size() * 9 / 10}) {
      const auto cut = "cut_" + std::to_string(keep) + "_" + name;
      std::ofstream(dir / cut, std::ios::binary) << bytes.substr(0, keep);
      EXPECT_THROW(data::read_image(dir / cut), data::ImageError) << cut;
    }
  }
  EXPECT_THROW(data::read_image(dir / "missing.png"), data::ImageError);
}

TEST(ImageFileTest, FitResizesPadsAndCrops) {
  auto img = torch::full({1, 4, 6}, 200, torch::kUInt8);
  // Resize: a constant image stays constant.
  auto r = data::fit_image(img, 8, Fit::kResize);
  EXPECT_EQ(r.sizes(), (std::vector<int64_t>{1, 8, 8}));
  EXPECT_TRUE(torch::all(r == 200).item<bool>());
  // Pad: the 4x6 image centred on an 8x8 black canvas: rows 2..5, columns 1..6.
  auto p = data::fit_image(img, 8, Fit::kPad);
  EXPECT_EQ(p.sum().item<int64_t>(), 200 * 24);
  EXPECT_TRUE(torch::all(p[0].narrow(0, 2, 4).narrow(1, 1, 6) == 200).item<bool>());
  // Pad to a smaller side centre-crops: the 6-wide axis loses one column on each side.
  auto ramp = torch::arange(6, torch::kUInt8).view({1, 1, 6}).expand({1, 4, 6}).contiguous();
  auto c = data::fit_image(ramp, 4, Fit::kPad);
  EXPECT_TRUE(torch::equal(c[0][0], torch::tensor({1, 2, 3, 4}, torch::kUInt8)));
  // Already the size: returned as is.
  EXPECT_TRUE(data::fit_image(img.narrow(2, 0, 4), 4, Fit::kResize).is_same(img.narrow(2, 0, 4)) ||
              torch::equal(data::fit_image(img.narrow(2, 0, 4), 4, Fit::kResize), img.narrow(2, 0, 4)));
  EXPECT_THROW(data::parse_fit("stretch"), std::invalid_argument);
}

TEST(ImageFileTest, ConvertChannelsUsesLumaWeights) {
  auto rgb = torch::tensor({255, 0, 0}, torch::kUInt8).view({3, 1, 1});
  EXPECT_EQ(data::convert_channels(rgb, 1).item<int>(), 76);  // round(0.299 * 255)
  auto grey = torch::full({1, 2, 2}, 9, torch::kUInt8);
  auto three = data::convert_channels(grey, 3);
  EXPECT_EQ(three.sizes(), (std::vector<int64_t>{3, 2, 2}));
  EXPECT_TRUE(torch::all(three == 9).item<bool>());
}

/// The pixel value of every image of a class: a function of its name, so labels can be checked by pixels.
int64_t value_of(const std::string& name) { return (name[0] - 'a') * 10; }

/// DIR/<class>/<i>.png for `per_class` images of each class, all pixels value_of(class).
void write_tree(const std::string& dir, const std::vector<std::string>& classes, int64_t per_class, int64_t c = 1,
                int64_t side = 6) {
  for (const auto& name : classes)
    for (int64_t i = 0; i < per_class; ++i)
      data::write_image_png(dir + "/" + name + "/" + std::to_string(i) + ".png",
                            torch::full({c, side, side}, value_of(name), torch::kUInt8));
}

TEST(ImageFolderTest, PresplitFolderKeepsClassesAndLabels) {
  TempDir dir;
  write_tree(dir / "train", {"cat", "dog", "emu"}, 4);
  write_tree(dir / "test", {"dog", "cat"}, 2);
  {
    std::ofstream(dir / "train/cat/README.txt") << "not an image";
  }
  EXPECT_TRUE(data::is_image_folder(dir.str()));
  auto f = data::load_image_folder(dir.str());
  EXPECT_TRUE(f.presplit);
  EXPECT_EQ(f.class_names, (std::vector<std::string>{"cat", "dog", "emu"}));
  EXPECT_EQ(f.train.size(), 12);
  EXPECT_EQ(f.test.size(), 4);
  EXPECT_EQ(f.train.images.sizes(), (std::vector<int64_t>{12, 1, 6, 6}));
  // Each image's value encodes its class name: labels must agree with the pixels (test/ lists its
  // classes in another order and lacks one: labels go by name, not by position).
  for (const auto* set : {&f.train, &f.test}) {
    for (int64_t i = 0; i < set->size(); ++i)
      EXPECT_EQ(set->images[i].flatten()[0].item<int64_t>(), value_of(f.class_names[set->labels[i].item<int64_t>()]));
    EXPECT_EQ(set->class_names, f.class_names);
  }
  ASSERT_EQ(f.warnings.size(), 1u);
  EXPECT_NE(f.warnings[0].find("ignored 1 file"), std::string::npos);
}

TEST(ImageFolderTest, OneTreeSplitsEveryClassBySeededFraction) {
  TempDir dir;
  write_tree(dir.str(), {"a", "b"}, 10);
  data::ImageFolderOptions o;
  o.test_fraction = 0.3;
  o.split_seed = 5;
  auto f = data::load_image_folder(dir.str(), o);
  EXPECT_FALSE(f.presplit);
  EXPECT_EQ(f.train.size(), 14);
  EXPECT_EQ(f.test.size(), 6);
  EXPECT_EQ(f.test.labels.eq(0).sum().item<int64_t>(), 3);  // 30% of each class
  auto again = data::load_image_folder(dir.str(), o);
  EXPECT_TRUE(torch::equal(again.test.labels, f.test.labels));
  EXPECT_TRUE(torch::equal(again.train.images, f.train.images));
  EXPECT_FALSE(data::is_image_folder(dir / "a"));  // a class directory holds files, not classes
}

TEST(ImageFolderTest, ResizesOrPadsToTheRequestedSide) {
  TempDir dir;
  data::write_image_png(dir / "a/big.png", torch::full({3, 40, 20}, 100, torch::kUInt8));  // [C, H, W]
  data::write_image_png(dir / "b/small.png", torch::full({3, 10, 10}, 50, torch::kUInt8));
  data::ImageFolderOptions o;
  o.test_fraction = 0;
  o.image_size = 16;
  o.fit = Fit::kResize;
  auto r = data::load_image_folder(dir.str(), o);
  EXPECT_EQ(r.train.images.sizes(), (std::vector<int64_t>{2, 3, 16, 16}));
  EXPECT_TRUE(torch::all(r.train.images[0] == 100).item<bool>());
  o.fit = Fit::kPad;
  auto p = data::load_image_folder(dir.str(), o);
  EXPECT_EQ(p.train.images[1].sum().item<int64_t>(), 3 * 100 * 50);  // 10x10 centred, black around
  // Without an image size: a non-square first image, or square images of different sizes, are errors
  // naming the file and the way out.
  o.image_size = 0;
  expect_throws_containing([&] { data::load_image_folder(dir.str(), o); }, {"big.png", "not square", "--image-size"});
  TempDir square;
  data::write_image_png(square / "a/one.png", torch::zeros({3, 12, 12}, torch::kUInt8));
  data::write_image_png(square / "b/two.png", torch::zeros({3, 10, 10}, torch::kUInt8));
  expect_throws_containing([&] { data::load_image_folder(square.str(), o); }, {"two.png", "one.png", "--image-size"});
}

TEST(ImageFolderTest, BadFoldersFailNamingTheProblem) {
  {
    TempDir dir;
    write_tree(dir.str(), {"only"}, 3);
    expect_throws_containing([&] { data::load_image_folder(dir.str()); }, {"only one class", "only"});
  }
  {
    TempDir dir;
    write_tree(dir.str(), {"a", "b"}, 3);
    fs::create_directories(dir / "c");
    expect_throws_containing([&] { data::load_image_folder(dir.str()); }, {"class 'c' has no"});
  }
  {
    TempDir dir;
    write_tree(dir.str(), {"a", "b"}, 3);
    data::write_image_png(dir / "b/colour.png", torch::zeros({3, 6, 6}, torch::kUInt8));
    expect_throws_containing([&] { data::load_image_folder(dir.str()); }, {"colour.png", "all grey or all colour"});
  }
  {
    TempDir dir;
    write_tree(dir / "train", {"a", "b"}, 3);
    write_tree(dir / "test", {"a", "zebra"}, 1);
    expect_throws_containing([&] { data::load_image_folder(dir.str()); }, {"zebra", "does not exist"});
  }
  {
    TempDir dir;
    EXPECT_FALSE(data::is_image_folder(dir.str()));
    expect_throws_containing([&] { data::load_image_folder(dir.str()); }, {"no class directories"});
  }
}

TEST(ImageFolderTest, UnreadableFilesStopOrAreSkippedBehindTheFlag) {
  TempDir dir;
  write_tree(dir.str(), {"a", "b"}, 3);
  {
    std::ofstream(dir / "b/broken.png") << "garbage";
  }
  data::ImageFolderOptions o;
  o.test_fraction = 0;
  expect_throws_containing([&] { data::load_image_folder(dir.str(), o); }, {"broken.png", "--skip-unreadable"});
  o.skip_unreadable = true;
  auto f = data::load_image_folder(dir.str(), o);
  EXPECT_EQ(f.train.size(), 6);
  ASSERT_FALSE(f.warnings.empty());
  EXPECT_NE(f.warnings[0].find("broken.png"), std::string::npos);
}

TEST(ImageFolderTest, WriteThenLoadGivesTheSameImagesAndLabels) {
  TempDir dir;
  auto set = testing::synthetic_set(30, 10, 3);
  set.class_names = {"zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"};
  EXPECT_EQ(data::write_image_folder(set, dir / "train"), 30);
  data::write_image_folder(data::take(set, 10), dir / "test");
  auto f = data::load_image_folder(dir.str());
  // Class directories sort by name, so labels are renumbered: compare through the names.
  ASSERT_EQ(f.train.size(), 30);
  std::map<std::string, int64_t> pixel_sum_by_class, expected;
  for (int64_t i = 0; i < 30; ++i) {
    pixel_sum_by_class[f.class_names[f.train.labels[i].item<int64_t>()]] += f.train.images[i].sum().item<int64_t>();
    expected[set.class_names[set.labels[i].item<int64_t>()]] += set.images[i].sum().item<int64_t>();
  }
  EXPECT_EQ(pixel_sum_by_class, expected);
  auto bad = set;
  bad.class_names[0] = "a/b";
  EXPECT_THROW(data::write_image_folder(bad, dir / "bad"), std::invalid_argument);
}

TEST(ColouredDigitsTest, PaintsDigitsWithContrastDeterministically) {
  auto src = testing::synthetic_set(20, 28, 4);
  auto a = data::coloured_digits(src, 9);
  auto b = data::coloured_digits(src, 9);
  EXPECT_EQ(a.images.sizes(), (std::vector<int64_t>{20, 3, 32, 32}));
  EXPECT_TRUE(torch::equal(a.images, b.images));
  EXPECT_TRUE(torch::equal(a.labels, src.labels));
  EXPECT_FALSE(torch::equal(a.images, data::coloured_digits(src, 10).images));
  // The border (outside the centred 28x28 digit) is pure background; a full-intensity pixel is pure foreground.
  const auto luma = torch::tensor({0.299, 0.587, 0.114}, torch::kDouble);
  for (int64_t i = 0; i < 20; ++i) {
    auto bg = a.images[i].select(1, 0).select(1, 0).to(torch::kDouble);  // pixel (0, 0)
    EXPECT_TRUE(torch::all(a.images[i].narrow(1, 0, 2) == a.images[i].select(1, 0).select(1, 0).view({3, 1, 1})).item<bool>());
    auto lit = (src.images[i] == 255).nonzero();
    ASSERT_GT(lit.size(0), 0);
    auto fg = a.images[i].index({torch::indexing::Slice(), lit[0][0].item<int64_t>() + 2, lit[0][1].item<int64_t>() + 2})
                  .to(torch::kDouble);
    EXPECT_GE(std::abs((fg - bg).dot(luma).item<double>()), 96 - 1.5);  // rounding of each channel
  }
  EXPECT_THROW(data::coloured_digits(src, 1, {20}), std::invalid_argument);
}

// The acceptance test: a slice of MNIST written as an image folder trains exactly like the
// IDX files, given the same examples in the same order (the folder sorts by class, so the IDX set
// is put in that order too).
TEST(ImageFolderTest, MnistAsAFolderTrainsExactlyLikeTheIdxFiles) {
  const std::string mnist = CAPSNET_DATA_DIR;
  if (!fs::exists(data::mnist_images_path(mnist, data::Split::kTrain)))
    GTEST_SKIP() << "MNIST not fetched (scripts/fetch_mnist.sh)";
  auto idx = data::take(data::load_mnist(mnist, data::Split::kTrain), 120);
  TempDir dir;
  data::write_image_folder(idx, dir / "train");
  data::write_image_folder(data::take(data::load_mnist(mnist, data::Split::kTest), 40), dir / "test");
  auto folder = data::load_image_folder(dir.str());
  ASSERT_EQ(folder.class_names, data::class_names("mnist"));
  // The IDX rows in the folder's order: by class, then by index (the file names).
  auto order = std::get<1>(torch::sort(idx.labels * 1000 + torch::arange(idx.size()), 0));
  data::ImageSet sorted{idx.images.index_select(0, order), idx.labels.index_select(0, order)};
  ASSERT_TRUE(torch::equal(folder.train.images.squeeze(1), sorted.images));
  ASSERT_TRUE(torch::equal(folder.train.labels, sorted.labels));

  auto options = [&](const std::string& out) {
    train::TrainOptions o;
    o.model = models::CapsNetConfig{};
    o.model.conv1_channels = 16;
    o.model.primary_types = 4;
    o.loop.out_dir = out;
    o.loop.batch_size = 20;
    o.loop.max_steps = 4;
    o.loop.seed = 3;
    o.loop.progress = false;
    o.loop.evaluate_each_epoch = false;
    return o;
  };
  std::ostringstream log;
  auto from_idx = train::train(options(dir / "run_idx"), sorted, nullptr, log);
  auto from_folder = train::train(options(dir / "run_folder"), folder.train, nullptr, log);
  ASSERT_EQ(from_idx.losses.size(), 4u);
  EXPECT_EQ(from_idx.losses, from_folder.losses);
  // The folder's class names travel with the checkpoint.
  EXPECT_EQ(train::read_checkpoint_meta(from_folder.checkpoint).train_options["classes"],
            nlohmann::json(folder.class_names));
}

TEST(ImageFolderTest, ColourImagesTrainAThreeChannelCapsNet) {
  auto src = testing::synthetic_set(40, 28, 6);
  auto set = data::coloured_digits(src, 2);
  train::TrainOptions o;
  o.model = testing::tiny_config();
  o.model.image_size = 32;
  o.model.image_channels = 3;
  TempDir dir;
  o.loop.out_dir = dir / "run";
  o.loop.batch_size = 20;
  o.loop.max_steps = 6;
  o.loop.lr = 3e-3;
  o.loop.progress = false;
  o.loop.evaluate_each_epoch = false;
  std::ostringstream log;
  auto r = train::train(o, set, nullptr, log);
  ASSERT_EQ(r.losses.size(), 6u);
  EXPECT_LT(r.losses.back(), r.losses.front());
  // A grey set for a colour model is refused, naming both.
  o.loop.out_dir = dir / "run2";
  expect_throws_containing([&] { train::train(o, src, nullptr, log); }, {"1 channel", "3"});
}

}  // namespace
}  // namespace capsnet

namespace capsnet {
namespace {

const std::string kCli = CAPSNET_CLI;

std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> out;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) out.push_back(line);
  return out;
}

// Names that are not UTF-8 (a Latin-1 class folder, input file and run folder) go into JSON escaped as \xNN;
// the run they are part of trains, resumes and predicts.
TEST(ImageFolderCliTest, NamesThatAreNotUtf8AreWrittenEscapedAndTheirRunsResume) {
  TempDir dir;
  const auto mnist = dir / "mnist";
  testing::write_fake_mnist(mnist, 30, 10);
  const auto folder = dir / "digits";
  ASSERT_EQ(testing::run_command(kCli + " folder --data " + mnist + " --out " + folder).status, 0);
  const std::string latin1 = "caf\xe9", escaped = "caf\\xE9";  // "café" in Latin-1
  fs::rename(folder + "/train/3", folder + "/train/" + latin1);
  fs::rename(folder + "/test/3", folder + "/test/" + latin1);
  const auto out = dir / ("run-" + latin1);
  const auto train = kCli + " train --data " + folder + " --out " + out + " --batch-size 8 --no-progress --no-eval";
  auto t = testing::run_command(train + " --steps 2");
  ASSERT_EQ(t.status, 0) << t.output;
  std::ifstream metrics(out + "/metrics.jsonl");
  int records = 0;
  for (std::string line; std::getline(metrics, line); ++records) {
    const auto j = nlohmann::json::parse(line);  // valid UTF-8 JSON, every line
    if (j.value("event", "") == "checkpoint")
      EXPECT_NE(j["path"].get<std::string>().find("run-" + escaped), std::string::npos) << line;
  }
  EXPECT_GT(records, 2);
  const auto meta = train::read_checkpoint_meta(out + "/checkpoint.pt");
  EXPECT_NE(meta.train_options.value("out_dir", "").find("run-" + escaped), std::string::npos)
      << meta.train_options.dump();
  const auto classes = meta.train_options.value("classes", std::vector<std::string>{});
  EXPECT_NE(std::find(classes.begin(), classes.end(), escaped), classes.end()) << meta.train_options.dump();
  // Resuming compares the options it is given, escaped, with the checkpoint's.
  auto r = testing::run_command(train + " --steps 3 --resume " + out + "/checkpoint.pt");
  ASSERT_EQ(r.status, 0) << r.output;
  // An input file named so: its JSON line names it escaped; its CSV row names it as it is.
  std::string image;
  for (const auto& e : fs::directory_iterator(folder + "/test/" + latin1)) image = e.path().string();
  const auto renamed = fs::path(image).parent_path() / ("x" + latin1 + ".png");
  fs::rename(image, renamed);
  auto p = testing::run_command(kCli + " predict --json --checkpoint " + out + "/checkpoint.pt " + renamed.string());
  ASSERT_EQ(p.status, 0) << p.output;
  const auto j = nlohmann::json::parse(lines_of(p.output).back());
  EXPECT_NE(j["input"].get<std::string>().find("/x" + escaped + ".png"), std::string::npos) << p.output;
  auto csv = testing::run_command(kCli + " predict --format csv --checkpoint " + out + "/checkpoint.pt " + renamed.string());
  ASSERT_EQ(csv.status, 0) << csv.output;
  EXPECT_NE(csv.output.find(renamed.string()), std::string::npos) << csv.output;
}

// `folder --overwrite` replaces its output only once the new folder is complete, and never the data it reads.
TEST(ImageFolderCliTest, FolderOverwriteNeverLosesTheInputOrThePreviousFolder) {
  TempDir dir;
  const auto mnist = dir / "mnist";
  testing::write_fake_mnist(mnist, 30, 10);
  const auto folder = dir / "digits";
  auto w = testing::run_command(kCli + " folder --data " + mnist + " --out " + folder);
  ASSERT_EQ(w.status, 0) << w.output;
  ASSERT_TRUE(fs::exists(folder + "/train/0"));

  // --out equal to, or above, --data: refused, the data untouched.
  for (const auto& out : {mnist, dir.str(), mnist + "/"}) {
    auto r = testing::run_command(kCli + " folder --data " + mnist + " --out " + out + " --overwrite");
    EXPECT_EQ(r.status, 1) << out << ": " << r.output;
    EXPECT_NE(r.output.find("would replace the data it reads"), std::string::npos) << r.output;
    EXPECT_TRUE(fs::exists(mnist + "/train-images-idx3-ubyte")) << out;
  }
  // A bad --data: an error, and the previous folder is still there, whole.
  auto bad = testing::run_command(kCli + " folder --data " + dir / "missing" + " --out " + folder + " --overwrite");
  EXPECT_NE(bad.status, 0) << bad.output;
  EXPECT_TRUE(fs::exists(folder + "/train/0"));
  EXPECT_TRUE(fs::exists(folder + "/test/0"));
  // A good one replaces it, leaving nothing beside it.
  auto ok = testing::run_command(kCli + " folder --data " + mnist + " --out " + folder + "/ --overwrite --train-limit 10");
  ASSERT_EQ(ok.status, 0) << ok.output;
  EXPECT_NE(ok.output.find("wrote 20 PNG files"), std::string::npos) << ok.output;
  int entries = 0;
  for ([[maybe_unused]] const auto& e : fs::directory_iterator(dir.str())) ++entries;
  EXPECT_EQ(entries, 2) << "mnist and digits only: no staging folder left";
}

// End to end: `folder` writes coloured digits, `train` learns from the folder (its classes, 3 channels,
// 32x32), `eval` and `predict` name the classes, predict writes CSV with poses and JSON lines.
TEST(ImageFolderCliTest, FolderTrainEvalPredict) {
  TempDir dir;
  testing::write_fake_mnist(dir / "mnist", 60, 20);
  const auto folder = dir / "coloured";
  auto w = testing::run_command(kCli + " folder --kind coloured --data " + dir / "mnist" + " --out " + folder);
  ASSERT_EQ(w.status, 0) << w.output;
  EXPECT_NE(w.output.find("wrote 80 PNG files"), std::string::npos) << w.output;
  EXPECT_TRUE(fs::exists(folder + "/test/7"));

  const auto run = dir / "run";
  auto t = testing::run_command(kCli + " train --data " + folder + " --out " + run +
                                " --steps 3 --batch-size 20 --conv1-channels 8 --primary-types 2 --no-progress");
  ASSERT_EQ(t.status, 0) << t.output;
  EXPECT_NE(t.output.find("image folder " + folder + ": 10 classes"), std::string::npos) << t.output;
  EXPECT_NE(t.output.find("3x32x32"), std::string::npos) << t.output;
  auto meta = train::read_checkpoint_meta(run + "/checkpoint.pt");
  EXPECT_EQ(meta.model_config["image_channels"], 3);
  EXPECT_EQ(meta.model_config["image_size"], 32);
  EXPECT_EQ(meta.train_options["dataset"], "image-folder");

  auto e = testing::run_command(kCli + " eval --json --checkpoint " + run + "/checkpoint.pt --data " + folder);
  ASSERT_EQ(e.status, 0) << e.output;
  auto j = nlohmann::json::parse(lines_of(e.output).back());
  EXPECT_EQ(j["examples"], 20);
  EXPECT_EQ(j["classes"].size(), 10u);

  // --limit on a folder (rows sorted by class) samples across classes, not the first class only.
  auto lim = testing::run_command(kCli + " eval --json --limit 10 --checkpoint " + run + "/checkpoint.pt --data " + folder);
  ASSERT_EQ(lim.status, 0) << lim.output;
  auto lj = nlohmann::json::parse(lines_of(lim.output).back());
  EXPECT_EQ(lj["examples"], 10);
  int classes_seen = 0;
  for (const auto& row : lj["confusion"]) {
    int64_t n_row = 0;
    for (const auto& v : row) n_row += v.get<int64_t>();
    classes_seen += n_row > 0;
  }
  EXPECT_GE(classes_seen, 3);

  const auto csv = dir / "out/predictions.csv";
  auto p = testing::run_command(kCli + " predict --checkpoint " + run + "/checkpoint.pt " + folder +
                                "/test --format csv --pose --output " + csv);
  ASSERT_EQ(p.status, 0) << p.output;
  std::ifstream in(csv);
  std::string all((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  auto rows = lines_of(all);
  ASSERT_EQ(rows.size(), 21u) << all;  // header + 20 images
  EXPECT_EQ(rows[0].rfind("input,class,label,length,length_0,", 0), 0u) << rows[0];
  EXPECT_NE(rows[0].find(",pose_15"), std::string::npos);  // digit_dim 16
  EXPECT_EQ(std::count(rows[1].begin(), rows[1].end(), ','), 3 + 10 + 16) << rows[1];

  auto jl = testing::run_command(kCli + " predict --checkpoint " + run + "/checkpoint.pt --format jsonl " + folder +
                                 "/test/3");
  ASSERT_EQ(jl.status, 0) << jl.output;
  int n = 0;
  for (const auto& line : lines_of(jl.output)) {
    if (line.empty() || line[0] != '{') continue;
    auto r = nlohmann::json::parse(line);
    EXPECT_EQ(r["class"], std::to_string(r["prediction"].get<int>()));
    EXPECT_EQ(r["lengths"].size(), 10u);
    ++n;
  }
  EXPECT_EQ(n, 2);  // the test split's images of class 3 (synthetic labels cycle 0..9)

  // IDX files are for the digit commands: a clear message, not "file missing".
  auto bad = testing::run_command(kCli + " multimnist --data " + folder + " --out " + dir / "mm" + " --steps 1");
  EXPECT_NE(bad.status, 0);
  EXPECT_NE(bad.output.find("image folder"), std::string::npos) << bad.output;
}

}  // namespace
}  // namespace capsnet
