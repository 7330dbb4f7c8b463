// capsnet export: the weight file read back with torch::pickle_load equals the model (round trip),
// the probe holds the model's own outputs, the CLI end to end on a tiny checkpoint, and the errors;
// the same for matrix capsules (EM routing) and the baseline CNN, and each loader refusing the others.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <set>
#include <variant>

#include "capsnet/data/transforms.h"
#include "capsnet/train/checkpoint.h"
#include "capsnet/train/evaluate.h"
#include "capsnet/train/export.h"
#include "test_helpers.h"
#include "tiny_configs.h"

namespace capsnet {
namespace {

using testing::TempDir;
using testing::tiny_config;

const std::string kCli = CAPSNET_CLI;

models::CapsNet tiny_model(uint64_t seed) {
  torch::manual_seed(seed);
  return models::CapsNet(tiny_config());
}

void expect_same_as_model(const train::ExportedWeights& w, models::CapsNet& model) {
  EXPECT_EQ(w.config, model->config.to_json());
  const auto params = model->named_parameters();
  ASSERT_EQ(w.state_dict.size(), params.size() + model->named_buffers().size());
  for (const auto& p : params) {
    auto it = w.state_dict.find(p.key());
    ASSERT_NE(it, w.state_dict.end()) << p.key();
    EXPECT_TRUE(torch::equal(it->second, p.value())) << p.key();
    EXPECT_EQ(it->second.dtype(), p.value().dtype()) << p.key();
  }
}

TEST(Export, RoundTripThroughPickleLoadGivesBackTheSameTensors) {
  TempDir dir;
  auto model = tiny_model(1);
  const auto path = dir / "sub/weights.pt";  // parent directory created
  const auto bytes = train::save_weights(path, model, 42);
  EXPECT_EQ(bytes, static_cast<int64_t>(std::filesystem::file_size(path)));
  auto w = train::read_weights(path);
  EXPECT_EQ(w.step, 42);
  EXPECT_TRUE(w.probe.empty());
  expect_same_as_model(w, model);
  EXPECT_EQ(w.state_dict.at("digit_caps.weight").sizes(),
            (std::vector<int64_t>{model->config.num_primary_caps(), 10, 4, 4}));
  // The written tensors are copies: training the model afterwards does not change them.
  auto before = w.state_dict.at("conv1.weight").clone();
  torch::NoGradGuard g;
  model->conv1->weight.add_(1);
  EXPECT_TRUE(torch::equal(train::read_weights(path).state_dict.at("conv1.weight"), before));
  // No temporary files left beside it.
  int files = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir / "sub")) files += e.is_regular_file();
  EXPECT_EQ(files, 1);
}

TEST(Export, ProbeHoldsTheModelsInferenceOutputs) {
  TempDir dir;
  auto model = tiny_model(2);
  model->train();
  train::ExportOptions o;
  o.probe = 3;
  o.probe_seed = 5;
  train::save_weights(dir / "a.pt", model, 0, o);
  EXPECT_TRUE(model->is_training());  // restored after the probe
  auto w = train::read_weights(dir / "a.pt");
  const auto& images = w.probe.at("images");
  ASSERT_EQ(images.sizes(), (std::vector<int64_t>{3, 1, 12, 12}));
  EXPECT_GE(images.min().item<float>(), 0.f);
  EXPECT_LT(images.max().item<float>(), 1.f);
  torch::NoGradGuard g;
  model->eval();
  auto out = model(images);
  EXPECT_TRUE(torch::allclose(w.probe.at("lengths"), out.lengths, 1e-6, 1e-7));
  EXPECT_TRUE(torch::allclose(w.probe.at("digit_caps"), out.digit_caps, 1e-6, 1e-7));
  // Inference masking: the reconstruction decodes the longest capsule.
  EXPECT_TRUE(torch::allclose(w.probe.at("reconstruction"), model->decode(out.digit_caps, out.lengths.argmax(1)),
                              1e-6, 1e-7));
  // Same seed, same images; another seed, other images.
  train::save_weights(dir / "b.pt", model, 0, o);
  EXPECT_TRUE(torch::equal(train::read_weights(dir / "b.pt").probe.at("images"), images));
  o.probe_seed = 6;
  train::save_weights(dir / "c.pt", model, 0, o);
  EXPECT_FALSE(torch::equal(train::read_weights(dir / "c.pt").probe.at("images"), images));
}

