#include "io/loss_plot.h"

#include <algorithm>
#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <fstream>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <utility>

#include "core/check.h"

namespace sppo::io {

namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

double number_or_nan(const nlohmann::json& record, const char* key) {
  const auto it = record.find(key);
  return it != record.end() && it->is_number() ? it->get<double>() : kNaN;
}

std::string xml_escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '&': out += "&amp;"; break;
      case '"': out += "&quot;"; break;
      default: out += c;
    }
  }
  return out;
}

// Appends printf-formatted text: a chart is many small fragments, and the compiler checks
// each format against its arguments.
__attribute__((format(printf, 2, 3))) void print(std::string& out, const char* format, ...) {
  va_list args, again;
  va_start(args, format);
  va_copy(again, args);
  const int length = std::vsnprintf(nullptr, 0, format, args);
  va_end(args);
  const std::size_t at = out.size();
  out.resize(at + length + 1);  // room for vsnprintf's terminating NUL, dropped below
  std::vsnprintf(out.data() + at, length + 1, format, again);
  va_end(again);
  out.resize(at + length);
}

// A round tick spacing that puts about `ticks` ticks over `span`.
double tick_step(double span, int ticks) {
  const double raw = span / ticks;
  const double mag = std::pow(10.0, std::floor(std::log10(raw)));
  for (double m : {1.0, 2.0, 5.0})
    if (m * mag >= raw) return m * mag;
  return 10 * mag;
}

// A token count as a label: 1K = 1024 and 1M = 1024 * 1024, since context lengths are
// powers of two; a count that is no whole number of either is written out in full.
std::string format_count(std::int64_t n) {
  constexpr std::int64_t kKi = 1024, kMi = 1024 * 1024;
  if (n != 0 && n % kMi == 0) return std::to_string(n / kMi) + "M";
  if (n != 0 && n % kKi == 0) return std::to_string(n / kKi) + "K";
  return std::to_string(n);
}

// A linear map from data values [lo, hi] onto pixels [from, to].
struct Scale {
  double lo, hi, from, to;
  double operator()(double v) const { return from + (to - from) * (v - lo) / (hi - lo); }
};

// Where a chart's plot area sits on its page; the margins around it hold the title, the
// legend, tick labels and axis titles.
struct Frame {
  double width, height;            // the page
  double left, top;                // the plot area's top-left corner
  double plot_width, plot_height;  // the plot area
  double right() const { return left + plot_width; }
  double bottom() const { return top + plot_height; }
};

// Line charts share one size, so that two of them side by side compare at a glance.
Frame line_chart_frame(int legend_rows) {
  const double legend_extra = 18.0 * std::max(legend_rows - 1, 0);
  return {800, 460 + legend_extra, 60, 56 + legend_extra, 720, 354};
}

void open_document(std::string& out, const Frame& frame, const std::string& title) {
  print(out,
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%g\" height=\"%g\" font-family=\"sans-serif\" "
        "font-size=\"12\">\n<rect width=\"100%%\" height=\"100%%\" fill=\"white\"/>\n"
        "<text x=\"%g\" y=\"20\" font-size=\"15\">%s</text>\n",
        frame.width, frame.height, frame.left, xml_escape(title).c_str());
}

// Axis titles: the x title centred under the plot area, the y title turned up its left side.
void draw_axis_titles(std::string& out, const Frame& frame, const char* x_title, const char* y_title) {
  const double y_middle = frame.top + frame.plot_height / 2;
  print(out,
        "<text x=\"%g\" y=\"%g\" text-anchor=\"middle\">%s</text>\n"
        "<text x=\"16\" y=\"%g\" text-anchor=\"middle\" transform=\"rotate(-90 16 %g)\">%s</text>\n",
        frame.left + frame.plot_width / 2, frame.bottom() + 40, x_title, y_middle, y_middle, y_title);
}

// The left and bottom axis lines of a line chart, with their titles.
void draw_axes(std::string& out, const Frame& frame, const char* x_title, const char* y_title) {
  print(out, "<polyline fill=\"none\" stroke=\"black\" points=\"%g,%g %g,%g %g,%g\"/>\n", frame.left, frame.top,
        frame.left, frame.bottom(), frame.right(), frame.bottom());
  draw_axis_titles(out, frame, x_title, y_title);
}

