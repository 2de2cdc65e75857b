// The loss curve read from a metrics file and drawn as SVG (`sppo plot`).
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <regex>

#include "core/check.h"
#include "io/fileutil.h"
#include "io/loss_plot.h"
#include "support/expect_error.h"

namespace sppo::io {
namespace {

std::string write(const TempDir& dir, const std::string& name, const std::string& text) {
  const std::string path = dir.path() + "/" + name;
  std::ofstream(path) << text;
  return path;
}

int count(const std::string& s, const std::string& what) {
  int n = 0;
  for (std::size_t at = s.find(what); at != std::string::npos; at = s.find(what, at + 1)) ++n;
  return n;
}

TEST(LossPlot, ReadsStepsInOrderKeepsTheLastOfARepeatedStepAndSkipsSummaries) {
  TempDir dir("sppo-plot");
  const std::string path = write(dir, "m.jsonl",
                                 "{\"step\":1,\"loss\":4.0,\"loss_first_half\":4.1,\"loss_second_half\":3.9}\n"
                                 "{\"step\":2,\"loss\":3.0,\"loss_first_half\":3.5,\"loss_second_half\":2.5}\n"
                                 "\n"
                                 // Resumed after a crash at step 2: the run logs step 2 again.
                                 "{\"step\":2,\"loss\":2.0,\"loss_first_half\":3.4,\"loss_second_half\":0.6}\n"
                                 "{\"step\":3,\"loss\":1.5}\n"
                                 "{\"step\":3,\"summary\":true,\"measured_step_time_s\":0.1}\n"
                                 "{\"step\":4,\"loss\":1.");  // torn by a kill mid-write
  const auto curve = read_loss_curve(path);
  ASSERT_EQ(curve.size(), 3u);
  EXPECT_EQ(curve[0].step, 1);
  EXPECT_EQ(curve[1].step, 2);
  EXPECT_DOUBLE_EQ(curve[1].loss, 2.0);
  EXPECT_DOUBLE_EQ(curve[1].loss_second_half, 0.6);
  EXPECT_DOUBLE_EQ(curve[2].loss, 1.5);
  EXPECT_TRUE(std::isnan(curve[2].loss_first_half));
}

TEST(LossPlot, DrawsOneLinePerSeriesThatHasValues) {
  std::vector<LossPoint> both = {{1, 4.0, 4.1, 3.9}, {2, 3.0, 3.5, 2.5}, {3, 2.0, 3.4, 0.6}};
  const std::string svg = svg_loss_curve(both, "a <title> & more");
  EXPECT_EQ(svg.rfind("<svg", 0), 0u);
  EXPECT_NE(svg.find("a &lt;title&gt; &amp; more"), std::string::npos);
  EXPECT_EQ(count(svg, "stroke-width=\"1.8\" points="), 3);
  EXPECT_NE(svg.find("second half (far positions)"), std::string::npos);
  // The highest loss sits at the top of the plot, the lowest near its bottom: points are
  // scaled, not clipped.
  const std::regex point("([0-9.]+),([0-9.]+) ");
  double y_min = 1e9, y_max = 0;
  for (auto it = std::sregex_iterator(svg.begin(), svg.end(), point); it != std::sregex_iterator(); ++it) {
    y_min = std::min(y_min, std::stod((*it)[2]));
    y_max = std::max(y_max, std::stod((*it)[2]));
  }
  EXPECT_LT(y_min, y_max);

  std::vector<LossPoint> whole_only = {{1, 4.0, NAN, NAN}, {2, 3.0, NAN, NAN}};
  const std::string one = svg_loss_curve(whole_only, "mlm");
  EXPECT_EQ(count(one, "stroke-width=\"1.8\" points="), 1);
  EXPECT_EQ(one.find("far positions"), std::string::npos);
  // A non-finite loss (a skipped step) breaks the line instead of drawing a spike.
  std::vector<LossPoint> gap = {{1, 4.0, NAN, NAN}, {2, INFINITY, NAN, NAN}, {3, 3.0, NAN, NAN}};
  EXPECT_EQ(count(svg_loss_curve(gap, "gap"), "stroke-width=\"1.8\" points="), 2);
}

TEST(LossPlot, BadFilesAreRefusedWithTheLineThatIsWrong) {
  TempDir dir("sppo-plot");
  EXPECT_ERROR_WITH(read_loss_curve(dir.path() + "/missing.jsonl"), "[plot] cannot open the metrics file");
  const std::string empty = write(dir, "empty.jsonl", "{\"step\":3,\"summary\":true}\n");
  EXPECT_ERROR_WITH(read_loss_curve(empty), "holds no step record");
  const std::string garbage = write(dir, "g.jsonl", "{\"step\":1,\"loss\":4}\nnot json\n{\"step\":2,\"loss\":3}\n");
  EXPECT_ERROR_WITH(read_loss_curve(garbage), "line 2 is not JSON");
  const std::string no_step = write(dir, "s.jsonl", "{\"loss\":4}\n");
  EXPECT_ERROR_WITH(read_loss_curve(no_step), "line 1 has no integer \"step\"");
  const std::string no_loss = write(dir, "l.jsonl", "{\"step\":1,\"loss\":\"high\"}\n");
  EXPECT_ERROR_WITH(read_loss_curve(no_loss), "line 1 has no numeric \"loss\"");
  const std::string array = write(dir, "a.jsonl", "[1, 2]\n");
  EXPECT_ERROR_WITH(read_loss_curve(array), "line 1 is not a JSON object");
}

}  // namespace
}  // namespace sppo::io
