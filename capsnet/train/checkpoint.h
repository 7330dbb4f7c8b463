#pragma once
// Checkpoints: model + optimizer + RNG + step + configs in one torch archive, written atomically
// (temp file, fsync, rename) so a crash mid-write never replaces the last good checkpoint.
// Format version 3: the archive (meta, model, optimizer, generator, weight average) streamed to the file,
// then a 20-byte trailer holding its size and CRC-32; every read checks both, so no byte of the file is
// trusted unchecked, and a save holds no copy of the tensors. Versions 2 (a CRC-checked payload archive
// inside an outer one) and 1 (no checksum) still load.

#include <torch/torch.h>

#include <nlohmann/json.hpp>
#include <stdexcept>
#include <functional>
#include <string>
#include <variant>
#include <vector>

#include "capsnet/kernels/precision.h"
#include "capsnet/models/baseline_cnn.h"
#include "capsnet/models/capsnet.h"
#include "capsnet/models/matrix_capsnet.h"
#include "capsnet/train/weight_average.h"

namespace capsnet::train {

/// Thrown for unreadable, corrupt, truncated or incompatible checkpoints; what() names the file.
class CheckpointError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct CheckpointMeta {
  int64_t step = 0;              // optimizer steps taken
  nlohmann::json model_config;   // CapsNetConfig::to_json()
  nlohmann::json train_options;  // what produced it (informational; used to check a resume)
};

/// Writes model, optimizer state (when given), the default CPU generator state, meta and (when not empty) a
/// weight average (weight_average.h) to `path`.
void save_checkpoint(const std::string& path, torch::nn::Module& model, torch::optim::Optimizer* optimizer,
                     const CheckpointMeta& meta, const NamedTensors& weight_average = {});
void save_checkpoint(const std::string& path, models::CapsNet& model, torch::optim::Optimizer* optimizer,
                     const CheckpointMeta& meta);

/// Reads the meta of a checkpoint, checked like a full load (CheckpointError "checkpoint PATH: corrupt (...)"
/// for a damaged file, "negative step" for a crafted one).
CheckpointMeta read_checkpoint_meta(const std::string& path);

/// Whether `path` ends in a version-3 checkpoint's trailer (its last 20 bytes are read; nothing is checked):
/// a training checkpoint, not a weight file, so that readers trying both need not read the whole file to
/// tell. False for a missing, unreadable or short file, and for anything not a regular file (never opened).
bool has_checkpoint_trailer(const std::string& path);

/// Restores model weights, optimizer state (when given) and the generator state; returns the meta.
/// The model must have been built with the checkpoint's model config.
CheckpointMeta load_checkpoint(const std::string& path, models::CapsNet& model, torch::optim::Optimizer* optimizer);
/// Any module: `config_matches` says whether the stored model config describes `model` (CheckpointError if not).
/// With `weight_average`, a stored average of the same count and shapes is copied into its tensors and
/// `*average_found` says whether the file had one (CheckpointError when it has one that does not fit).
CheckpointMeta load_checkpoint(const std::string& path, torch::nn::Module& model, torch::optim::Optimizer* optimizer,
                               const std::function<bool(const nlohmann::json&)>& config_matches,
                               NamedTensors* weight_average = nullptr, bool* average_found = nullptr);

/// Writes `bytes` to `path` atomically: a temp file `<path>.tmp.<pid>` (parent directories created), write,
/// fsync, rename, fsync of the directory, so readers see the old or the new file, never a partial one.
/// Temp files of writers that died before their rename (`<path>.tmp.<pid>` whose process is gone) are
/// removed first. Shared by checkpoints and weight files (export.h). On failure (full disk, I/O error)
/// the temp file is removed, the previous file is unchanged, and std::runtime_error says what failed
/// (without the path: callers prefix it, e.g. "checkpoint PATH: write failed after N of M bytes: ...").
void write_file_atomically(const std::string& path, const std::vector<char>& bytes);
/// What write_file_atomically's producer writes through: (data, n), as many times as it likes.
using ByteSink = std::function<void(const void*, size_t)>;
/// The same, streamed: `produce` writes the file's bytes through the sink it is given (none held in memory).
/// A write error stops the writing (later bytes are only counted) and is thrown after `produce` returns; an
/// exception from `produce` removes the temp file and propagates.
void write_file_atomically(const std::string& path, const std::function<void(const ByteSink&)>& produce);

/// What a trained model expects of its inputs beyond its config, for predict / eval / serve.
struct InputSpec {
  /// Label i's name: a training image folder's class directories, an IDX dataset's names (MNIST digits,
  /// Fashion-MNIST clothes), else "0".."K-1".
  std::vector<std::string> class_names;
  std::string image_fit = "resize";  // how images of another size are brought to the model's (image_file.h)
  std::string dataset;               // "mnist", "fashion-mnist", "image-folder" or "" (not recorded)
  /// Image folders without train/ and test/: the split the model was trained with (eval's test split).
  double test_fraction = 0.1;
  uint64_t split_seed = 0;
};

/// The input spec of a checkpoint (its training options) or of a weight file (its model card):
/// keys "classes", "image_fit", "dataset", "test_fraction", "split_seed"; what is missing gets the defaults above.
InputSpec read_input_spec(const std::string& path);

/// Builds the model described by the checkpoint and loads its weights (for eval / predict).
/// Also accepts a weight file written by save_weights (export.h), e.g. the shipped model.
/// A file holding another network (capsnet em's matrix capsules, the baseline CNN): CheckpointError / ExportError
/// saying which commands take it.
models::CapsNet load_model(const std::string& path);

/// Which network a checkpoint or weight file holds: "capsnet", "matrix-capsnet" or "baseline-cnn" (export.h's
/// kCapsNetModel, kMatrixCapsNetModel, kBaselineCnnModel). A checkpoint's is its training task ("em" ->
/// matrix-capsnet) or its model config (a BaselineCnnConfig -> baseline-cnn); CheckpointError / ExportError
/// for a file that is neither checkpoint nor weight file.
std::string stored_model(const std::string& path);
/// The same for a checkpoint whose meta was already read.
std::string checkpoint_model(const CheckpointMeta& meta);

/// The matrix-capsule network (EM routing) of a `capsnet em` checkpoint or a matrix-capsnet weight file,
/// weights loaded, eval mode, fp32. CheckpointError / ExportError naming the file otherwise.
models::MatrixCapsNet load_matrix_model(const std::string& path);

/// The baseline CNN (with its spatial transformer, if any) of a `capsnet affine` / `capsnet stn` checkpoint
/// or a baseline-cnn weight file, weights loaded, eval mode, fp32. CheckpointError / ExportError otherwise.
models::BaselineCnn load_baseline_cnn(const std::string& path);

/// Whichever network a checkpoint or weight file holds, weights loaded, eval mode, with what it expects of
/// its inputs: what eval and predict need, the weight file read once.
struct LoadedModel {
  std::string kind;  // kCapsNetModel, kMatrixCapsNetModel or kBaselineCnnModel (export.h)
  std::variant<models::CapsNet, models::MatrixCapsNet, models::BaselineCnn> network;
  InputSpec spec;
  int64_t step = 0;  // optimizer steps the weights had when saved
  /// A checkpoint's training options; a weight file's card's "train_options" (what export keeps of a
  /// MultiMNIST checkpoint), null when its card has none.
  nlohmann::json train_options;
  bool weight_file = false;  // read from a weight file (save_weights), not a training checkpoint

  /// The side S and channels C of its input [N, C, S, S] (from the network's config).
  int64_t image_size() const;
  int64_t image_channels() const;
  /// Computes at `precision` (the network's set_precision).
  void set_precision(Precision precision);
};

/// Loads any network stored by capsnet (a checkpoint of any training command, or an exported weight
/// file). CheckpointError / ExportError naming the file when it is neither or is damaged.
LoadedModel load_any_model(const std::string& path);

}  // namespace capsnet::train