// Horizontal grid lines labelled at every multiple of `step` within the scale's values.
void draw_value_grid(std::string& out, const Frame& frame, const Scale& y, double step) {
  // An integer index: ceil of a hair below 0 is -0.0, which would print as "-0".
  for (long long i = std::llround(std::ceil(y.lo / step - 1e-9)); i * step <= y.hi + step * 1e-6; ++i) {
    const double v = double(i) * step;
    print(out,
          "<line x1=\"%g\" y1=\"%.1f\" x2=\"%g\" y2=\"%.1f\" stroke=\"#e8e8e8\"/>"
          "<text x=\"%g\" y=\"%.1f\" text-anchor=\"end\">%g</text>\n",
          frame.left, y(v), frame.right(), y(v), frame.left - 6, y(v) + 4, v);
  }
}

void draw_x_tick(std::string& out, const Frame& frame, double x, const std::string& label) {
  print(out,
        "<line x1=\"%.1f\" y1=\"%g\" x2=\"%.1f\" y2=\"%g\" stroke=\"black\"/>"
        "<text x=\"%.1f\" y=\"%g\" text-anchor=\"middle\">%s</text>\n",
        x, frame.bottom(), x, frame.bottom() + 5, x, frame.bottom() + 18, label.c_str());
}

using Points = std::vector<std::pair<double, double>>;  // (x, y) in pixels

constexpr const char* kDashes = "6 4";  // the stroke-dasharray of held-out series

void draw_polyline(std::string& out, const char* colour, bool dashed, const Points& points) {
  print(out, "<polyline fill=\"none\" stroke=\"%s\" stroke-width=\"1.8\" ", colour);
  if (dashed) print(out, "stroke-dasharray=\"%s\" ", kDashes);
  out += "points=\"";
  for (const auto& [x, y] : points) print(out, "%.1f,%.1f ", x, y);
  out += "\"/>\n";
}

void draw_dots(std::string& out, const char* colour, const Points& points) {
  for (const auto& [x, y] : points)
    print(out, "<circle cx=\"%.1f\" cy=\"%.1f\" r=\"2.5\" fill=\"%s\"/>\n", x, y, colour);
}

struct LegendEntry {
  const char* label;
  const char* colour;
  bool dashed;
};

// Three legend entries a row: six labels 210 px apart would run off an 800 px page.
constexpr int kLegendColumns = 3;

int legend_rows(std::size_t entries) { return int((entries + kLegendColumns - 1) / kLegendColumns); }

void draw_legend(std::string& out, const Frame& frame, const std::vector<LegendEntry>& entries) {
  for (std::size_t i = 0; i < entries.size(); ++i) {
    const double x = frame.left + 235.0 * (i % kLegendColumns), y = 36 + 18.0 * (i / kLegendColumns);
    print(out, "<line x1=\"%g\" y1=\"%g\" x2=\"%g\" y2=\"%g\" stroke=\"%s\" stroke-width=\"2.5\"", x, y, x + 18, y,
          entries[i].colour);
    if (entries[i].dashed) print(out, " stroke-dasharray=\"%s\"", kDashes);
    print(out, "/><text x=\"%g\" y=\"%g\">%s</text>\n", x + 24, y + 4, entries[i].label);
  }
}

// Accuracy in [0, 1] as a colour from red (0) through yellow (0.5) to green (1), the
// ColorBrewer RdYlGn ends, interpolated linearly in RGB.
std::string accuracy_colour(double accuracy) {
  struct Rgb {
    double r, g, b;
  };
  constexpr Rgb kRed{215, 48, 39}, kYellow{254, 224, 139}, kGreen{26, 152, 80};
  const double a = std::clamp(accuracy, 0.0, 1.0);
  const Rgb& from = a < 0.5 ? kRed : kYellow;
  const Rgb& to = a < 0.5 ? kYellow : kGreen;
  const double t = a < 0.5 ? a * 2 : a * 2 - 1;
  std::string out;
  print(out, "#%02x%02x%02x", int(std::lround(from.r + (to.r - from.r) * t)),
        int(std::lround(from.g + (to.g - from.g) * t)), int(std::lround(from.b + (to.b - from.b) * t)));
  return out;
}

