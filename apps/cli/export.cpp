#include <fmt/format.h>

#include <fstream>
#include <iostream>
#include <memory>

#include "capsnet/train/json_input.h"
#include "capsnet/train/export.h"
#include "apps/runtime.h"
#include "apps/cli/commands.h"

namespace capsnet::apps::cli {

Subcommand add_export(CLI::App& root) {
  struct Flags {
    std::string checkpoint, out;
    int64_t probe = 0;
    uint64_t probe_seed = 0;
    std::string storage = "fp32", card;
    int threads = 0;
  };
  auto f = std::make_shared<Flags>();
  auto* app = root.add_subcommand(
      "export", "Export a checkpoint's weights and config for Python (torch::pickle_save, read by torch.load)");
  app->add_option("--checkpoint", f->checkpoint, "Checkpoint to export (default: the shipped MNIST model, " + std::string(kShippedModel) + ")");
  app->add_option("--out", f->out, "Weight file to write (atomically), e.g. weights.pt")->required();
  app->add_option("--probe", f->probe,
                  "Also store N seeded noise images with the C++ model's outputs (to check a port)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app->add_option("--probe-seed", f->probe_seed, "Seed of the probe images")->capture_default_str();
  app->add_option("--storage", f->storage,
                  "Tensor storage type: fp32, or fp16 / bf16 (half the size; the model still computes in fp32)")
      ->check(CLI::IsMember({"fp32", "fp16", "bf16"}))
      ->capture_default_str();
  app->add_option("--card", f->card, "JSON file stored in the weights as the model card")->check(CLI::ExistingFile);
  add_threads_flag(*app, f->threads);

  return {app, [f]() {
            f->checkpoint = checkpoint_or_shipped(f->checkpoint);
            check_not_an_input(f->out, {f->checkpoint, f->card});  // before anything is opened for writing
            if (f->threads > 0) set_threads(f->threads);
            train::ExportOptions o;
            o.probe = f->probe;
            o.probe_seed = f->probe_seed;
            o.storage = train::parse_weight_storage(f->storage);
            if (!f->card.empty()) {
              o.card = train::read_json_file(f->card);  // "PATH: not JSON (...)", or nested too deep
            }
            auto s = train::export_checkpoint(f->checkpoint, f->out, o);
            std::cout << fmt::format("exported {} (step {}): {} tensors, {} parameters, {} storage{} -> {} ({:.1f} MB)\n",
                                     f->checkpoint, s.step, s.tensors, s.parameters, f->storage,
                                     f->probe > 0 ? fmt::format(", probe of {} images", f->probe) : "", f->out,
                                     s.bytes / 1e6);
            return 0;
          }};
}

}  // namespace capsnet::apps::cli
