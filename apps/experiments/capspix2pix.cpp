#include "apps/experiments/capspix2pix.h"

#include <fmt/format.h>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <stdexcept>

#include "capsnet/train/checkpoint.h"
#include "capsnet/kernels/fused_adam.h"
#include "capsnet/train/gradients.h"
#include "capsnet/viz/figures.h"

namespace capsnet::experiments {

void Pix2pixTrainOptions::validate() const {
  model.validate();
  auto positive = [](const char* name, int64_t v) {
    if (v <= 0) throw std::invalid_argument(fmt::format("capspix2pix: {} must be positive, got {}", name, v));
  };
  positive("steps", loop.max_steps);
  positive("test_size", test_size);
  positive("eval_batch_size", eval_batch_size);
  positive("diversity_maps", diversity_maps);
  if (diversity_samples < 2)
    throw std::invalid_argument(fmt::format("capspix2pix: diversity_samples must be >= 2, got {}", diversity_samples));
  if (!(beta1 >= 0 && beta1 < 1))
    throw std::invalid_argument(fmt::format("capspix2pix: beta1 must be in [0, 1), got {}", beta1));
  if (!(mode_seeking >= 0 && std::isfinite(mode_seeking)))
    throw std::invalid_argument(fmt::format("capspix2pix: mode_seeking must be >= 0, got {}", mode_seeking));
  if (mode_seeking > 0 && (model.z_dim == 0 || loop.batch_size < 2))
    throw std::invalid_argument(
        fmt::format("capspix2pix: mode_seeking needs noise (z_dim > 0, got {}) and batches of >= 2 maps (got {})",
                    model.z_dim, loop.batch_size));
  if (validation_size < 0)
    throw std::invalid_argument(fmt::format("capspix2pix: validation_size must be >= 0, got {}", validation_size));
  if (loop.patience_steps > 0 && validation_size == 0)
    throw std::invalid_argument("capspix2pix: patience_steps needs a validation set (validation_size > 0)");
  loop.validate();
}

// ---- scores ----

torch::Tensor l1_per_image(const torch::Tensor& a, const torch::Tensor& b) {
  return (a - b).abs().flatten(1).mean(1).to(torch::kFloat64);
}

torch::Tensor psnr_per_image(const torch::Tensor& a, const torch::Tensor& b) {
  auto mse = (a - b).to(torch::kFloat64).pow(2).flatten(1).mean(1);
  return (10 * torch::log10(1.0 / mse.clamp_min(1e-10))).clamp_max(100.0);
}

torch::Tensor ssim_per_image(const torch::Tensor& a, const torch::Tensor& b) {
  if (a.dim() != 4 || a.sizes() != b.sizes() || a.size(1) != 1 || a.size(2) < 11 || a.size(3) < 11)
    throw std::invalid_argument(fmt::format("ssim: images must be equal [B, 1, H, W] with H, W >= 11, got {} and {}",
                                            c10::str(a.sizes()), c10::str(b.sizes())));
  auto x = a.to(torch::kFloat64), y = b.to(torch::kFloat64);
  auto g = torch::arange(11, torch::kFloat64) - 5;
  g = torch::exp(-g.pow(2) / (2 * 1.5 * 1.5));
  g = g / g.sum();
  auto w = torch::outer(g, g).view({1, 1, 11, 11});  // Gaussian window, sums to 1
  auto blur = [&](const torch::Tensor& t) { return torch::conv2d(t, w); };  // [B, 1, H - 10, W - 10]
  const double c1 = 0.01 * 0.01, c2 = 0.03 * 0.03;
  auto mx = blur(x), my = blur(y);
  auto vx = blur(x * x) - mx * mx, vy = blur(y * y) - my * my, cxy = blur(x * y) - mx * my;
  auto map = ((2 * mx * my + c1) * (2 * cxy + c2)) / ((mx * mx + my * my + c1) * (vx + vy + c2));
  return map.flatten(1).mean(1);
}

double mean_pairwise_l1(const torch::Tensor& samples) {
  const int64_t K = samples.size(0);
  if (K < 2) throw std::invalid_argument("mean_pairwise_l1: need at least two samples");
  auto flat = samples.flatten(1).to(torch::kFloat64);  // [K, P]
  double sum = 0;
  for (int64_t i = 0; i < K; ++i)
    for (int64_t j = i + 1; j < K; ++j) sum += (flat[i] - flat[j]).abs().mean().item<double>();
  return sum / static_cast<double>(K * (K - 1) / 2);
}

torch::Tensor eval_noise(uint64_t seed, int64_t first, int64_t count, int64_t z_dim) {
  auto z = torch::zeros({count, z_dim});
  if (z_dim == 0) return z;
  for (int64_t k = 0; k < count; ++k) {
    auto gen = train::seeded_stream(seed, 3, static_cast<uint64_t>(first + k));
    z[k].copy_(torch::randn({z_dim}, gen));
  }
  return z;
}

namespace {

torch::Tensor to_unit(const torch::Tensor& t) { return ((t + 1) / 2).clamp(0, 1); }  // [-1, 1] -> [0, 1]

// The diversity noise: its own stream so that it never coincides with the evaluation's z.
constexpr uint64_t kDiversitySalt = 0xD1CE;

}  // namespace

Pix2pixEval evaluate_pix2pix(models::Pix2pix& model, const data::LabelMaps& set, int64_t count, int64_t batch_size,
                             uint64_t eval_seed, int64_t diversity_maps, int64_t diversity_samples) {
  const auto t0 = std::chrono::steady_clock::now();
  torch::NoGradGuard no_grad;
  const int64_t Z = model->config.z_dim;
  Pix2pixEval r;
  double l1 = 0, psnr = 0, ssim = 0;
  for (int64_t start = 0; start < count; start += batch_size) {
    const int64_t len = std::min(batch_size, count - start);
    auto b = set.generate(start, len);
    auto fake = to_unit(model->generate(b.one_hot, eval_noise(eval_seed, start, len, Z)));  // [len, 1, S, S]
    auto real = to_unit(b.images);
    l1 += l1_per_image(fake, real).sum().item<double>();
    psnr += psnr_per_image(fake, real).sum().item<double>();
    ssim += ssim_per_image(fake, real).sum().item<double>();
  }
  double diversity = 0;
  for (int64_t i = 0; i < diversity_maps; ++i) {
    auto b = set.generate(i, 1);
    auto labels = b.one_hot.expand({diversity_samples, -1, -1, -1});
    auto z = eval_noise(eval_seed ^ kDiversitySalt, i * diversity_samples, diversity_samples, Z);
    diversity += mean_pairwise_l1(to_unit(model->generate(labels, z)));
  }
  r.examples = count;
  r.l1 = l1 / static_cast<double>(count);
  r.psnr = psnr / static_cast<double>(count);
  r.ssim = ssim / static_cast<double>(count);
  r.diversity = diversity_maps > 0 ? diversity / static_cast<double>(diversity_maps) : 0.0;
  r.seconds = train::seconds_since(t0);
  return r;
}

torch::Tensor classify_resized(models::CapsNet& classifier, const torch::Tensor& images01) {
  const int64_t size = classifier->config.image_size;
  auto x = images01;  // [B, 1, H, W]
  if (x.size(2) != size || x.size(3) != size)
    x = torch::nn::functional::interpolate(x, torch::nn::functional::InterpolateFuncOptions()
                                                  .size(std::vector<int64_t>{size, size})
                                                  .mode(torch::kBilinear)
                                                  .align_corners(false));
  return classifier->forward(x.clamp(0, 1)).lengths.argmax(1);  // lengths: [B, K]
}

LabelConsistency label_consistency(models::Pix2pix& model, models::CapsNet& classifier, const data::LabelMaps& set,
                                   int64_t count, int64_t batch_size, uint64_t eval_seed) {
  if (count < 1 || batch_size < 1) throw std::invalid_argument("label_consistency: count and batch_size must be >= 1");
  if (classifier->config.image_channels != 1)
    throw std::invalid_argument(fmt::format("label consistency: the classifier takes {} channels; the images have 1",
                                            classifier->config.image_channels));
  torch::NoGradGuard no_grad;
  const bool was_training = classifier->is_training();
  classifier->eval();
  const int64_t Z = model->config.z_dim;
  int64_t generated = 0, real = 0;
  for (int64_t start = 0; start < count; start += batch_size) {
    const int64_t len = std::min(batch_size, count - start);
    auto b = set.generate(start, len);
    const int64_t max_label = b.labels.max().item<int64_t>();
    if (max_label >= classifier->config.num_classes)
      throw std::invalid_argument(fmt::format("label consistency: the classifier has {} classes, the maps' labels go up to {}",
                                              classifier->config.num_classes, max_label));
    auto fake = to_unit(model->generate(b.one_hot, eval_noise(eval_seed, start, len, Z)));  // [len, 1, S, S]
    generated += classify_resized(classifier, fake).eq(b.labels).sum().item<int64_t>();
    real += classify_resized(classifier, to_unit(b.images)).eq(b.labels).sum().item<int64_t>();
  }
  classifier->train(was_training);
  return {count, static_cast<double>(generated) / static_cast<double>(count),
          static_cast<double>(real) / static_cast<double>(count)};
}

std::unique_ptr<torch::optim::Adam> make_pix2pix_optimizer(models::Pix2pix& model, double lr, double beta1) {
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(model->generator_parameters());
  groups.emplace_back(model->discriminator_parameters());
  return kernels::make_adam(std::move(groups), torch::optim::AdamOptions(lr).betas({beta1, 0.999}));
}

torch::Tensor mode_seeking_ratio(const torch::Tensor& a, const torch::Tensor& b, const torch::Tensor& z_a,
                                 const torch::Tensor& z_b) {
  return (a - b).abs().mean() / (z_a - z_b).abs().mean();
}

models::Pix2pixLosses pix2pix_step(models::Pix2pix& model, torch::optim::Optimizer& optimizer,
                                   const torch::Tensor& labels, const torch::Tensor& real, const torch::Tensor& z,
                                   double mode_seeking, torch::Tensor* ratio) {
  // Adam skips parameters whose gradient is undefined (clear_grads; a zero gradient would still move them
  // through the moments): clearing all, then backpropagating one network's loss, updates that network only.
  const auto all = model->parameters();
  auto fake = model->generate(labels, z);  // [B, 1, S, S]

  train::clear_grads(all);
  auto d_loss = model->discriminator_loss(labels, real, fake);
  d_loss.backward();  // reaches D only: fake is detached inside
  optimizer.step();

  train::clear_grads(all);
  auto g = model->generator_losses(labels, real, fake);
  auto g_loss = g.generator;
  if (mode_seeking > 0) {
    if (z.size(0) < 2) throw std::invalid_argument("capspix2pix: the mode-seeking term needs >= 2 maps per batch");
    const auto z2 = z.roll(1, 0);  // [B, Z]: each map with another example's noise
    const auto r = mode_seeking_ratio(fake.to(torch::kFloat32), model->generate(labels, z2).to(torch::kFloat32), z, z2);
    g_loss = g_loss + mode_seeking / (r + 1e-5);
    if (ratio) *ratio = r.detach();
  }
  g_loss.backward();
  train::clear_grads(model->discriminator_parameters());  // D's gradient of G's loss is not D's to follow
  optimizer.step();
  train::clear_grads(all);

  models::Pix2pixLosses out;
  out.discriminator = d_loss.detach();
  out.generator_gan = g.generator_gan.detach();
  out.l1 = g.l1.detach();
  out.generator = g.generator.detach();
  return out;
}

namespace {

/// The conditional GAN as a train::Task: a stream of generated maps (step s uses maps [s B, (s + 1) B)),
/// z drawn from the step's own generator (so a resume replays it), a D then a G update per step.
class Pix2pixTask : public train::Task {
 public:
  Pix2pixTask(const Pix2pixTrainOptions& o, const data::LabelMaps& train_set, const data::LabelMaps& test_set,
              const data::LabelMaps* validation)
      : o_(o), train_(train_set), test_(test_set), val_(validation) {}