TEST(Export, NoDecoderMeansNoReconstructionInTheProbe) {
  TempDir dir;
  auto c = tiny_config();
  c.reconstruction = false;
  models::CapsNet model(c);
  train::ExportOptions o;
  o.probe = 2;
  train::save_weights(dir / "w.pt", model, 0, o);
  auto w = train::read_weights(dir / "w.pt");
  EXPECT_EQ(w.probe.count("reconstruction"), 0u);
  EXPECT_EQ(w.state_dict.count("decoder.fc1.weight"), 0u);
  expect_same_as_model(w, model);
}

TEST(Export, CliExportsACheckpoint) {
  TempDir dir;
  auto model = tiny_model(3);
  train::save_checkpoint(dir / "ckpt.pt", model, nullptr, {7, model->config.to_json(), nlohmann::json::object()});
  auto r = testing::run_command(kCli + " export --checkpoint " + (dir / "ckpt.pt") + " --out " + (dir / "w.pt") +
                                " --probe 2 --threads 1");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("(step 7)"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("probe of 2 images"), std::string::npos) << r.output;
  auto w = train::read_weights(dir / "w.pt");
  EXPECT_EQ(w.step, 7);
  EXPECT_EQ(w.probe.at("lengths").sizes(), (std::vector<int64_t>{2, 10}));
  expect_same_as_model(w, model);
}

std::string error_message(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "no exception";
}