constexpr const char* kNotRunColour = "#d0d0d0";

}  // namespace

std::vector<LossPoint> read_loss_curve(const std::string& metrics_path) {
  std::ifstream in(metrics_path);
  SPPO_CHECK(in.good(), "plot") << "cannot open the metrics file " << metrics_path
                                << " (write one with `sppo train --metrics FILE.jsonl`)";
  std::map<int, LossPoint> by_step;
  std::string line;
  int line_no = 0;
  while (std::getline(in, line)) {
    ++line_no;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    nlohmann::json record;
    try {
      record = nlohmann::json::parse(line);
    } catch (const nlohmann::json::parse_error&) {
      // A run killed mid-write leaves at most a torn last line; anything else is not ours.
      SPPO_CHECK(in.peek() == std::char_traits<char>::eof(), "plot")
          << metrics_path << " line " << line_no << " is not JSON; a metrics file holds one JSON object a line";
      break;
    }
    SPPO_CHECK(record.is_object(), "plot") << metrics_path << " line " << line_no << " is not a JSON object";
    if (record.value("summary", false)) continue;
    const auto step = record.find("step");
    SPPO_CHECK(step != record.end() && step->is_number_integer(), "plot")
        << metrics_path << " line " << line_no << " has no integer \"step\"";
    const double loss = number_or_nan(record, "loss");
    SPPO_CHECK(!std::isnan(loss), "plot") << metrics_path << " line " << line_no << " has no numeric \"loss\"";
    by_step[step->get<int>()] = {step->get<int>(),
                                 loss,
                                 number_or_nan(record, "loss_first_half"),
                                 number_or_nan(record, "loss_second_half"),
                                 number_or_nan(record, "eval_loss"),
                                 number_or_nan(record, "eval_loss_first_half"),
                                 number_or_nan(record, "eval_loss_second_half")};
  }
  SPPO_CHECK(!by_step.empty(), "plot") << metrics_path << " holds no step record; is it a `train --metrics` file?";
  std::vector<LossPoint> curve;
  for (const auto& [s, p] : by_step) curve.push_back(p);
  return curve;
}

std::string svg_loss_curve(const std::vector<LossPoint>& curve, const std::string& title) {
  SPPO_ASSERT(!curve.empty());
  struct Series {
    LegendEntry legend;  // dashed: a held-out series
    double LossPoint::*field;
  };
  const Series all[] = {{{"whole sequence", "#202124", false}, &LossPoint::loss},
                        {{"first half (near positions)", "#4c8bf5", false}, &LossPoint::loss_first_half},
                        {{"second half (far positions)", "#ea4335", false}, &LossPoint::loss_second_half},
                        {{"held-out, whole", "#202124", true}, &LossPoint::eval_loss},
                        {{"held-out, first half", "#4c8bf5", true}, &LossPoint::eval_loss_first_half},
                        {{"held-out, second half", "#ea4335", true}, &LossPoint::eval_loss_second_half}};
  std::vector<Series> series;
  std::vector<LegendEntry> legend;
  double y_max = 0;
  for (const Series& s : all) {
    bool any = false;
    for (const LossPoint& p : curve) {
      const double v = p.*s.field;
      // Non-finite losses (skipped steps) leave a gap, not a spike.
      if (std::isfinite(v)) {
        any = true;
        y_max = std::max(y_max, v);
      }
    }
    if (!any) continue;
    series.push_back(s);
    legend.push_back(s.legend);
  }
  if (y_max <= 0) y_max = 1;
  const double x_min = curve.front().step, x_max = std::max(double(curve.back().step), x_min + 1);

  const Frame frame = line_chart_frame(legend_rows(legend.size()));
  const Scale x{x_min, x_max, frame.left, frame.right()};
  const Scale y{0, y_max, frame.bottom(), frame.top};

  std::string out;
  open_document(out, frame, title);
  draw_legend(out, frame, legend);
  draw_value_grid(out, frame, y, tick_step(y_max, 6));
  const double dx = tick_step(x_max - x_min, 8);
  for (double s = std::ceil(x_min / dx) * dx; s <= x_max; s += dx) {
    std::string label;
    print(label, "%g", s);
    draw_x_tick(out, frame, x(s), label);
  }
  draw_axes(out, frame, "step", "loss (nats a token)");
  for (const Series& s : series) {
    Points run;
    for (const LossPoint& p : curve) {
      const double v = p.*s.field;
      if (std::isfinite(v)) {
        run.emplace_back(x(p.step), y(v));
      } else if (!s.legend.dashed && !run.empty()) {
        // A training series breaks here; a held-out one has no value on most steps and
        // joins its evaluations across them.
        draw_polyline(out, s.legend.colour, false, run);
        run.clear();
      }
    }
    if (!run.empty()) draw_polyline(out, s.legend.colour, s.legend.dashed, run);
    if (s.legend.dashed) draw_dots(out, s.legend.colour, run);
  }
  out += "</svg>\n";
  return out;
}