  std::string name() const override { return "capspix2pix"; }
  std::shared_ptr<torch::nn::Module> build_model(Precision precision) override {
    model_ = models::Pix2pix(o_.model);
    if (model_->caps) model_->caps->set_fused_routing(o_.fused_routing);
    model_->set_precision(precision);
    return model_.ptr();
  }
  nlohmann::json model_config() const override { return o_.model.to_json(); }
  bool config_matches(const nlohmann::json& saved) const override {
    try {
      return models::Pix2pixConfig::from_json(saved).to_json() == o_.model.to_json();
    } catch (const std::invalid_argument&) {
      return false;
    }
  }
  nlohmann::json data_config() const override {
    nlohmann::json j = {{"map_size", train_.size()},
                        {"object_threshold", train_.options().object_threshold},
                        {"flip", train_.options().flip},
                        {"beta1", o_.beta1},
                        // Always written: the resume check compares keys present in both (older checkpoints
                        // lack it), so a run with the term cannot continue as one without it or vice versa.
                        {"mode_seeking", o_.mode_seeking},
                        {"val", o_.validation_size}};
    return j;
  }
  std::string describe() const override {
    return fmt::format("capspix2pix, {} generator ({} parameters) + PatchGAN discriminator ({} parameters)",
                       o_.model.generator, count(model_->generator_parameters()),
                       count(model_->discriminator_parameters()));
  }
  int64_t epoch_size() const override { return o_.loop.max_steps * o_.loop.batch_size; }
  bool shuffle() const override { return false; }
  train::Batch batch(const torch::Tensor& ids, at::Generator& gen) const override {
    auto b = train_.generate(ids[0].item<int64_t>(), ids.size(0));
    auto z = torch::randn({ids.size(0), o_.model.z_dim}, gen);
    return {{b.one_hot, b.images, z}};  // [B, K, S, S], [B, 1, S, S], [B, Z]
  }
  std::unique_ptr<torch::optim::Optimizer> make_optimizer(torch::nn::Module&, const train::LoopOptions& l) override {
    return make_pix2pix_optimizer(model_, l.lr, o_.beta1);
  }
  bool steps_itself() const override { return true; }
  train::TaskLoss train_step(const train::Batch& rows, torch::optim::Optimizer& optimizer) override {
    torch::Tensor ratio;
    auto l = pix2pix_step(model_, optimizer, rows[0], rows[1], rows[2], o_.mode_seeking, &ratio);
    train::TaskLoss out{l.generator, {{"d_loss", l.discriminator}, {"g_gan", l.generator_gan}, {"l1", l.l1}}};
    if (ratio.defined()) out.scalars.emplace_back("mode_seeking_ratio", ratio);
    return out;
  }
  train::TaskLoss loss(const train::Batch& rows) override {  // the generator's objective, no update
    auto fake = model_->generate(rows[0], rows[2]);
    auto l = model_->generator_losses(rows[0], rows[1], fake);
    return {l.generator, {{"g_gan", l.generator_gan.detach()}, {"l1", l.l1.detach()}}};
  }
  std::optional<train::Evaluation> evaluate(std::ostream*) override {
    last_ = evaluate_pix2pix(model_, test_, o_.test_size, o_.eval_batch_size, o_.eval_seed, o_.diversity_maps,
                             o_.diversity_samples);
    return train::Evaluation{{{"l1", last_.l1},
                       {"psnr", last_.psnr},
                       {"ssim", last_.ssim},
                       {"diversity", last_.diversity},
                       {"examples", last_.examples},
                       {"seconds", last_.seconds}},
                      fmt::format("test L1 {:.4f} PSNR {:.2f} dB SSIM {:.3f} diversity {:.4f} ({} maps)", last_.l1,
                                  last_.psnr, last_.ssim, last_.diversity, last_.examples)};
  }

