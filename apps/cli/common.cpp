#include "capsnet/data/mnist.h"
#include "apps/cli/commands.h"

#include <fstream>
#include <stdexcept>

namespace capsnet::apps::cli {

void add_threads_flag(CLI::App& app, int& threads) {
  app.add_option("--threads", threads, "Intra-op threads (0 = all cores)")->check(CLI::NonNegativeNumber);
}

void add_precision_flag(CLI::App& app, std::string& precision) {
  app.add_option("--precision", precision,
                 "Compute precision of the convolutions and decoder: fp32, bf16 (AVX512_BF16/AMX CPUs; fp32 "
                 "weights, fp32 routing and losses) or auto (bf16 where the CPU has it)")
      ->check(CLI::IsMember({"fp32", "bf16", "auto"}))
      ->capture_default_str();
}

void write_text_file(const std::string& path, const std::string& text) {
  std::ofstream out(path);
  if (!out) throw std::runtime_error("cannot write " + path);
  out << text;
  if (!out.flush()) throw std::runtime_error("could not write " + path);
}

std::string DataFlags::resolved() const { return dir.empty() ? data::default_data_dir(dataset) : dir; }

void add_data_flags(CLI::App& app, DataFlags& flags) {
  app.add_option("--dataset", flags.dataset,
                 "Image set: mnist (data/mnist, scripts/fetch_mnist.sh) or fashion-mnist "
                 "(Debian package dataset-fashion-mnist)")
      ->check(CLI::IsMember(data::dataset_names()))
      ->capture_default_str();
  app.add_option("--data", flags.dir, "Directory with the four IDX files (default: the --dataset's directory)");
}

}  // namespace capsnet::apps::cli
