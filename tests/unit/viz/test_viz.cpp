// Figure writers: PNG round trip, grid geometry, glyphs, (l,p,r) panels.
#include <gtest/gtest.h>

#include <fstream>

#include "capsnet/viz/figures.h"
#include "capsnet/viz/png.h"
#include "test_helpers.h"

namespace capsnet {
namespace {

TEST(VizTest, PngRoundTripIsExact) {
  testing::TempDir dir;
  auto img = torch::randint(0, 256, {17, 23}, torch::kLong).to(torch::kUInt8);
  viz::write_png_gray(dir / "a.png", img);
  EXPECT_TRUE(torch::equal(viz::read_png_gray(dir / "a.png"), img));

  // Floats in [0, 1] are scaled to 0..255 and clamped.
  auto f = torch::tensor({0.0f, 0.5f, 1.0f, 2.0f}).view({2, 2});
  viz::write_png_gray(dir / "f.png", f);
  auto back = viz::read_png_gray(dir / "f.png");
  EXPECT_EQ(back[0][0].item<int>(), 0);
  EXPECT_EQ(back[0][1].item<int>(), 128);
  EXPECT_EQ(back[1][0].item<int>(), 255);
  EXPECT_EQ(back[1][1].item<int>(), 255);
}

TEST(VizTest, BadPngGivesAClearError) {
  testing::TempDir dir;
  std::ofstream(dir / "bad.png") << "not a png at all";
  try {
    viz::read_png_gray(dir / "bad.png");
    FAIL() << "expected PngError";
  } catch (const viz::PngError& e) {
    EXPECT_NE(std::string(e.what()).find(dir / "bad.png"), std::string::npos) << e.what();
  }
  EXPECT_THROW(viz::read_png_gray(dir / "missing.png"), viz::PngError);
}

TEST(VizTest, TilePlacesImagesRowMajorWithPadding) {
  std::vector<torch::Tensor> images;
  for (int k = 0; k < 5; ++k) images.push_back(torch::full({3, 4}, 0.1f * (k + 1)));
  auto grid = viz::tile(images, 3, 2, 0.0f);
  ASSERT_EQ(grid.size(0), 2 * (3 + 2) + 2);
  ASSERT_EQ(grid.size(1), 3 * (4 + 2) + 2);
  EXPECT_FLOAT_EQ(grid[2][2].item<float>(), 0.1f);               // image 0, top-left
  EXPECT_FLOAT_EQ(grid[2][2 + 2 * 6].item<float>(), 0.3f);       // image 2, end of row 0
  EXPECT_FLOAT_EQ(grid[2 + 5][2 + 6].item<float>(), 0.5f);       // image 4, row 1 column 1
  EXPECT_FLOAT_EQ(grid[0][0].item<float>(), 0.0f);               // padding
  EXPECT_FLOAT_EQ(grid[2 + 5][2 + 2 * 6].item<float>(), 0.0f);  // empty sixth cell
  images.push_back(torch::zeros({4, 4}));
  EXPECT_THROW(viz::tile(images, 3), c10::Error);
}

TEST(VizTest, GlyphsLightExactlyTheirPixels) {
  auto canvas = torch::zeros({5, 3});
  viz::draw_text(canvas, 0, 0, "1");
  // '1' = .#. / ##. / .#. / .#. / ###
  const float expected[5][3] = {{0, 1, 0}, {1, 1, 0}, {0, 1, 0}, {0, 1, 0}, {1, 1, 1}};
  for (int y = 0; y < 5; ++y)
    for (int x = 0; x < 3; ++x) EXPECT_EQ(canvas[y][x].item<float>(), expected[y][x]) << y << "," << x;
  auto blank = torch::zeros({10, 10});
  viz::draw_text(blank, 0, 0, "?~");
  EXPECT_EQ(blank.sum().item<float>(), 0.0f);
  auto scaled = torch::zeros({10, 6});
  viz::draw_text(scaled, 0, 0, "8", 2);
  EXPECT_EQ(scaled.sum().item<float>(), 4.0f * 13);  // '8' has 13 lit cells
  EXPECT_EQ(viz::text_width("(1,2,3)", 2), 2 * (4 * 7 - 1));
}

TEST(VizTest, ReconstructionPanelStacksCaptionInputAndReconstruction) {
  auto image = torch::rand({28, 28}), rec = torch::rand({28, 28});
  auto panel = viz::reconstruction_panel(image, rec, 5, 3, 5, 2);
  ASSERT_EQ(panel.size(1), 56);
  ASSERT_EQ(panel.size(0), 14 + 56 + 2 + 56);
  EXPECT_FLOAT_EQ(panel[14][0].item<float>(), image[0][0].item<float>());
  EXPECT_FLOAT_EQ(panel[14 + 56 + 2 + 55][55].item<float>(), rec[27][27].item<float>());
  EXPECT_GT(panel.narrow(0, 0, 14).sum().item<float>(), 0.0f);  // a caption was drawn
}

}  // namespace
}  // namespace capsnet