std::string svg_loss_by_position(const std::vector<PositionBin>& bins, const std::string& title) {
  struct Point {
    double position, loss;
  };
  std::vector<Point> points;
  for (const PositionBin& bin : bins) {
    if (bin.tokens == 0 || !std::isfinite(bin.loss)) continue;
    // The geometric middle sits halfway across the bin on the log axis; a bin from 0 has
    // none, and end / 2 keeps it as far from its neighbour as the bins beyond it.
    const double middle = bin.begin == 0 ? bin.end / 2.0 : std::sqrt(double(bin.begin) * double(bin.end));
    points.push_back({middle, bin.loss});
  }
  std::sort(points.begin(), points.end(), [](const Point& a, const Point& b) { return a.position < b.position; });

  // The x axis runs over log2(position) between the powers of two around the points.
  double log_lo = 0, log_hi = 10;  // 1 to 1K when there is nothing to draw
  double loss_lo = 0, loss_hi = 1;
  if (!points.empty()) {
    log_lo = std::floor(std::log2(points.front().position));
    log_hi = std::max(std::ceil(std::log2(points.back().position)), log_lo + 1);
    loss_lo = loss_hi = points.front().loss;
    for (const Point& p : points) {
      loss_lo = std::min(loss_lo, p.loss);
      loss_hi = std::max(loss_hi, p.loss);
    }
  }
  // Unlike a training curve, loss by position varies little: the y axis spans the values
  // (rounded out to ticks) rather than starting at 0, or the curve would be flat.
  const double span = loss_hi - loss_lo > 1e-9 ? loss_hi - loss_lo : std::max(std::abs(loss_hi) * 0.1, 1e-3);
  const double dy = tick_step(span, 5);
  const double y_lo = std::floor(loss_lo / dy) * dy;
  const double y_hi = std::max(std::ceil(loss_hi / dy) * dy, y_lo + dy);

  const Frame frame = line_chart_frame(1);
  const Scale x{log_lo, log_hi, frame.left, frame.right()};
  const Scale y{y_lo, y_hi, frame.bottom(), frame.top};

  std::string out;
  open_document(out, frame, title);
  draw_value_grid(out, frame, y, dy);
  // A tick at every power of two, or at every few once there are more than a dozen.
  const int every = std::max(1, int(std::ceil((log_hi - log_lo) / 12)));
  for (int k = int(log_lo); k <= int(log_hi); ++k) {
    if (k < 0 || k % every != 0) continue;
    draw_x_tick(out, frame, x(k), format_count(std::int64_t{1} << k));
  }
  draw_axes(out, frame, "token position", "loss (nats a token)");
  Points line;
  for (const Point& p : points) line.emplace_back(x(std::log2(p.position)), y(p.loss));
  if (!line.empty()) draw_polyline(out, "#202124", false, line);
  draw_dots(out, "#202124", line);
  out += "</svg>\n";
  return out;
}

