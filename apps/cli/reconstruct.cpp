#include <fmt/format.h>

#include <iostream>
#include <memory>

#include "capsnet/data/mnist.h"
#include "capsnet/data/transforms.h"
#include "capsnet/train/checkpoint.h"
#include "apps/runtime.h"
#include "capsnet/viz/figures.h"
#include "capsnet/viz/png.h"
#include "apps/cli/commands.h"

namespace capsnet::apps::cli {

Subcommand add_reconstruct(CLI::App& root) {
  struct Flags {
    DataFlags data;
    std::string checkpoint, out = "runs/mnist/reconstructions.png";
    int64_t correct = 12, wrong = 6;
    int threads = 0;
    std::string precision = "fp32";
  };
  auto f = std::make_shared<Flags>();
  auto* app = root.add_subcommand(
      "reconstruct", "Figure of (label, prediction, reconstructed-from) panels: test digits and their reconstructions");
  app->add_option("--checkpoint", f->checkpoint, "Trained checkpoint (with a decoder) (default: the shipped MNIST model, " + std::string(kShippedModel) + ")");
  add_data_flags(*app, f->data);
  app->add_option("--out", f->out, "PNG to write")->capture_default_str();
  app->add_option("--correct", f->correct, "Correctly classified digits to show")
      ->check(CLI::Range(0, 1000))
      ->capture_default_str();
  app->add_option("--wrong", f->wrong, "Misclassified digits to show (each reconstructed from l and from p)")
      ->check(CLI::Range(0, 1000))
      ->capture_default_str();
  add_threads_flag(*app, f->threads);
  add_precision_flag(*app, f->precision);

  return {app, [f]() {
            f->checkpoint = checkpoint_or_shipped(f->checkpoint);
            check_not_an_input(f->out, {f->checkpoint, data::mnist_images_path(f->data.resolved(), data::Split::kTest),
                                        data::mnist_labels_path(f->data.resolved(), data::Split::kTest)});
            if (f->threads > 0) set_threads(f->threads);
            if (f->correct + f->wrong == 0) throw std::invalid_argument("nothing to show: --correct and --wrong are 0");
            auto model = train::load_model(f->checkpoint);
            model->set_precision(precision_from_flag(f->precision));
            if (!model->config.reconstruction)
              throw std::invalid_argument(f->checkpoint + ": this model was trained without a decoder");
            auto set = data::load_mnist(f->data.resolved(), data::Split::kTest);
            torch::NoGradGuard no_grad;
            std::vector<torch::Tensor> panels;
            std::vector<std::string> captions;
            int64_t n_correct = 0, n_wrong = 0;
            const int64_t side = model->config.image_size;
            for (int64_t start = 0; start < set.size() && (n_correct < f->correct || n_wrong < f->wrong);
                 start += 250) {
              const int64_t len = std::min<int64_t>(250, set.size() - start);
              auto images = data::to_float(set.images.narrow(0, start, len));  // [len, 1, 28, 28]
              auto labels = set.labels.narrow(0, start, len);
              auto out = model(images);
              auto pred = out.lengths.argmax(1);
              for (int64_t k = 0; k < len; ++k) {
                const int64_t l = labels[k].item<int64_t>(), p = pred[k].item<int64_t>();
                const bool right = l == p;
                if (right ? n_correct >= f->correct : n_wrong >= f->wrong) continue;
                (right ? n_correct : n_wrong)++;
                std::vector<int64_t> sources = right ? std::vector<int64_t>{p} : std::vector<int64_t>{l, p};
                for (int64_t r : sources) {
                  auto rec = model->decode(out.digit_caps.narrow(0, k, 1), torch::full({1}, r, torch::kLong));
                  panels.push_back(viz::reconstruction_panel(images[k][0], rec.view({side, side}), l, p, r));
                  captions.push_back(fmt::format("test[{}] (l,p,r)=({},{},{})", start + k, l, p, r));
                }
              }
            }
            auto figure = viz::tile(panels, 9, 4, 0.25f);
            viz::write_png_gray(f->out, figure);
            for (const auto& c : captions) std::cout << c << '\n';
            std::cout << fmt::format("wrote {} ({} correct, {} misclassified; {}x{} px)\n", f->out, n_correct,
                                     n_wrong, figure.size(1), figure.size(0));
            return 0;
          }};
}

}  // namespace capsnet::apps::cli
