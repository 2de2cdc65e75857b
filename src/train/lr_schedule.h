// The learning rate over a run (train --lr-schedule, --lr, --warmup, --min-lr,
// --decay-steps).
//
// Note [Learning-rate schedules]: every schedule warms up linearly over the first `warmup`
// steps (step k at peak x (k + 1) / warmup), then, over a run laid out for `planned` steps
// (its --steps; a resumed run keeps the first run's, state.json's "schedule_steps"):
//  - cosine (the default): half a cosine from the peak down to the floor at step planned;
//  - linear: a straight line from the peak down to the floor at step planned;
//  - constant: the peak (the floor unused);
//  - wsd (warm-up, stable, decay: MiniCPM, Hu et al. 2024): the peak until `decay` steps
//    before planned, then a straight line down to the floor at step planned; `decay` is
//    --decay-steps, or a tenth of the planned steps (at least 1).
// The floor is --min-lr, or a tenth of the peak. Past step planned (a run given more
// --steps on resuming) the rate stays where the schedule ended: the floor, or the peak for
// constant. The schedule's name and numbers are among the options a checkpoint records, so
// --resume continues it.
#pragma once

#include <string>

namespace sppo {

enum class LrShape : char { Cosine, Linear, Constant, Wsd };

// "cosine", "linear", "constant" or "wsd"; anything else is an sppo::Error naming them.
LrShape parse_lr_shape(const std::string& name);
const char* to_string(LrShape s);

struct LrSchedule {
  LrShape shape = LrShape::Cosine;
  double peak = 5e-3;
  int warmup = 20;
  double min_lr = -1;   // the floor; below 0: a tenth of the peak
  int decay_steps = 0;  // wsd's decay; 0: a tenth of the planned steps, at least 1

  double floor() const { return min_lr >= 0 ? min_lr : 0.1 * peak; }
  // The steps wsd's decay takes in a run laid out for `planned` steps.
  int decay(int planned) const;
  // The learning rate of step `step` (from 0) of a run laid out for `planned` steps.
  double at(int step, int planned) const;
  // After the warm-up, in words: "cosine decay to 0.0005", "constant", ...
  std::string describe(int planned) const;
};

// Refuses a schedule a run of `steps` steps cannot follow, naming what works.
void check_lr_schedule(const LrSchedule& s, int steps);

}  // namespace sppo
