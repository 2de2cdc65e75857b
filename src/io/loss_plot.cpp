#include "io/loss_plot.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>

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

// A round tick spacing that puts about `ticks` ticks over `span`.
double tick_step(double span, int ticks) {
  const double raw = span / ticks;
  const double mag = std::pow(10.0, std::floor(std::log10(raw)));
  for (double m : {1.0, 2.0, 5.0})
    if (m * mag >= raw) return m * mag;
  return 10 * mag;
}

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
    by_step[step->get<int>()] = {step->get<int>(), loss, number_or_nan(record, "loss_first_half"),
                                 number_or_nan(record, "loss_second_half")};
  }
  SPPO_CHECK(!by_step.empty(), "plot") << metrics_path << " holds no step record; is it a `train --metrics` file?";
  std::vector<LossPoint> curve;
  for (const auto& [s, p] : by_step) curve.push_back(p);
  return curve;
}

std::string svg_loss_curve(const std::vector<LossPoint>& curve, const std::string& title) {
  SPPO_ASSERT(!curve.empty());
  struct Series {
    const char* label;
    const char* colour;
    double LossPoint::*field;
  };
  const Series all[] = {{"whole sequence", "#202124", &LossPoint::loss},
                        {"first half (near positions)", "#4c8bf5", &LossPoint::loss_first_half},
                        {"second half (far positions)", "#ea4335", &LossPoint::loss_second_half}};
  std::vector<Series> series;
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
    if (any) series.push_back(s);
  }
  if (y_max <= 0) y_max = 1;
  const double x_min = curve.front().step, x_max = std::max(double(curve.back().step), x_min + 1);

  const double W = 800, H = 460, left = 60, right = 20, top = 56, bottom = 50;
  const double pw = W - left - right, ph = H - top - bottom;
  auto x = [&](double s) { return left + pw * (s - x_min) / (x_max - x_min); };
  auto y = [&](double v) { return top + ph * (1 - v / y_max); };

  std::ostringstream os;
  char buf[512];
  std::snprintf(buf, sizeof buf,
                "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%g\" height=\"%g\" font-family=\"sans-serif\" "
                "font-size=\"12\">\n<rect width=\"100%%\" height=\"100%%\" fill=\"white\"/>\n"
                "<text x=\"%g\" y=\"20\" font-size=\"15\">%s</text>\n",
                W, H, left, xml_escape(title).c_str());
  os << buf;
  double lx = left;
  for (const Series& s : series) {
    std::snprintf(buf, sizeof buf,
                  "<line x1=\"%g\" y1=\"36\" x2=\"%g\" y2=\"36\" stroke=\"%s\" stroke-width=\"2.5\"/>"
                  "<text x=\"%g\" y=\"40\">%s</text>\n",
                  lx, lx + 18, s.colour, lx + 24, s.label);
    os << buf;
    lx += 210;
  }
  // Grid and axes.
  const double dy = tick_step(y_max, 6);
  for (double v = 0; v <= y_max * 1.0001; v += dy) {
    std::snprintf(buf, sizeof buf,
                  "<line x1=\"%g\" y1=\"%.1f\" x2=\"%g\" y2=\"%.1f\" stroke=\"#e8e8e8\"/>"
                  "<text x=\"%g\" y=\"%.1f\" text-anchor=\"end\">%g</text>\n",
                  left, y(v), left + pw, y(v), left - 6, y(v) + 4, v);
    os << buf;
  }
  const double dx = tick_step(x_max - x_min, 8);
  for (double s = std::ceil(x_min / dx) * dx; s <= x_max; s += dx) {
    std::snprintf(buf, sizeof buf,
                  "<line x1=\"%.1f\" y1=\"%g\" x2=\"%.1f\" y2=\"%g\" stroke=\"black\"/>"
                  "<text x=\"%.1f\" y=\"%g\" text-anchor=\"middle\">%g</text>\n",
                  x(s), top + ph, x(s), top + ph + 5, x(s), top + ph + 18, s);
    os << buf;
  }
  std::snprintf(buf, sizeof buf,
                "<polyline fill=\"none\" stroke=\"black\" points=\"%g,%g %g,%g %g,%g\"/>\n"
                "<text x=\"%g\" y=\"%g\" text-anchor=\"middle\">step</text>\n"
                "<text x=\"16\" y=\"%g\" text-anchor=\"middle\" transform=\"rotate(-90 16 %g)\">loss (nats a token)</text>\n",
                left, top, left, top + ph, left + pw, top + ph, left + pw / 2, H - 10, top + ph / 2, top + ph / 2);
  os << buf;
  // One polyline per run of finite values.
  for (const Series& s : series) {
    bool open = false;
    for (const LossPoint& p : curve) {
      const double v = p.*s.field;
      if (!std::isfinite(v)) {
        if (open) os << "\"/>\n";
        open = false;
        continue;
      }
      if (!open) {
        std::snprintf(buf, sizeof buf, "<polyline fill=\"none\" stroke=\"%s\" stroke-width=\"1.8\" points=\"",
                      s.colour);
        os << buf;
        open = true;
      }
      std::snprintf(buf, sizeof buf, "%.1f,%.1f ", x(p.step), y(v));
      os << buf;
    }
    if (open) os << "\"/>\n";
  }
  os << "</svg>\n";
  return os.str();
}

}  // namespace sppo::io