TEST(Export, MatrixCapsNetRoundTripProbeAndLoaders) {
  TempDir dir;
  torch::manual_seed(5);
  models::MatrixCapsNet model(testing::tiny_em_config());
  train::ExportOptions o;
  o.probe = 2;
  o.storage = train::WeightStorage::kFloat16;
  const std::string path = dir / "em.pt";
  train::save_weights(path, model, 11, o);

  auto w = train::read_weights(path);
  EXPECT_EQ(w.model, train::kMatrixCapsNetModel);
  EXPECT_EQ(w.step, 11);
  EXPECT_EQ(w.config, model->config.to_json());
  const auto params = model->named_parameters();
  ASSERT_EQ(w.state_dict.size(), params.size() + model->named_buffers().size());
  for (const auto& p : params) {  // the live weights were rounded to fp16 in place, so these are equal
    ASSERT_EQ(w.state_dict.count(p.key()), 1u) << p.key();
    EXPECT_EQ(w.state_dict.at(p.key()).dtype(), torch::kFloat16) << p.key();
    EXPECT_TRUE(torch::equal(w.state_dict.at(p.key()).to(torch::kFloat), p.value())) << p.key();
  }
  std::set<std::string> probe_keys;
  for (const auto& [k, v] : w.probe) probe_keys.insert(k);
  EXPECT_EQ(probe_keys, (std::set<std::string>{"images", "poses", "activations"}));

  // The loaders: a matrix-capsnet file builds the same network; the CapsNet loader refuses it by name.
  EXPECT_EQ(train::stored_model(path), train::kMatrixCapsNetModel);
  auto loaded = train::load_matrix_model(path);
  EXPECT_FALSE(loaded->is_training());
  {
    torch::NoGradGuard g;
    auto out = loaded(w.probe.at("images"));
    EXPECT_TRUE(torch::allclose(out.activations, w.probe.at("activations"), 1e-5, 1e-6));
    EXPECT_TRUE(torch::allclose(out.poses, w.probe.at("poses"), 1e-5, 1e-6));
  }
  EXPECT_NE(error_message([&] { train::load_model(path); }).find("matrix capsules"), std::string::npos);

  // A checkpoint of `capsnet em` (its task is "em"): detected, loaded, exported; load_model refuses it.
  const std::string ckpt = dir / "ckpt.pt";
  train::save_checkpoint(ckpt, *model, nullptr, {3, model->config.to_json(), {{"task", "em"}}});
  EXPECT_EQ(train::stored_model(ckpt), train::kMatrixCapsNetModel);
  auto from_ckpt = train::load_matrix_model(ckpt);
  for (const auto& p : from_ckpt->named_parameters())
    EXPECT_TRUE(torch::equal(p.value(), params[p.key()])) << p.key();
  EXPECT_NE(error_message([&] { train::load_model(ckpt); }).find("capsnet em"), std::string::npos);
  const auto summary = train::export_checkpoint(ckpt, dir / "from_ckpt.pt");
  EXPECT_EQ(summary.step, 3);
  EXPECT_EQ(summary.parameters, models::count_parameters(*model));
  EXPECT_EQ(train::read_weights(dir / "from_ckpt.pt").model, train::kMatrixCapsNetModel);

  // A CapsNet checkpoint and weight file: "capsnet", and refused by the matrix loader.
  auto capsnet = tiny_model(6);
  const std::string capsnet_ckpt = dir / "capsnet_ckpt.pt";
  train::save_checkpoint(capsnet_ckpt, capsnet, nullptr, {0, capsnet->config.to_json(), nlohmann::json::object()});
  train::save_weights(dir / "capsnet.pt", capsnet, 0);
  EXPECT_EQ(train::stored_model(capsnet_ckpt), train::kCapsNetModel);
  EXPECT_EQ(train::read_weights(dir / "capsnet.pt").model, train::kCapsNetModel);
  EXPECT_THROW(train::load_matrix_model(capsnet_ckpt), train::CheckpointError);
  EXPECT_NE(error_message([&] { train::load_matrix_model(dir / "capsnet.pt"); }).find("holds a CapsNet"),
            std::string::npos);

  // An unknown "model" entry is an error, not a CapsNet (written without a checksum, so it loads unchecked).
  auto d = train::export_dict(model, 0, {});
  d.insert_or_assign("model", std::string("hopfield"));
  {
    std::ofstream f(dir / "unknown.pt", std::ios::binary);
    const auto bytes = torch::pickle_save(c10::IValue(d));
    f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  }
  EXPECT_NE(error_message([&] { train::read_weights(dir / "unknown.pt"); }).find("unknown model"), std::string::npos);
}

