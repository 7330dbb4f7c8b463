#pragma once
// Weights for Python: a checkpoint's model as one torch::pickle_save file that Python's torch.load
// reads (python/capsnet/model.py builds the equivalent nn.Module from it).
//
// File layout (a dict; torch.load gives a Python dict with the same keys):
//   "format"     "capsnet-weights"
//   "version"    1
//   "model"      "capsnet" (CapsNetConfig), "matrix-capsnet" (MatrixCapsNetConfig, EM routing) or
//                "baseline-cnn" (BaselineCnnConfig); files written before the key hold a CapsNet
//   "config"     the model's config to_json() as a JSON string
//   "step"       optimizer steps of the checkpoint
//   "state_dict" {name -> tensor}: every parameter and buffer, names as named_parameters()
//                ("conv1.weight", "primary_caps.conv.weight", "digit_caps.weight" [I, J, D, Din],
//                "decoder.fc1.weight", ...), i.e. the names of the Python module's state_dict()
//   "card"       (optional) model card as a JSON string: data, command, epochs, precision, accuracy
//   "probe"      (only with ExportOptions::probe > 0) C++ reference outputs for checking a port:
//                CapsNet: {"images" [N, C, H, W] in [0, 1), "digit_caps" [N, K, D], "lengths" [N, K],
//                 "reconstruction" [N, C*H*W] (decoder of the longest capsule; absent without a decoder)};
//                matrix-capsnet: {"images", "poses" [N, K, 16], "activations" [N, K]};
//                baseline-cnn: {"images", "logits" [N, K]}
//   "crc32"      (written by save_weights) CRC-32 of every other entry in a canonical order (sorted keys;
//                strings, integers, and each tensor's name, dtype, shape and bytes), checked by read_weights.
//                Files without it (written before it, e.g. the shipped model) load unchecked; an entry
//                not listed here is reported as corruption.

#include <torch/torch.h>

#include <map>
#include <optional>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>

#include "capsnet/models/baseline_cnn.h"
#include "capsnet/models/capsnet.h"
#include "capsnet/models/matrix_capsnet.h"

namespace capsnet::train {

/// Thrown for unreadable or malformed weight files and failed writes; what() names the file.
class ExportError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

inline constexpr const char* kWeightsFormat = "capsnet-weights";
inline constexpr int64_t kWeightsVersion = 1;
/// The "model" entry: which network the config and state dict describe.
inline constexpr const char* kCapsNetModel = "capsnet";
inline constexpr const char* kMatrixCapsNetModel = "matrix-capsnet";
inline constexpr const char* kBaselineCnnModel = "baseline-cnn";

/// Storage type of the exported tensors. fp16 / bf16 halve the file; the model computes in fp32
/// after loading (the stored values are exactly what every loader sees).
enum class WeightStorage { kFloat32, kFloat16, kBFloat16 };

/// "fp32" | "fp16" | "bf16" -> WeightStorage; std::invalid_argument naming the option otherwise.
WeightStorage parse_weight_storage(const std::string& name);
std::string weight_storage_name(WeightStorage storage);

struct ExportOptions {
  /// Number of seeded uniform-noise probe images whose C++ outputs are stored beside the weights
  /// (0 = none). Inference mode: the decoder sees the longest capsule.
  int64_t probe = 0;
  uint64_t probe_seed = 0;
  /// Tensor storage type. With fp16 / bf16 the model's weights are rounded in place before the probe
  /// runs, so the probe is what a loader of the file computes.
  WeightStorage storage = WeightStorage::kFloat32;
  /// Free-form JSON stored as "card" (a model card: data, command, accuracy); empty: none.
  nlohmann::json card;
};

/// The exported dict for `model` (see the layout above). Throws std::invalid_argument for probe < 0.
c10::impl::GenericDict export_dict(models::CapsNet& model, int64_t step, const ExportOptions& options);
c10::impl::GenericDict export_dict(models::MatrixCapsNet& model, int64_t step, const ExportOptions& options);
c10::impl::GenericDict export_dict(models::BaselineCnn& model, int64_t step, const ExportOptions& options);

/// Writes export_dict(model, step, options) plus its "crc32" to `path` atomically (write_file_atomically in
/// checkpoint.h: temp file, fsync, rename; orphaned temp files of dead writers removed; parent directories
/// created). Returns the number of bytes written; ExportError naming the file when the write fails.
int64_t save_weights(const std::string& path, models::CapsNet& model, int64_t step, const ExportOptions& options = {});
int64_t save_weights(const std::string& path, models::MatrixCapsNet& model, int64_t step,
                     const ExportOptions& options = {});
int64_t save_weights(const std::string& path, models::BaselineCnn& model, int64_t step,
                     const ExportOptions& options = {});

struct ExportSummary {
  int64_t step = 0;
  int64_t tensors = 0;     // entries of the state dict
  int64_t parameters = 0;  // trainable scalars
  int64_t bytes = 0;       // size of the written file
};

/// Loads the checkpoint (CheckpointError when missing or broken) and exports it to `out_path`: a CapsNet,
/// the matrix-capsule network of a `capsnet em` checkpoint, or the baseline CNN (of `capsnet affine` / `stn`),
/// whichever the file holds (stored_model in checkpoint.h).
/// Throws std::invalid_argument when `out_path` is the checkpoint itself or an existing directory.
ExportSummary export_checkpoint(const std::string& checkpoint_path, const std::string& out_path,
                                const ExportOptions& options = {});

/// A weight file read back in C++ (tests, tools).
struct ExportedWeights {
  std::string model = kCapsNetModel;  // kCapsNetModel, kMatrixCapsNetModel or kBaselineCnnModel
  nlohmann::json config;
  int64_t step = 0;
  std::map<std::string, torch::Tensor> state_dict;
  std::map<std::string, torch::Tensor> probe;  // empty when exported without a probe
  nlohmann::json card;                          // null when the file has none
};

/// The weight file at `path`, or nullopt when it is not one (missing, or e.g. a training checkpoint).
/// ExportError when it is a weight file but damaged (e.g. "weights PATH: corrupt (checksum mismatch ...)").
std::optional<ExportedWeights> try_read_weights(const std::string& path);

/// True when `path` is a weight file (written by save_weights, damaged or not) rather than a training checkpoint.
bool is_weights_file(const std::string& path);

/// Builds the model described by weights already read from `path` (named in errors). ExportError when
/// the file holds the other kind of network (the message says which commands take it).
models::CapsNet model_from_weights(const ExportedWeights& weights, const std::string& path);
models::MatrixCapsNet matrix_model_from_weights(const ExportedWeights& weights, const std::string& path);
models::BaselineCnn baseline_cnn_from_weights(const ExportedWeights& weights, const std::string& path);

/// What a "model" entry holds, in words for messages: "a CapsNet", "matrix capsules with EM routing
/// (capsnet em)", "the baseline CNN".
std::string describe_model_kind(const std::string& kind);

/// Builds the model described by a weight file and copies its tensors in (converted to fp32; every
/// name and shape must match). Eval mode. ExportError naming the file otherwise.
models::CapsNet load_model_from_weights(const std::string& path);

/// Reads a file written by save_weights with torch::pickle_load and checks its "crc32" when it has one;
/// ExportError naming the file otherwise ("corrupt" for a checksum mismatch or an unknown entry).
ExportedWeights read_weights(const std::string& path);

}  // namespace capsnet::train