std::string svg_accuracy_grid(const std::vector<GridCell>& cells, const std::string& title) {
  SPPO_CHECK(!cells.empty(), "plot") << "the passkey grid has no cell to draw";
  std::set<std::int64_t> lengths;
  std::set<double> depths;
  std::map<std::pair<std::int64_t, double>, double> accuracy;
  for (const GridCell& cell : cells) {
    lengths.insert(cell.length);
    depths.insert(cell.depth);
    SPPO_CHECK(accuracy.emplace(std::make_pair(cell.length, cell.depth), cell.accuracy).second, "plot")
        << "the passkey grid holds length " << cell.length << " at depth " << cell.depth << " twice";
  }

  constexpr double kCellWidth = 64, kCellHeight = 30;
  constexpr double kLegendHeight = 100;  // the colour bar, beside the cells
  const double cells_width = kCellWidth * lengths.size(), cells_height = kCellHeight * depths.size();
  // Room on the right for the colour legend, below it for the "n/a" swatch; at least as
  // wide as a title of a few words.
  const double width = std::max(90 + cells_width + 110, 520.0);
  const Frame frame{width, 56 + std::max(cells_height, kLegendHeight + 40) + 50, 90, 56, cells_width, cells_height};

  std::string out;
  open_document(out, frame, title);
  bool any_not_run = false;
  int column = 0;
  for (std::int64_t length : lengths) {
    const double x = frame.left + kCellWidth * column++;
    print(out, "<text x=\"%g\" y=\"%g\" text-anchor=\"middle\">%s</text>\n", x + kCellWidth / 2,
          frame.bottom() + 16, format_count(length).c_str());
    int row = 0;
    for (double depth : depths) {
      const double y = frame.top + kCellHeight * row++;
      const auto it = accuracy.find({length, depth});
      const bool run = it != accuracy.end() && std::isfinite(it->second);
      any_not_run |= !run;
      std::string text = "n/a";
      if (run) {
        text.clear();
        print(text, "%.2f", it->second);
      }
      print(out,
            "<rect class=\"cell\" x=\"%g\" y=\"%g\" width=\"%g\" height=\"%g\" fill=\"%s\" stroke=\"white\"/>"
            "<text x=\"%g\" y=\"%g\" text-anchor=\"middle\">%s</text>\n",
            x, y, kCellWidth, kCellHeight, run ? accuracy_colour(it->second).c_str() : kNotRunColour,
            x + kCellWidth / 2, y + kCellHeight / 2 + 4, text.c_str());
    }
  }
  int row = 0;
  for (double depth : depths) {
    print(out, "<text x=\"%g\" y=\"%g\" text-anchor=\"end\">%.3g%%</text>\n", frame.left - 6,
          frame.top + kCellHeight * row++ + kCellHeight / 2 + 4, depth * 100);
  }
  draw_axis_titles(out, frame, "context length (tokens)", "passkey depth");

  // The colour legend: a bar from 0 at the bottom to 1 at the top, with the stops that
  // accuracy_colour interpolates between, so the bar matches the cells exactly.
  const double bar_x = frame.right() + 24, bar_top = frame.top;
  print(out,
        "<defs><linearGradient id=\"accuracy\" x1=\"0\" y1=\"1\" x2=\"0\" y2=\"0\">"
        "<stop offset=\"0\" stop-color=\"%s\"/><stop offset=\"0.5\" stop-color=\"%s\"/>"
        "<stop offset=\"1\" stop-color=\"%s\"/></linearGradient></defs>\n"
        "<rect x=\"%g\" y=\"%g\" width=\"14\" height=\"%g\" fill=\"url(#accuracy)\"/>\n",
        accuracy_colour(0).c_str(), accuracy_colour(0.5).c_str(), accuracy_colour(1).c_str(), bar_x, bar_top,
        kLegendHeight);
  for (double level : {0.0, 0.5, 1.0}) {
    print(out, "<text x=\"%g\" y=\"%g\">%.1f</text>\n", bar_x + 20, bar_top + kLegendHeight * (1 - level) + 4, level);
  }
  if (any_not_run) {
    print(out,
          "<rect x=\"%g\" y=\"%g\" width=\"14\" height=\"14\" fill=\"%s\"/><text x=\"%g\" y=\"%g\">n/a</text>\n",
          bar_x, bar_top + kLegendHeight + 16, kNotRunColour, bar_x + 20, bar_top + kLegendHeight + 27);
  }
  out += "</svg>\n";
  return out;
}

}  // namespace sppo::io