// The baseline CNN (capsnet affine / stn) exports like the capsule networks: fp16 round trip, a probe of its
// logits, detection in checkpoints (by its config), the export of a checkpoint, evaluate() equal to the
// logits' argmax and cross-entropy, and every other loader refusing it by name.
TEST(Export, BaselineCnnRoundTripProbeLoadersAndEvaluate) {
  TempDir dir;
  torch::manual_seed(9);
  auto config = testing::tiny_cnn_config(12);
  config.stn = true;  // the transformer's weights travel too
  models::BaselineCnn model(config);
  const std::string ckpt = dir / "cnn_ckpt.pt";
  train::save_checkpoint(ckpt, *model, nullptr, {7, model->config.to_json(), {{"task", "st-cnn"}}});
  EXPECT_EQ(train::stored_model(ckpt), train::kBaselineCnnModel);
  auto from_ckpt = train::load_baseline_cnn(ckpt);
  EXPECT_FALSE(from_ckpt->is_training());
  const auto params = model->named_parameters();
  for (const auto& p : from_ckpt->named_parameters())
    EXPECT_TRUE(torch::equal(p.value(), params[p.key()])) << p.key();
  EXPECT_NE(error_message([&] { train::load_model(ckpt); }).find("holds the baseline CNN, not a CapsNet"),
            std::string::npos);
  EXPECT_NE(error_message([&] { train::load_matrix_model(ckpt); }).find("baseline CNN"), std::string::npos);

  train::ExportOptions o;
  o.probe = 3;
  o.storage = train::WeightStorage::kFloat16;
  const auto summary = train::export_checkpoint(ckpt, dir / "cnn.pt", o);
  EXPECT_EQ(summary.step, 7);
  EXPECT_EQ(summary.parameters, config.num_parameters());
  auto w = train::read_weights(dir / "cnn.pt");
  EXPECT_EQ(w.model, train::kBaselineCnnModel);
  EXPECT_EQ(w.config, config.to_json());
  ASSERT_EQ(w.probe.count("logits"), 1u);
  EXPECT_EQ(w.probe.at("logits").sizes(), (std::vector<int64_t>{3, 10}));
  auto loaded = train::load_baseline_cnn(dir / "cnn.pt");
  for (const auto& p : loaded->named_parameters()) {  // the fp16-rounded weights, exactly
    EXPECT_EQ(w.state_dict.at(p.key()).dtype(), torch::kFloat16) << p.key();
    EXPECT_TRUE(torch::equal(p.value(), params[p.key()].to(torch::kFloat16).to(torch::kFloat))) << p.key();
  }
  torch::NoGradGuard no_grad;
  EXPECT_TRUE(torch::allclose(loaded(w.probe.at("images")), w.probe.at("logits"), 1e-5, 1e-6));
  EXPECT_NE(error_message([&] { train::load_model(dir / "cnn.pt"); }).find("holds the baseline CNN"),
            std::string::npos);

  // evaluate(): accuracy, confusion and mean cross-entropy of the logits, over uneven batches.
  data::ImageSet set;
  set.images = torch::randint(0, 256, {7, 12, 12}, torch::kUInt8);
  set.labels = torch::randint(0, 10, {7}, torch::kLong);
  const auto r = train::evaluate(loaded, set, /*batch_size=*/3);
  auto logits = loaded(data::to_float(set.images));
  const auto pred = logits.argmax(1);
  EXPECT_EQ(r.examples, 7);
  EXPECT_DOUBLE_EQ(r.accuracy, pred.eq(set.labels).to(torch::kDouble).mean().item<double>());
  EXPECT_NEAR(r.loss, torch::nn::functional::cross_entropy(logits, set.labels).item<double>(), 1e-6);
  EXPECT_EQ(r.confusion.sum().item<int64_t>(), 7);
  for (int64_t i = 0; i < 7; ++i)
    EXPECT_GE(r.confusion[set.labels[i].item<int64_t>()][pred[i].item<int64_t>()].item<int64_t>(), 1);
}

