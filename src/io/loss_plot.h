// A training run's loss curve as an SVG plot, read from its metrics file (`train
// --metrics`, JSON Lines: one object a step, then a summary object). Drawn by sppo itself
// so that a run on a machine without a plotting stack still shows how it learned.
//
// The built-in long-range task (io/data.h, RepeatTask) makes the two halves of a sequence
// mean different things: targets in the first half are random symbols (near positions:
// best loss ln(alphabet)), those in the second half copies of the first half, predictable
// only by attending back half a sequence (far positions). The plot draws the loss of each
// half beside the whole sequence's, wherever the metrics carry them.
//
// Held-out loss (`eval_loss*`, logged every K steps only) is drawn dashed beside the
// training series of the same colour. `sppo eval` draws two more charts here: loss against
// token position (log2 axis, the curve context-extension papers draw) and a passkey
// accuracy heat map over (context length, depth). Token counts are labelled in binary
// units: 1K = 1024, 1M = 1024 * 1024.
#pragma once

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

namespace sppo::io {

struct LossPoint {
  int step = 0;
  double loss = 0;
  double loss_first_half = 0;   // NaN where the record has none (e.g. --objective mlm)
  double loss_second_half = 0;  // NaN where the record has none
  // Held-out loss, NaN on the steps that ran no evaluation (most of them). NaN by default so
  // that a point built without them draws no held-out series.
  double eval_loss = std::numeric_limits<double>::quiet_NaN();
  double eval_loss_first_half = std::numeric_limits<double>::quiet_NaN();
  double eval_loss_second_half = std::numeric_limits<double>::quiet_NaN();
};

// Every step record of a metrics file, in step order. A step logged twice (a run resumed
// after a crash appends to its file) keeps its last record. Summary lines ("summary":
// true) are skipped. Throws sppo::Error ("[plot] ...") naming the file and line when the
// file is missing, a line is not a JSON object, a record has no numeric "step" or "loss",
// or there is no step record at all.
std::vector<LossPoint> read_loss_curve(const std::string& metrics_path);

// The curve as a standalone SVG document: loss against step, one line per series that has
// values, a legend, axes with ticks. `title` heads the plot. Training series break at
// non-finite values (a skipped step); held-out series are dashed, join their finite points
// across the steps between evaluations, and mark each one with a dot so that a single
// evaluation still shows.
std::string svg_loss_curve(const std::vector<LossPoint>& curve, const std::string& title);

// Mean loss over the evaluated tokens at positions [begin, end) of their sequences.
struct PositionBin {
  std::int64_t begin = 0, end = 0;
  double loss = 0;  // NaN when tokens == 0
  std::int64_t tokens = 0;
};

// Loss against token position as a standalone SVG document: a log2 x axis with ticks at
// powers of two, one dot per bin that holds tokens at the bin's geometric middle (end / 2
// for a bin that starts at 0), joined by a line. Empty bins are left out.
std::string svg_loss_by_position(const std::vector<PositionBin>& bins, const std::string& title);

// One passkey retrieval run: a haystack of `length` tokens with the passkey at `depth`.
struct GridCell {
  std::int64_t length = 0;
  double depth = 0;     // in [0, 1]: 0 puts the passkey at the haystack's start, 1 at its end
  double accuracy = 0;  // in [0, 1]; NaN if not run
};

// The passkey grid as a standalone SVG heat map: one column per distinct length
// (ascending), one row per distinct depth (0% at the top), each cell coloured from red (0)
// through yellow to green (1) with its accuracy printed inside. Cells not run (NaN, or a
// (length, depth) pair absent from `cells`) are grey and read "n/a". Throws sppo::Error
// ("[plot] ...") when `cells` is empty or holds a (length, depth) pair twice.
std::string svg_accuracy_grid(const std::vector<GridCell>& cells, const std::string& title);

}  // namespace sppo::io
