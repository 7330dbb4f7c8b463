#pragma once
// Figure building blocks: image grids and captions drawn with a built-in 3x5 pixel font.

#include <torch/torch.h>

#include <string>
#include <vector>

#include "capsnet/models/capsnet.h"

namespace capsnet::viz {

/// Tiles images (each [H, W] float in [0, 1], all the same size) row-major into a grid with `pad`
/// pixels of `background` between and around them. Returns [rows*(H+pad)+pad, cols*(W+pad)+pad].
torch::Tensor tile(const std::vector<torch::Tensor>& images, int64_t columns, int64_t pad = 2,
                   float background = 0.5f);

/// Draws `text` onto canvas [H, W] (float) at top-left (x, y), each font pixel scale x scale.
/// Supports 0-9 ( ) , : * - + . and the letters L P R; other characters are left blank. Clipped at the edges.
void draw_text(torch::Tensor& canvas, int64_t x, int64_t y, const std::string& text, int64_t scale = 1,
               float value = 1.0f);

/// Width in pixels of `text` drawn at `scale` (4 columns per character incl. spacing, minus one).
int64_t text_width(const std::string& text, int64_t scale = 1);

/// One (l, p, r) panel of the paper's Fig. 3: a caption "(l,p,r)" above the input digit and its
/// reconstruction from capsule r. image, reconstruction: [H, W] float in [0, 1]. Returns a float canvas.
torch::Tensor reconstruction_panel(const torch::Tensor& image, const torch::Tensor& reconstruction, int64_t label,
                                   int64_t prediction, int64_t reconstructed_from, int64_t zoom = 2);

}  // namespace capsnet::viz