// load_any_model: every network from a checkpoint and from a weight file, the same weights as its own
// loader, in eval mode, with its input side, channels and class names (the card's or the options').
TEST(Export, LoadAnyModelTakesEveryNetworkFromCheckpointsAndWeightFiles) {
  TempDir dir;
  torch::manual_seed(13);
  auto capsnet = tiny_model(14);
  models::MatrixCapsNet em(testing::tiny_em_config());
  models::BaselineCnn cnn(testing::tiny_cnn_config(12));
  const std::vector<std::string> letters{"a", "b", "c", "d", "e", "f", "g", "h", "i", "j"};
  const nlohmann::json options = {{"classes", letters}};
  train::ExportOptions o;
  o.card = options;
  train::save_checkpoint(dir / "capsnet_ckpt.pt", *capsnet, nullptr, {1, capsnet->config.to_json(), options});
  train::save_checkpoint(dir / "em_ckpt.pt", *em, nullptr, {2, em->config.to_json(), {{"task", "em"}}});
  train::save_checkpoint(dir / "cnn_ckpt.pt", *cnn, nullptr, {3, cnn->config.to_json(), options});
  train::save_weights(dir / "capsnet.pt", capsnet, 1, o);
  train::save_weights(dir / "em.pt", em, 2, o);
  train::save_weights(dir / "cnn.pt", cnn, 3);

  struct Case {
    std::string file, kind;
    size_t alternative;
    torch::nn::Module* module;
    int64_t side;
    bool lettered;  // class names from the options or card
  };
  const std::vector<Case> cases{
      {"capsnet_ckpt.pt", train::kCapsNetModel, 0, capsnet.get(), capsnet->config.image_size, true},
      {"capsnet.pt", train::kCapsNetModel, 0, capsnet.get(), capsnet->config.image_size, true},
      {"em_ckpt.pt", train::kMatrixCapsNetModel, 1, em.get(), em->config.image_size, false},
      {"em.pt", train::kMatrixCapsNetModel, 1, em.get(), em->config.image_size, true},
      {"cnn_ckpt.pt", train::kBaselineCnnModel, 2, cnn.get(), 12, true},
      {"cnn.pt", train::kBaselineCnnModel, 2, cnn.get(), 12, false}};
  for (const auto& c : cases) {
    SCOPED_TRACE(c.file);
    auto m = train::load_any_model(dir / c.file);
    EXPECT_EQ(m.kind, c.kind);
    ASSERT_EQ(m.network.index(), c.alternative);
    // The step and the training options come with it: a checkpoint's options, a weight file's card's
    // "train_options" (none here).
    EXPECT_EQ(m.step, static_cast<int64_t>(c.alternative) + 1);
    const bool weight_file = c.file.find("_ckpt") == std::string::npos;
    EXPECT_EQ(m.weight_file, weight_file);
    EXPECT_EQ(train::has_checkpoint_trailer(dir / c.file), !weight_file);
    if (weight_file)
      EXPECT_TRUE(m.train_options.is_null()) << m.train_options;
    else
      EXPECT_EQ(m.train_options, c.alternative == 1 ? nlohmann::json({{"task", "em"}}) : options);
    EXPECT_EQ(m.image_size(), c.side);
    EXPECT_EQ(m.image_channels(), 1);
    EXPECT_EQ(m.spec.class_names, c.lettered ? letters : std::vector<std::string>({"0", "1", "2", "3", "4", "5", "6",
                                                                                     "7", "8", "9"}));
    const auto params = c.module->named_parameters();
    std::visit(
        [&](auto& net) {
          EXPECT_FALSE(net->is_training());
          ASSERT_EQ(net->named_parameters().size(), params.size());
          // Weight files store fp32 here: the same values as the live model, bit for bit.
          for (const auto& p : net->named_parameters())
            EXPECT_TRUE(torch::equal(p.value(), params[p.key()])) << p.key();
        },
        m.network);
  }
  EXPECT_THROW(train::load_any_model(dir / "missing.pt"), train::CheckpointError);
  EXPECT_FALSE(train::has_checkpoint_trailer(dir / "missing.pt"));
  EXPECT_FALSE(train::has_checkpoint_trailer(dir.str()));  // a directory
  // A weight file's card keeps a MultiMNIST checkpoint's training options (export): load_any_model gives them.
  train::ExportOptions with_options;
  with_options.card = {{"train_options", {{"task", "multimnist"}, {"batch_size", 100}}}};
  train::save_weights(dir / "mm.pt", capsnet, 7, with_options);
  const auto mm = train::load_any_model(dir / "mm.pt");
  EXPECT_EQ(mm.step, 7);
  EXPECT_EQ(mm.train_options, with_options.card.at("train_options"));
}

