// The loss curve read from a metrics file and drawn as SVG (`sppo plot`), and the charts
// `sppo eval` draws: loss by token position and the passkey accuracy grid.
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <regex>
#include <sstream>
#include <utility>
#include <vector>

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

using Points = std::vector<std::pair<double, double>>;

// The points of every <polyline> whose attributes contain `attribute`, in document order.
std::vector<Points> polylines_with(const std::string& svg, const std::string& attribute) {
  std::vector<Points> lines;
  const std::regex polyline("<polyline ([^>]*)points=\"([^\"]*)\"");
  for (auto it = std::sregex_iterator(svg.begin(), svg.end(), polyline); it != std::sregex_iterator(); ++it) {
    if ((*it)[1].str().append("points=").find(attribute) == std::string::npos) continue;
    // Every "x,y" pair counts, a "nan" one included, so that a stray point is caught.
    std::istringstream text((*it)[2]);
    Points points;
    for (std::string pair; text >> pair;) {
      const std::size_t comma = pair.find(',');
      points.emplace_back(std::stod(pair.substr(0, comma)), std::stod(pair.substr(comma + 1)));
    }
    lines.push_back(points);
  }
  return lines;
}

// Where the <text> that reads exactly `label` is anchored; (-1, -1) when there is none.
std::pair<double, double> text_at(const std::string& svg, const std::string& label) {
  const std::regex text("<text x=\"([-0-9.]+)\" y=\"([-0-9.]+)\"[^>]*>([^<]*)</text>");
  for (auto it = std::sregex_iterator(svg.begin(), svg.end(), text); it != std::sregex_iterator(); ++it)
    if ((*it)[3] == label) return {std::stod((*it)[1]), std::stod((*it)[2])};
  return {-1, -1};
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

TEST(LossPlot, ReadsHeldOutLossOnTheStepsThatRanAnEvaluation) {
  TempDir dir("sppo-plot");
  const std::string path = write(dir, "m.jsonl",
                                 "{\"step\":1,\"loss\":4.0}\n"
                                 "{\"step\":2,\"loss\":3.0,\"eval_loss\":3.25}\n"
                                 "{\"step\":3,\"loss\":2.5}\n"
                                 "{\"step\":4,\"loss\":2.0,\"eval_loss\":2.75,\"eval_loss_first_half\":3.5,"
                                 "\"eval_loss_second_half\":2.0}\n");
  const auto curve = read_loss_curve(path);
  ASSERT_EQ(curve.size(), 4u);
  EXPECT_TRUE(std::isnan(curve[0].eval_loss));
  EXPECT_TRUE(std::isnan(curve[0].eval_loss_first_half));
  EXPECT_DOUBLE_EQ(curve[1].eval_loss, 3.25);
  EXPECT_TRUE(std::isnan(curve[1].eval_loss_second_half));
  EXPECT_TRUE(std::isnan(curve[2].eval_loss));
  EXPECT_DOUBLE_EQ(curve[3].eval_loss, 2.75);
  EXPECT_DOUBLE_EQ(curve[3].eval_loss_first_half, 3.5);
  EXPECT_DOUBLE_EQ(curve[3].eval_loss_second_half, 2.0);
}

TEST(LossPlot, HeldOutSeriesAreDashedAndJoinTheirEvaluationsAcrossTheStepsBetween) {
  // Evaluations every 3 steps; training skips step 5 (a non-finite loss).
  std::vector<LossPoint> curve;
  for (int step = 1; step <= 7; ++step) {
    LossPoint p{step, step == 5 ? NAN : 4.0 - 0.25 * step, 4.0, 3.0};
    if (step % 3 == 1) {
      // Held-out loss above every training loss: the y range must grow to hold it.
      p.eval_loss = 9.0 - step;
      p.eval_loss_first_half = 8.5;
      p.eval_loss_second_half = 7.5 - step;
    }
    curve.push_back(p);
  }
  const std::string svg = svg_loss_curve(curve, "held-out");
  // Training: the whole-sequence line breaks at step 5, the halves run unbroken.
  const auto training = polylines_with(svg, "stroke-width=\"1.8\" points=");
  ASSERT_EQ(training.size(), 4u);
  EXPECT_EQ(training[0].size(), 4u);
  EXPECT_EQ(training[1].size(), 2u);
  // Held-out: one dashed line per series through all three evaluations, at the same x as
  // the training points of steps 1, 4 and 7, in the training series' colours.
  const auto held_out = polylines_with(svg, "stroke-dasharray=\"6 4\" points=");
  ASSERT_EQ(held_out.size(), 3u);
  for (const Points& line : held_out) {
    ASSERT_EQ(line.size(), 3u);
    EXPECT_DOUBLE_EQ(line[0].first, training[0][0].first);
    EXPECT_DOUBLE_EQ(line[1].first, training[0][3].first);
    EXPECT_DOUBLE_EQ(line[2].first, training[1][1].first);
    // Scaled into the plot, not off its top: the y range includes held-out values.
    for (const auto& [x, y] : line) EXPECT_GE(y, 56.0);
  }
  EXPECT_EQ(count(svg, "stroke=\"#202124\" stroke-width=\"1.8\" stroke-dasharray"), 1);
  EXPECT_EQ(count(svg, "stroke=\"#ea4335\" stroke-width=\"1.8\" stroke-dasharray"), 1);
  EXPECT_EQ(count(svg, "<circle "), 9);  // a dot at each evaluation
  // Six legend entries, three a row, each label ending inside the 800 px page (at most
  // ~7 px a character at font size 12).
  for (const char* label : {"whole sequence", "first half (near positions)", "second half (far positions)",
                            "held-out, whole", "held-out, first half", "held-out, second half"}) {
    const auto [x, y] = text_at(svg, label);
    ASSERT_GT(x, 0) << label;
    EXPECT_LE(x + 7.0 * std::string(label).size(), 800) << label;
  }
  EXPECT_EQ(text_at(svg, "whole sequence").second, text_at(svg, "second half (far positions)").second);
  EXPECT_GT(text_at(svg, "held-out, whole").second, text_at(svg, "whole sequence").second);

  // A single evaluation still shows, as a dot.
  std::vector<LossPoint> once = {{1, 4.0, NAN, NAN}, {2, 3.0, NAN, NAN, 3.5}, {3, 2.0, NAN, NAN}};
  const std::string one = svg_loss_curve(once, "once");
  EXPECT_EQ(count(one, "<circle "), 1);
  EXPECT_NE(one.find("held-out, whole"), std::string::npos);
  EXPECT_EQ(one.find("held-out, first half"), std::string::npos);
}

TEST(LossPlot, LossByPositionHasOnePointPerNonEmptyBinOnALog2Axis) {
  const std::vector<PositionBin> bins = {{0, 1024, 3.0, 100},
                                         {1024, 2048, 2.5, 100},
                                         {2048, 4096, NAN, 0},  // no token landed here
                                         {4096, 8192, 2.0, 400},
                                         {8192, 16384, 1.9, 800}};
  const std::string svg = svg_loss_by_position(bins, "by position");
  const auto lines = polylines_with(svg, "stroke-width=\"1.8\"");
  ASSERT_EQ(lines.size(), 1u);
  const Points& line = lines[0];
  ASSERT_EQ(line.size(), 4u);
  for (std::size_t i = 1; i < line.size(); ++i) {
    EXPECT_GT(line[i].first, line[i - 1].first);
    EXPECT_GT(line[i].second, line[i - 1].second);  // loss falls, so the curve goes down the page
  }
  // Geometric middles 2^9, 2^10.5, 2^12.5, 2^13.5: steps of 1.5, 2 and 1 on the log axis.
  const double unit = line[3].first - line[2].first;
  EXPECT_NEAR((line[1].first - line[0].first) / unit, 1.5, 0.01);
  EXPECT_NEAR((line[2].first - line[1].first) / unit, 2.0, 0.01);
  // Ticks at powers of two, evenly spaced, the first point on the 512 tick.
  for (const char* label : {"512", "1K", "2K", "4K", "8K", "16K"}) EXPECT_GT(text_at(svg, label).first, 0) << label;
  EXPECT_NEAR(text_at(svg, "512").first, line[0].first, 0.1);
  EXPECT_NEAR(text_at(svg, "2K").first - text_at(svg, "1K").first, unit, 0.2);
  EXPECT_NEAR(text_at(svg, "16K").first - text_at(svg, "8K").first, unit, 0.2);
  EXPECT_GT(text_at(svg, "token position").first, 0);
  EXPECT_GT(text_at(svg, "loss (nats a token)").first, 0);

  const std::string long_context = svg_loss_by_position({{0, 65536, 2.0, 10}, {524288, 2097152, 2.5, 10}}, "long");
  for (const char* label : {"32K", "64K", "512K", "1M"}) EXPECT_GT(text_at(long_context, label).first, 0) << label;
}

TEST(LossPlot, AccuracyGridHasACellPerRunColouredByAccuracyAndGreyWhereNotRun) {
  std::vector<GridCell> cells;
  // Lengths out of order: the columns sort them.
  for (std::int64_t length : {4096, 1024, 2048})
    for (double depth : {0.0, 0.5, 1.0}) cells.push_back({length, depth, 0.5});
  cells[0].accuracy = 0.0;   // (4K, 0%)
  cells[4].accuracy = 1.0;   // (1K, 50%)
  cells[7].accuracy = 0.83;  // (2K, 50%)
  cells[8].accuracy = NAN;   // (2K, 100%): not run
  const std::string svg = svg_accuracy_grid(cells, "passkey");
  EXPECT_EQ(count(svg, "<rect class=\"cell\""), 9);
  EXPECT_EQ(count(svg, ">0.50</text>"), 5);
  EXPECT_EQ(count(svg, "class=\"cell\"") - count(svg, "fill=\"#d0d0d0\" stroke=\"white\""), 8);
  // Red at 0, green at 1.
  EXPECT_EQ(count(svg, "fill=\"#d73027\" stroke=\"white\""), 1);
  EXPECT_EQ(count(svg, "fill=\"#1a9850\" stroke=\"white\""), 1);
  // Columns ascend by length, rows by depth from the top; each number sits in its cell.
  EXPECT_LT(text_at(svg, "1K").first, text_at(svg, "2K").first);
  EXPECT_LT(text_at(svg, "2K").first, text_at(svg, "4K").first);
  EXPECT_LT(text_at(svg, "0%").second, text_at(svg, "50%").second);
  EXPECT_LT(text_at(svg, "50%").second, text_at(svg, "100%").second);
  EXPECT_EQ(text_at(svg, "0.83").first, text_at(svg, "2K").first);
  EXPECT_EQ(text_at(svg, "0.83").second, text_at(svg, "50%").second);
  EXPECT_EQ(text_at(svg, "1.00").first, text_at(svg, "1K").first);
  EXPECT_EQ(text_at(svg, "0.00").first, text_at(svg, "4K").first);
  EXPECT_EQ(text_at(svg, "0.00").second, text_at(svg, "0%").second);
  EXPECT_EQ(text_at(svg, "n/a").first, text_at(svg, "2K").first);
  EXPECT_EQ(text_at(svg, "n/a").second, text_at(svg, "100%").second);
  EXPECT_GT(text_at(svg, "context length (tokens)").first, 0);
  EXPECT_GT(text_at(svg, "passkey depth").first, 0);

  EXPECT_ERROR_WITH(svg_accuracy_grid({}, "empty"), "[plot] the passkey grid has no cell");
  EXPECT_ERROR_WITH(svg_accuracy_grid({{1024, 0.5, 1.0}, {1024, 0.5, 0.0}}, "twice"), "depth 0.5 twice");
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
