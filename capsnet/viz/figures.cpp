#include "capsnet/viz/figures.h"

#include <fmt/format.h>

#include <array>
#include <map>

namespace capsnet::viz {
namespace {

// 3x5 glyphs, one string of 15 '#'/'.' per character, row-major.
const std::map<char, const char*>& font() {
  static const std::map<char, const char*> glyphs = {
      {'0', "####.##.##.####"}, {'1', ".#.##..#..#.###"}, {'2', "###..#####..###"}, {'3', "###..####..####"},
      {'4', "#.##.####..#..#"}, {'5', "####..###..####"}, {'6', "####..####.####"}, {'7', "###..#..#..#..#"},
      {'8', "####.#####.####"}, {'9', "####.####..####"}, {'(', ".#.#..#..#...#."}, {')', ".#...#..#..#.#."},
      {',', "..........#.#.."}, {':', "....#.....#...."}, {'*', "...#.#.#.#.#..."}, {'L', "#..#..#..#..###"},
      {'P', "####.####..#..."}, {'R', "####.###.#.##.#"}, {'-', "......###......"}, {'+', "....#.###.#...."},
      {'.', ".............#."}};
  return glyphs;
}

}  // namespace

torch::Tensor tile(const std::vector<torch::Tensor>& images, int64_t columns, int64_t pad, float background) {
  TORCH_CHECK(!images.empty(), "tile: no images");
  TORCH_CHECK(columns > 0 && pad >= 0, "tile: columns must be positive and pad >= 0");
  const int64_t H = images[0].size(0), W = images[0].size(1);
  const int64_t n = static_cast<int64_t>(images.size()), cols = std::min(columns, n), rows = (n + cols - 1) / cols;
  auto canvas = torch::full({rows * (H + pad) + pad, cols * (W + pad) + pad}, background);
  for (int64_t k = 0; k < n; ++k) {
    TORCH_CHECK(images[k].dim() == 2 && images[k].size(0) == H && images[k].size(1) == W,
                "tile: image ", k, " is ", images[k].sizes(), ", expected [", H, ", ", W, "]");
    const int64_t y = pad + (k / cols) * (H + pad), x = pad + (k % cols) * (W + pad);
    canvas.narrow(0, y, H).narrow(1, x, W).copy_(images[k].to(torch::kFloat));
  }
  return canvas;
}

int64_t text_width(const std::string& text, int64_t scale) {
  return text.empty() ? 0 : (4 * static_cast<int64_t>(text.size()) - 1) * scale;
}

void draw_text(torch::Tensor& canvas, int64_t x, int64_t y, const std::string& text, int64_t scale, float value) {
  TORCH_CHECK(canvas.dim() == 2 && canvas.scalar_type() == torch::kFloat, "draw_text: canvas must be float [H, W]");
  auto a = canvas.accessor<float, 2>();
  const int64_t H = canvas.size(0), W = canvas.size(1);
  for (size_t c = 0; c < text.size(); ++c) {
    auto it = font().find(text[c]);
    if (it == font().end()) continue;
    for (int64_t gy = 0; gy < 5; ++gy)
      for (int64_t gx = 0; gx < 3; ++gx) {
        if (it->second[gy * 3 + gx] != '#') continue;
        for (int64_t dy = 0; dy < scale; ++dy)
          for (int64_t dx = 0; dx < scale; ++dx) {
            const int64_t py = y + gy * scale + dy, px = x + (4 * static_cast<int64_t>(c) + gx) * scale + dx;
            if (py >= 0 && py < H && px >= 0 && px < W) a[py][px] = value;
          }
      }
  }
}

torch::Tensor reconstruction_panel(const torch::Tensor& image, const torch::Tensor& reconstruction, int64_t label,
                                   int64_t prediction, int64_t reconstructed_from, int64_t zoom) {
  auto up = [zoom](const torch::Tensor& t) {
    return t.to(torch::kFloat).repeat_interleave(zoom, 0).repeat_interleave(zoom, 1);
  };
  auto img = up(image), rec = up(reconstruction);
  const int64_t H = img.size(0), W = img.size(1), scale = W >= 56 ? 2 : 1, caption = 5 * scale + 4, gap = 2;
  auto panel = torch::zeros({caption + 2 * H + gap, W});
  const auto text = fmt::format("({},{},{})", label, prediction, reconstructed_from);
  draw_text(panel, std::max<int64_t>(0, (W - text_width(text, scale)) / 2), 2, text, scale,
            label == prediction ? 1.0f : 0.6f);  // misclassified: dimmer caption
  panel.narrow(0, caption, H).copy_(img);
  panel.narrow(0, caption + H + gap, H).copy_(rec);
  return panel;
}

}  // namespace capsnet::viz
