// References no symbol of libcapsnet_ops.so: the capsnet operators are registered only if linking
// capsnet::capsnet kept the library loaded (LINKER:--no-as-needed of capsnet::ops_link), even though
// CMakeLists.txt puts --as-needed first. Exits 1 when the op is missing or wrong.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <cstdio>

int main() {
  auto op = c10::Dispatcher::singleton().findSchema({"capsnet::routing_from_predictions", ""});
  if (!op) {
    std::fprintf(stderr, "FAIL: capsnet::routing_from_predictions is not registered: libcapsnet_ops.so was not loaded\n");
    return 1;
  }
  // u_hat: [B=2, I=5, J=3, D=4] -> v: [2, 3, 4], each |v_j| < 1 (squash).
  auto u_hat = at::randn({2, 5, 3, 4});
  auto v = op->typed<at::Tensor(const at::Tensor&, int64_t, bool)>().call(u_hat, 3, true);
  const bool ok = v.sizes() == at::IntArrayRef({2, 3, 4}) && v.norm(2, {-1}).lt(1).all().item<bool>();
  std::printf("%s: capsnet::routing_from_predictions through the dispatcher, v: %s\n", ok ? "ok  " : "FAIL",
              ok ? "[2, 3, 4]" : "wrong");
  return ok ? 0 : 1;
}
