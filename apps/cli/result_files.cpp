#include "apps/cli/result_files.h"

#include <fmt/format.h>

#include <iostream>

#include "apps/cli/commands.h"
#include "capsnet/train/json_input.h"
#include "capsnet/viz/png.h"

namespace capsnet::apps::cli {

void write_summary(const std::string& path, nlohmann::json& summary, std::chrono::steady_clock::time_point start) {
  summary["seconds"] = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  write_text_file(path, train::dump_json(summary, 2) + "\n");
  std::cout << fmt::format("wrote {} ({:.1f} s in all)\n", path, summary["seconds"].get<double>());
}

void write_figure(const std::string& path, const torch::Tensor& figure) {
  viz::write_png_gray(path, figure);
  std::cout << fmt::format("wrote {} ({}x{} px)\n", path, figure.size(1), figure.size(0));
}

}  // namespace capsnet::apps::cli
