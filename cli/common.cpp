#include "cli/commands.h"

namespace capsnet::cli {

void add_threads_flag(CLI::App& app, int& threads) {
  app.add_option("--threads", threads, "Intra-op threads (0 = all cores)")->check(CLI::NonNegativeNumber);
}

}  // namespace capsnet::cli
