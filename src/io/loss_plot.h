// A training run's loss curve as an SVG plot, read from its metrics file (`train
// --metrics`, JSON Lines: one object a step, then a summary object). Drawn by sppo itself
// so that a run on a machine without a plotting stack still shows how it learned.
//
// The built-in long-range task (io/data.h, RepeatTask) makes the two halves of a sequence
// mean different things: targets in the first half are random symbols (near positions:
// best loss ln(alphabet)), those in the second half copies of the first half, predictable
// only by attending back half a sequence (far positions). The plot draws the loss of each
// half beside the whole sequence's, wherever the metrics carry them.
#pragma once

#include <string>
#include <vector>

namespace sppo::io {

struct LossPoint {
  int step = 0;
  double loss = 0;
  double loss_first_half = 0;   // NaN where the record has none (e.g. --objective mlm)
  double loss_second_half = 0;  // NaN where the record has none
};

// Every step record of a metrics file, in step order. A step logged twice (a run resumed
// after a crash appends to its file) keeps its last record. Summary lines ("summary":
// true) are skipped. Throws sppo::Error ("[plot] ...") naming the file and line when the
// file is missing, a line is not a JSON object, a record has no numeric "step" or "loss",
// or there is no step record at all.
std::vector<LossPoint> read_loss_curve(const std::string& metrics_path);

// The curve as a standalone SVG document: loss against step, one line per series that has
// values, a legend, axes with ticks. `title` heads the plot.
std::string svg_loss_curve(const std::vector<LossPoint>& curve, const std::string& title);

}  // namespace sppo::io
