#include "train/lr_schedule.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "core/check.h"

namespace sppo {

LrShape parse_lr_shape(const std::string& name) {
  for (LrShape s : {LrShape::Cosine, LrShape::Linear, LrShape::Constant, LrShape::Wsd})
    if (name == to_string(s)) return s;
  SPPO_CHECK(false, "options") << "--lr-schedule '" << name
                               << "' is not a schedule; use cosine (the default), linear, constant or wsd "
                                  "(warm-up, stable, decay over --decay-steps)";
  return LrShape::Cosine;
}

const char* to_string(LrShape s) {
  switch (s) {
    case LrShape::Cosine: return "cosine";
    case LrShape::Linear: return "linear";
    case LrShape::Constant: return "constant";
    case LrShape::Wsd: return "wsd";
  }
  return "?";
}

int LrSchedule::decay(int planned) const {
  return decay_steps > 0 ? decay_steps : std::max(1, int(std::lround(0.1 * planned)));
}

double LrSchedule::at(int step, int planned) const {
  if (warmup > 0 && step < warmup) return peak * double(step + 1) / double(warmup);
  if (shape == LrShape::Constant) return peak;
  const double lo = floor();
  if (shape == LrShape::Wsd) {
    const int begin = std::max(warmup, planned - decay(planned));
    if (step < begin) return peak;
    const double progress = std::min(1.0, double(step - begin) / double(std::max(1, planned - begin)));
    return peak + (lo - peak) * progress;
  }
  const double progress = std::min(1.0, double(step - warmup) / double(std::max(1, planned - warmup)));
  if (shape == LrShape::Linear) return peak + (lo - peak) * progress;
  return lo + (peak - lo) * 0.5 * (1.0 + std::cos(M_PI * progress));
}

std::string LrSchedule::describe(int planned) const {
  char buf[160];
  switch (shape) {
    case LrShape::Cosine: std::snprintf(buf, sizeof buf, "cosine decay to %g", floor()); break;
    case LrShape::Linear: std::snprintf(buf, sizeof buf, "linear decay to %g", floor()); break;
    case LrShape::Constant: std::snprintf(buf, sizeof buf, "constant"); break;
    case LrShape::Wsd:
      std::snprintf(buf, sizeof buf, "stable, then linear decay to %g over the last %d steps (wsd)", floor(),
                    decay(planned));
      break;
  }
  return buf;
}

void check_lr_schedule(const LrSchedule& s, int steps) {
  SPPO_CHECK(s.min_lr < 0 || (std::isfinite(s.min_lr) && s.min_lr <= s.peak), "options")
      << "--min-lr " << s.min_lr << " is not between 0 and the peak --lr " << s.peak
      << "; give a floor the schedule decays to, or leave it out (a tenth of --lr)";
  SPPO_CHECK(s.decay_steps >= 0, "options") << "--decay-steps must be 0 (a tenth of --steps) or positive (got "
                                            << s.decay_steps << ")";
  SPPO_CHECK(s.decay_steps == 0 || s.shape == LrShape::Wsd, "options")
      << "--decay-steps is the decay of --lr-schedule wsd; the " << to_string(s.shape)
      << " schedule decays over every step after the warm-up (use --lr-schedule wsd, or drop --decay-steps)";
  SPPO_CHECK(s.shape != LrShape::Wsd || s.warmup + s.decay(steps) <= steps, "options")
      << "--lr-schedule wsd over " << steps << " steps cannot warm up for " << s.warmup << " and decay for "
      << s.decay(steps) << "; use --decay-steps " << std::max(1, steps - s.warmup) << " or less, fewer --warmup "
      << "steps, or more --steps";
}

}  // namespace sppo