  // The validation L1 is the record's "loss": the loop keeps the lowest as best.pt. No diversity (it
  // does not choose anything here).
  std::optional<train::Evaluation> evaluate_validation(std::ostream*) override {
    if (o_.validation_size == 0) return std::nullopt;
    const auto v = evaluate_pix2pix(model_, *val_, o_.validation_size, o_.eval_batch_size, o_.eval_seed, 0, 2);
    return train::Evaluation{{{"loss", v.l1},
                              {"l1", v.l1},
                              {"psnr", v.psnr},
                              {"ssim", v.ssim},
                              {"examples", v.examples},
                              {"seconds", v.seconds}},
                             fmt::format("validation L1 {:.4f} ({} maps)", v.l1, v.examples)};
  }

  models::Pix2pix model_{nullptr};
  Pix2pixEval last_;

 private:
  static int64_t count(const std::vector<torch::Tensor>& ps) {
    int64_t n = 0;
    for (const auto& p : ps) n += p.numel();
    return n;
  }
  const Pix2pixTrainOptions& o_;
  const data::LabelMaps& train_;
  const data::LabelMaps& test_;
  const data::LabelMaps* val_;
};

}  // namespace

Pix2pixTrainResult train_pix2pix(const Pix2pixTrainOptions& options, const data::LabelMaps& train_set,
                                 const data::LabelMaps& test_set, std::ostream& log,
                                 const data::LabelMaps* validation) {
  options.validate();
  if (options.validation_size > 0 && !validation)
    throw std::invalid_argument("capspix2pix: validation_size > 0 needs a validation set");
  for (const auto* set : {&train_set, &test_set, validation})
    if (set && set->size() != options.model.image_size)
      throw std::invalid_argument(fmt::format("capspix2pix: the map size ({}) must equal the model image_size ({})",
                                              set->size(), options.model.image_size));
  Pix2pixTask task(options, train_set, test_set, validation);
  auto r = train::run(task, options.loop, log);
  const auto score = [&](models::Pix2pix& m) {
    return evaluate_pix2pix(m, test_set, options.test_size, options.eval_batch_size, options.eval_seed,
                            options.diversity_maps, options.diversity_samples);
  };
  const auto best = train::best_checkpoint_path(options.loop.out_dir);
  if (options.validation_size > 0 && r.best_validation_loss && std::filesystem::exists(best)) {
    // Every choice on validation: the test maps score the best-validation checkpoint.
    auto model = load_pix2pix(best);
    if (model->caps) model->caps->set_fused_routing(options.fused_routing);
    model->set_precision(options.loop.precision);
    auto test = score(model);
    const int64_t step = r.best_validation_step;
    const double l1 = *r.best_validation_loss;
    return Pix2pixTrainResult{train::RunStats::of(r), model, std::move(test), best, step, l1};
  }
  // A resume of a finished run trains no step and so never evaluates: do it here.
  auto test = r.evaluation ? task.last_ : score(task.model_);
  auto checkpoint = r.checkpoint;
  return Pix2pixTrainResult{train::RunStats::of(r), task.model_, std::move(test), checkpoint, 0, std::nullopt};
}

models::Pix2pix load_pix2pix(const std::string& checkpoint) {
  auto meta = train::read_checkpoint_meta(checkpoint);
  models::Pix2pix model(models::Pix2pixConfig::from_json(meta.model_config));
  train::load_checkpoint(checkpoint, *model, nullptr, [&](const nlohmann::json& saved) {
    return models::Pix2pixConfig::from_json(saved).to_json() == model->config.to_json();
  });
  return model;
}

torch::Tensor label_map_image(const torch::Tensor& maps) {
  return maps.to(torch::kFloat) / static_cast<float>(data::kLabelClasses - 1);
}

namespace {

torch::Tensor zoomed(const torch::Tensor& t, int64_t zoom) {  // [S, S] -> [S z, S z], nearest
  return t.to(torch::kFloat).repeat_interleave(zoom, 0).repeat_interleave(zoom, 1);
}

void check_figure(const std::vector<models::Pix2pix>& models, int64_t count, int64_t zoom, const char* who) {
  if (models.empty() || count < 1 || zoom < 1)
    throw std::invalid_argument(fmt::format("{}: need at least one model, a positive count and zoom", who));
}

}  // namespace

torch::Tensor pix2pix_comparison_figure(std::vector<models::Pix2pix> models, const data::LabelMaps& set, int64_t first,
                                        int64_t rows, uint64_t eval_seed, int64_t zoom) {
  check_figure(models, rows, zoom, "pix2pix_comparison_figure");
  torch::NoGradGuard no_grad;
  auto b = set.generate(first, rows);
  std::vector<torch::Tensor> outputs;  // per model: [rows, 1, S, S] in [0, 1]
  for (auto& m : models)
    outputs.push_back(to_unit(m->generate(b.one_hot, eval_noise(eval_seed, first, rows, m->config.z_dim))));
  std::vector<torch::Tensor> tiles;
  auto maps = label_map_image(b.maps), real = to_unit(b.images);
  for (int64_t i = 0; i < rows; ++i) {
    tiles.push_back(zoomed(maps[i][0], zoom));
    for (const auto& o : outputs) tiles.push_back(zoomed(o[i][0], zoom));
    tiles.push_back(zoomed(real[i][0], zoom));
  }
  return viz::tile(tiles, static_cast<int64_t>(models.size()) + 2);
}

torch::Tensor pix2pix_variations_figure(std::vector<models::Pix2pix> models, const data::LabelMaps& set,
                                        int64_t index, int64_t samples, uint64_t eval_seed, int64_t zoom) {
  check_figure(models, samples, zoom, "pix2pix_variations_figure");
  torch::NoGradGuard no_grad;
  auto b = set.generate(index, 1);
  std::vector<torch::Tensor> tiles;
  for (auto& m : models) {
    auto z = eval_noise(eval_seed ^ kDiversitySalt, index * samples, samples, m->config.z_dim);
    auto out = to_unit(m->generate(b.one_hot.expand({samples, -1, -1, -1}), z));  // [samples, 1, S, S]
    tiles.push_back(zoomed(label_map_image(b.maps)[0][0], zoom));
    for (int64_t k = 0; k < samples; ++k) tiles.push_back(zoomed(out[k][0], zoom));
  }
  return viz::tile(tiles, samples + 1);
}

torch::Tensor pix2pix_interpolation_figure(std::vector<models::Pix2pix> models, const data::LabelMaps& set,
                                           int64_t index, int64_t steps, uint64_t eval_seed, int64_t zoom) {
  check_figure(models, steps, zoom, "pix2pix_interpolation_figure");
  if (steps < 2) throw std::invalid_argument("pix2pix_interpolation_figure: need at least 2 steps");
  torch::NoGradGuard no_grad;
  auto b = set.generate(index, 1);
  std::vector<torch::Tensor> tiles;
  for (auto& m : models) {
    auto ends = eval_noise(eval_seed ^ kDiversitySalt, index * 1000003, 2, m->config.z_dim);  // z1, z2: [2, Z]
    auto t = torch::linspace(0, 1, steps).view({steps, 1});
    auto z = (1 - t) * ends[0] + t * ends[1];  // [steps, Z]
    auto out = to_unit(m->generate(b.one_hot.expand({steps, -1, -1, -1}), z));
    tiles.push_back(zoomed(label_map_image(b.maps)[0][0], zoom));
    for (int64_t k = 0; k < steps; ++k) tiles.push_back(zoomed(out[k][0], zoom));
  }
  return viz::tile(tiles, steps + 1);
}

}  // namespace capsnet::experiments
