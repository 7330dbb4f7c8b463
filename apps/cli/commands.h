#pragma once
// Each subcommand registers its flags on the root app and returns how to run it once parsed.

#include <CLI/CLI.hpp>

#include "capsnet/data/image_folder.h"
#include "capsnet/kernels/precision.h"

#include <functional>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

namespace capsnet::apps::cli {

struct Subcommand {
  CLI::App* app = nullptr;
  std::function<int()> run;  // exit status
};

Subcommand add_train(CLI::App& root);
Subcommand add_eval(CLI::App& root);
Subcommand add_predict(CLI::App& root);
Subcommand add_reconstruct(CLI::App& root);
Subcommand add_perturb(CLI::App& root);
Subcommand add_bench(CLI::App& root);
Subcommand add_ablation(CLI::App& root);
Subcommand add_report(CLI::App& root);
Subcommand add_multimnist(CLI::App& root);
Subcommand add_affine(CLI::App& root);
Subcommand add_export(CLI::App& root);
Subcommand add_serve(CLI::App& root);
Subcommand add_segcaps(CLI::App& root);
Subcommand add_stn(CLI::App& root);
Subcommand add_em(CLI::App& root);
Subcommand add_capspix2pix(CLI::App& root);
Subcommand add_folder(CLI::App& root);

/// Flags shared by the subcommands that compute: --threads.
void add_threads_flag(CLI::App& app, int& threads);

/// --precision fp32|bf16|auto (compute type of the convolutions and the decoder; docs/kernels.md).
void add_precision_flag(CLI::App& app, std::string& precision);
/// The same flag with the default auto, for the training commands.
void add_training_precision_flag(CLI::App& app, std::string& precision);
/// One line on stderr when auto falls back to fp32 on a CPU without native bf16.
Precision precision_from_flag(const std::string& precision);

/// Attaches the documented range of every numeric flag (cli/limits.cpp) to the commands of `app`;
/// std::logic_error when a numeric flag has none (a developer's omission, caught by any test run).
void apply_numeric_limits(CLI::App& app);
/// The ranges as a Markdown table (docs/reliability.md).
std::string numeric_limits_markdown();

/// --overwrite: lets a command replace the previous run in its --out folder.
void add_overwrite_flag(CLI::App& app, bool& overwrite);
/// Refuses an --out folder that holds a previous run (a non-empty file of `run_files`: by default a
/// checkpoint.pt or metrics.jsonl) unless the command resumes that run (`resume_from` is the folder's own
/// checkpoint.pt) or --overwrite was given; the message names the ways out. Resuming another run into
/// such a folder is refused too: it would replace the folder's run.
void check_run_dir(const std::string& out_dir, const std::string& resume_from, bool overwrite, bool can_resume,
                   const std::vector<std::string>& run_files = {"checkpoint.pt", "metrics.jsonl"});
/// Refuses an output path that is one of the command's input files (e.g. --out = --checkpoint).
void check_not_an_input(const std::string& out, const std::vector<std::string>& inputs);

/// Checks `file` against the SHA256SUMS file beside it (sha256sum's format); throws std::invalid_argument
/// naming both hashes when they differ, or when SHA256SUMS is missing or does not list the file.
void check_sha256sums(const std::string& file);

/// Writes `text` to `path` (replacing it); throws std::runtime_error naming the path when it cannot
/// be opened or written, so that no command reports a result file it failed to write.
void write_text_file(const std::string& path, const std::string& text);

/// The trained MNIST model shipped in the repository, relative to the checkout (model card beside it).
inline constexpr const char* kShippedModel = "models/capsnet-mnist/capsnet-mnist.pt";
/// Absolute path of the shipped model (next to the executable's checkout, else the source tree it was
/// built from); std::invalid_argument when it is not there.
std::string shipped_model_path();
/// `checkpoint` if given; else the shipped model, saying so on stderr (one line with its model card).
std::string checkpoint_or_shipped(const std::string& checkpoint);

/// Which image set a command reads: --dataset mnist|fashion-mnist picks the default directory,
/// --data DIR overrides it. Both sets are the same four IDX files (plain or .gz). `train` and `eval`
/// also read image folders (data/image_folder.h) and take the --image-* flags.
struct DataFlags {
  std::string dataset = "mnist";
  std::string dir;  // empty: the dataset's default directory
  data::ImageFolderOptions folder;
  std::string fit = "resize";
  /// The directory to read: --data if given, else the dataset's default (data/mnist or
  /// /usr/share/datasets/fashion-mnist).
  std::string resolved() const;
  /// Whether --data names an image folder rather than IDX files.
  bool is_folder() const;
};

/// Registers --dataset and --data on `app`, writing into `flags`.
void add_data_flags(CLI::App& app, DataFlags& flags);
/// Registers the image-folder flags (--image-size, --image-fit, --test-fraction, --split-seed,
/// --skip-unreadable). `training`: --image-size picks the model's input side (else the model's own).
void add_image_folder_flags(CLI::App& app, DataFlags& flags, bool training);

/// The splits a command asked for, from IDX files or an image folder.
struct LabelledData {
  std::optional<data::ImageSet> train, test;
  std::vector<std::string> class_names;  // image folder: its directories; IDX: class_names(dataset)
  bool folder = false;
  int64_t channels = 1, side = 28;
};

/// Loads the requested splits (limits applied: 0 = all). An image folder is decoded once (both splits,
/// in parallel) at `image_size` (0 = the images' own), a line describing it going to `log`.
LabelledData load_labelled_data(const DataFlags& flags, bool train, bool test, int64_t train_limit,
                                int64_t test_limit, std::ostream& log);

}  // namespace capsnet::apps::cli