// A version-3 checkpoint is told from a weight file by its last 20 bytes: a file that ends in the trailer's
// magic is not read as a weight file (so not read whole), and damage there is the checkpoint reader's to report.
TEST(Export, ACheckpointIsToldFromAWeightFileByItsTrailer) {
  TempDir dir;
  auto model = tiny_model(4);
  const auto ckpt = dir / "ckpt.pt";
  train::save_checkpoint(ckpt, model, nullptr, {5, model->config.to_json(), nlohmann::json::object()});
  EXPECT_TRUE(train::has_checkpoint_trailer(ckpt));
  EXPECT_FALSE(train::try_read_weights(ckpt).has_value());
  EXPECT_FALSE(train::is_weights_file(ckpt));
  // The magic's first byte flipped: no longer a version-3 checkpoint by its end, and no weight file either;
  // the checkpoint reader calls it corrupt.
  auto bytes = testing::read_bytes(ckpt);
  const size_t magic = bytes.size() - 20;
  bytes[magic] = static_cast<char>(bytes[magic] ^ 0x01);
  const auto damaged = dir / "damaged.pt";
  testing::write_bytes(damaged, bytes);
  EXPECT_FALSE(train::has_checkpoint_trailer(damaged));
  EXPECT_FALSE(train::try_read_weights(damaged).has_value());
  EXPECT_THROW(train::load_any_model(damaged), train::CheckpointError);
  // Shorter than a trailer.
  testing::write_bytes(dir / "short.pt", std::string("capsckp3"));
  EXPECT_FALSE(train::has_checkpoint_trailer(dir / "short.pt"));
}

TEST(Export, ErrorsNameTheBadArgument) {
  TempDir dir;
  auto model = tiny_model(4);
  const auto ckpt = dir / "ckpt.pt";
  train::save_checkpoint(ckpt, model, nullptr, {0, model->config.to_json(), nlohmann::json::object()});

  EXPECT_THROW(train::export_checkpoint(dir / "absent.pt", dir / "w.pt"), train::CheckpointError);
  EXPECT_THROW(train::export_checkpoint(ckpt, dir.str()), std::invalid_argument);  // a directory
  EXPECT_THROW(train::export_checkpoint(ckpt, ckpt), std::invalid_argument);       // itself
  train::ExportOptions bad;
  bad.probe = -1;
  EXPECT_THROW(train::export_checkpoint(ckpt, dir / "w.pt", bad), std::invalid_argument);
  EXPECT_FALSE(std::filesystem::exists(dir / "w.pt"));
  {
    std::ofstream f(dir / "file");
    f << "x";
  }
  EXPECT_THROW(train::save_weights(dir / "file/w.pt", model, 0), train::ExportError);  // parent is a file

  auto message = [](auto fn) {
    try {
      fn();
    } catch (const std::exception& e) {
      return std::string(e.what());
    }
    return std::string("no exception");
  };
  EXPECT_NE(message([&] { train::export_checkpoint(ckpt, ckpt); }).find("is the checkpoint itself"), std::string::npos);
  EXPECT_NE(message([&] { train::read_weights(dir / "nope.pt"); }).find("nope.pt"), std::string::npos);
  // A checkpoint is not a weight file; a truncated weight file is reported as such.
  EXPECT_THROW(train::read_weights(ckpt), train::ExportError);
  train::save_weights(dir / "w.pt", model, 0);
  std::filesystem::resize_file(dir / "w.pt", std::filesystem::file_size(dir / "w.pt") / 2);
  EXPECT_NE(message([&] { train::read_weights(dir / "w.pt"); }).find("cannot be read"), std::string::npos);

  auto r = testing::run_command(kCli + " export --checkpoint " + (dir / "absent.pt") + " --out " + (dir / "x.pt"));
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.output.find("absent.pt"), std::string::npos) << r.output;
  r = testing::run_command(kCli + " export --checkpoint " + ckpt + " --out " + (dir / "x.pt") + " --probe -1");
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.output.find("--probe"), std::string::npos) << r.output;
  r = testing::run_command(kCli + " export --checkpoint " + ckpt);
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.output.find("--out"), std::string::npos) << r.output;
  EXPECT_FALSE(std::filesystem::exists(dir / "x.pt"));
}

}  // namespace
}  // namespace capsnet
