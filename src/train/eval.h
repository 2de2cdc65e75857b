// Evaluation: SPPO's forward alone (Note [Forward-only steps] in schedule/builders.cpp) over
// held-out sequences, for `sppo eval` and for `train --eval-data`. Each sequence runs the
// step's schedule with nothing saved for a backward, so a budget that trains S tokens
// evaluates several times S. The figures are those the context-extension papers report:
// the loss over every counted token (position p predicts token p + 1), the loss by position
// in log-spaced bins, and, where labels are given, how often the most likely token is the
// label.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "comm/comm.h"
#include "io/data.h"
#include "io/loss_plot.h"
#include "runtime/executor.h"
#include "schedule/ir.h"
#include "train/options.h"
#include "train/parallel.h"

namespace sppo {

// Per-position sums over the sequences evaluated, the same on every rank.
struct EvalSums {
  std::vector<double> loss;    // [S] summed loss at each position
  std::vector<double> tokens;  // [S] sequences that count the position (a target there)
  std::vector<double> hits;    // [S] of them, where the most likely token was the target
  i64 sequences = 0;
  i64 peak_device_bytes = 0, peak_host_bytes = 0;  // the fullest rank's
  std::vector<i64> peak_device_per_rank, peak_host_per_rank;
  double seconds = 0;                              // the slowest rank's steps

  double mean_loss(i64 begin, i64 end) const;  // over the counted tokens of positions [begin, end)
  double total_tokens() const;
  double accuracy() const;  // over the counted tokens: meaningful where they are labels'
};

// Runs `sequences` sequences of S + 1 tokens from `data` (and `labels`, read in step; null:
// the next tokens are the targets) through forward-only schedule `fwd` on this rank's
// runtime; replica d runs sequences d, d + dp, ...; every rank reads all of them, so the
// sources advance alike everywhere. Collective over `comm`'s world group. `progress`, where
// given, hears after each sequence this rank ran: how many of its replica's it has run, of
// how many, and the seconds its steps took so far.
using EvalProgress = std::function<void(i64 done, i64 of, double seconds)>;
EvalSums evaluate(Runtime& rt, const sched::Schedule& fwd, const ParallelLayout& lay, comm::Comm& comm,
                  io::TokenSource& data, io::TokenSource* labels, i64 sequences, const EvalProgress& progress = {});

// Position bins [0, 16), [16, 32), [32, 64), ... up to S: the loss by position on a log scale.
std::vector<io::PositionBin> position_bins(const EvalSums& sums);

// Held-out data for `train --eval-data`: opened and checked for a run of S tokens a
// sequence (ids in the vocabulary, at least S + 1 tokens, one label per token), naming the
// option where they are not.
struct HeldOut {
  std::unique_ptr<io::TokenSource> data, labels;
  nlohmann::json start, labels_start;  // where each evaluation starts reading: the same sequences every time
};
HeldOut open_held_out(const std::string& data, const std::string& labels, const ModelConfig& c, i64 S,
                      std::uint64_t seed, const std::string& data_dtype);

struct EvalOptions {
  StepOptions step;  // forward_only
  std::string out;   // --out DIR: eval.json and loss_by_position.svg ("" none)
  i64 seqs = 0;      // --seqs: sequences to evaluate (0: every whole one of the data; the built-in task 1)
};

// `sppo eval`: --init's weights, the data's sequences through the forward-only step,
// printed and written to --out.
int run_eval(const EvalOptions& o);

}  // namespace sppo
