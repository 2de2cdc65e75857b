// Chrome trace JSON and the SVG timeline of a simulated step (declared in simulator.h).
#include <algorithm>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/config.h"
#include "sim/simulator.h"

#include <fstream>

#include "core/check.h"

namespace sppo::sim {

namespace {

const char* lane_name(Lane l) {
  switch (l) {
    case Lane::Compute: return "compute";
    case Lane::CopyOut: return "copy-out";
    case Lane::CopyIn: return "copy-in";
    case Lane::Network: return "network";
  }
  return "";
}

// Colour and legend class of an event.
struct Style {
  const char* label;
  const char* colour;
};

Style style_of(const TraceEvent& e) {
  using sched::OpKind;
  switch (e.kind) {
    case OpKind::Forward: return {"forward", "#4c8bf5"};
    case OpKind::Backward: return {"backward", "#34a853"};
    case OpKind::Offload: return {"offload", "#f29900"};
    case OpKind::Prefetch: return {"onload", "#a142f4"};
    case OpKind::WaitOffload:
    case OpKind::WaitPrefetch:
    case OpKind::Send:
    case OpKind::Recv:
    case OpKind::RingStep:
    case OpKind::AllReduce:
    case OpKind::ReduceScatter:
    case OpKind::AllGather:
    case OpKind::AllToAll: return {"communication", "#ea4335"};
  }
  return {"", "#000"};
}

constexpr double kMicros = 1e6;

std::string device_name(const SimResult& r, int d) {
  return d < int(r.names.size()) ? r.names[std::size_t(d)] : "device " + std::to_string(d);
}

std::string xml_escape(const std::string& t) {
  std::string o;
  for (char c : t) {
    if (c == '<') o += "&lt;";
    else if (c == '>') o += "&gt;";
    else if (c == '&') o += "&amp;";
    else if (c == '"') o += "&quot;";
    else o += c;
  }
  return o;
}

}  // namespace

std::string chrome_trace(const SimResult& r) {
  nlohmann::json events = nlohmann::json::array();
  const int ranks = int(r.peak_bytes.size());
  for (int d = 0; d < ranks; ++d) {
    events.push_back({{"ph", "M"}, {"pid", d}, {"name", "process_name"}, {"args", {{"name", device_name(r, d)}}}});
    for (Lane l : {Lane::Compute, Lane::CopyOut, Lane::CopyIn, Lane::Network})
      events.push_back({{"ph", "M"}, {"pid", d}, {"tid", int(l)}, {"name", "thread_name"}, {"args", {{"name", lane_name(l)}}}});
  }
  for (const TraceEvent& e : r.events)
    events.push_back({{"ph", "X"},
                      {"pid", e.rank},
                      {"tid", int(e.lane)},
                      {"name", e.name},
                      {"cat", style_of(e).label},
                      {"ts", e.start * kMicros},
                      {"dur", e.dur * kMicros}});
  for (size_t d = 0; d < r.memory.size(); ++d) {
    // Counter samples: keep the last value at each time.
    for (size_t k = 0; k < r.memory[d].size(); ++k) {
      if (k + 1 < r.memory[d].size() && r.memory[d][k + 1].first == r.memory[d][k].first) continue;
      events.push_back({{"ph", "C"},
                        {"pid", int(d)},
                        {"name", "memory"},
                        {"ts", r.memory[d][k].first * kMicros},
                        {"args", {{"GiB", double(r.memory[d][k].second) / (1 << 30)}}}});
    }
  }
  nlohmann::json j = {{"traceEvents", events},
                      {"displayTimeUnit", "ms"},
                      {"otherData",
                       {{"step_time_s", r.step_time_s},
                        {"tokens_per_device_per_s", r.tokens_per_device_per_s},
                        {"bubble_ratio", r.bubble_ratio},
                        {"exposed_copy_s", r.exposed_copy_s},
                        {"peak_device_bytes", r.peak_device_bytes}}}};
  return j.dump();
}

std::string svg_timeline(const SimResult& r, const std::string& title) {
  const int ranks = int(r.peak_bytes.size());
  const double W = 1200, left = 90, right = 20, plot = W - left - right;
  // Per rank: the compute row, then one thin lane each for copies out, copies in and the
  // network (labelled at the left), then device memory over time.
  const double row = 22, lane = 8, lanes = 3 * lane + 2, mem_row = 36, top = 50;
  const double rank_h = row + lanes + mem_row;
  const double T = r.step_time_s > 0 ? r.step_time_s : 1;
  const double height = top + ranks * rank_h + 70;
  auto x = [&](double t) { return left + plot * t / T; };
  std::ostringstream os;
  char buf[512];
  os << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << W << "\" height=\"" << height
     << "\" font-family=\"sans-serif\" font-size=\"11\">\n";
  os << "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n";
  std::snprintf(buf, sizeof buf,
                "<text x=\"%g\" y=\"18\" font-size=\"14\">%s: step %.4g s, %.4g tokens/device/s, bubble %.3f, "
                "peak %s</text>\n",
                left, xml_escape(title).c_str(), r.step_time_s, r.tokens_per_device_per_s, r.bubble_ratio,
                format_bytes(double(r.peak_device_bytes)).c_str());
  os << buf;
  // Legend.
  const Style legend[] = {{"forward", "#4c8bf5"}, {"backward", "#34a853"}, {"offload", "#f29900"},
                          {"onload", "#a142f4"}, {"communication", "#ea4335"}, {"memory", "#777777"}};
  double lx = left;
  for (const Style& s : legend) {
    std::snprintf(buf, sizeof buf, "<rect x=\"%g\" y=\"28\" width=\"12\" height=\"10\" fill=\"%s\"/><text x=\"%g\" y=\"37\">%s</text>\n",
                  lx, s.colour, lx + 16, s.label);
    os << buf;
    lx += 110;
  }
  i64 mem_max = 1;
  for (const auto& m : r.memory)
    for (const auto& [t, b] : m) mem_max = std::max(mem_max, b);
  auto lane_y = [&](int rank, Lane l) {
    const double y = top + rank * rank_h;
    return l == Lane::Compute ? y : y + row + 1 + (int(l) - 1) * lane;
  };
  for (int d = 0; d < ranks; ++d) {
    const double y = top + d * rank_h;
    std::snprintf(buf, sizeof buf, "<text x=\"4\" y=\"%g\">%s</text>\n<rect x=\"%g\" y=\"%g\" width=\"%g\" height=\"%g\" fill=\"#f4f4f4\"/>\n",
                  y + 14, xml_escape(device_name(r, d)).c_str(), left, y, plot, row);
    os << buf;
    for (Lane l : {Lane::CopyOut, Lane::CopyIn, Lane::Network}) {
      std::snprintf(buf, sizeof buf,
                    "<text x=\"%g\" y=\"%g\" font-size=\"8\" fill=\"#777777\" text-anchor=\"end\">%s</text>"
                    "<rect x=\"%g\" y=\"%g\" width=\"%g\" height=\"%g\" fill=\"#fafafa\"/>\n",
                    left - 4, lane_y(d, l) + lane - 1, lane_name(l), left, lane_y(d, l), plot, lane - 1);
      os << buf;
    }
    if (d < int(r.memory.size()) && !r.memory[d].empty()) {
      // Memory over time as a step line beneath the lanes, scaled to the largest peak.
      const double base = y + rank_h - 4, h = mem_row - 8;
      os << "<polyline fill=\"none\" stroke=\"#777777\" stroke-width=\"1\" points=\"";
      i64 prev = r.memory[d].front().second;
      for (const auto& [t, b] : r.memory[d]) {
        std::snprintf(buf, sizeof buf, "%.1f,%.1f %.1f,%.1f ", x(t), base - h * double(prev) / mem_max, x(t),
                      base - h * double(b) / mem_max);
        os << buf;
        prev = b;
      }
      std::snprintf(buf, sizeof buf, "%.1f,%.1f\"/>\n<text x=\"4\" y=\"%g\" fill=\"#777777\">%s</text>\n", x(T),
                    base - h * double(prev) / mem_max, base - 4, format_bytes(double(r.peak_bytes[d])).c_str());
      os << buf;
    }
  }
  // Compute fills its row (ops separated by a hairline); copies and messages fill their
  // lanes, at least a pixel wide so that short copies beside long compute stay visible.
  for (const TraceEvent& e : r.events) {
    const bool compute = e.lane == Lane::Compute;
    const Style s = style_of(e);
    std::snprintf(buf, sizeof buf,
                  "<rect x=\"%.2f\" y=\"%.2f\" width=\"%.2f\" height=\"%.2f\" fill=\"%s\"%s><title>%s</title></rect>\n",
                  x(e.start), lane_y(e.rank, e.lane), std::max(compute ? 0.3 : 1.0, plot * e.dur / T),
                  compute ? row : lane - 1, s.colour, compute ? " stroke=\"white\" stroke-width=\"0.4\"" : "",
                  xml_escape(e.name).c_str());
    os << buf;
  }
  // Time axis.
  const double ay = top + ranks * rank_h + 10;
  std::snprintf(buf, sizeof buf, "<line x1=\"%g\" y1=\"%g\" x2=\"%g\" y2=\"%g\" stroke=\"black\"/>\n", left, ay, left + plot, ay);
  os << buf;
  for (int k = 0; k <= 10; ++k) {
    const double t = T * k / 10;
    std::snprintf(buf, sizeof buf, "<line x1=\"%g\" y1=\"%g\" x2=\"%g\" y2=\"%g\" stroke=\"black\"/><text x=\"%g\" y=\"%g\" text-anchor=\"middle\">%.3g s</text>\n",
                  x(t), ay, x(t), ay + 5, x(t), ay + 18, t);
    os << buf;
  }
  os << "</svg>\n";
  return os.str();
}

void write_timelines(const SimResult& r, const std::string& trace_path, const std::string& svg_path,
                     const std::string& title) {
  auto write = [](const std::string& path, const std::string& text) {
    std::ofstream f(path);
    f << text;
    SPPO_CHECK(f.good(), "sim") << "cannot write " << path;
  };
  if (!trace_path.empty()) write(trace_path, chrome_trace(r));
  if (!svg_path.empty()) write(svg_path, svg_timeline(r, title));
}

}  // namespace sppo::sim
