// Test helper: the nominal CPU hardware profile written once to a file, for the setups
// whose adaptive choices need a profile's rates (the peaks they check do not depend on
// them), so that no test measures this machine.
#pragma once

#include <string>

#include "io/fileutil.h"
#include "planner/profile.h"
#include "train/profile_machine.h"

namespace sppo::testing {

inline const std::string& nominal_profile_path() {
  static io::TempDir dir("sppo-nominal-profile");
  static const std::string path = [] {
    const std::string p = dir.file("nominal.json");
    plan::save_profile(nominal_cpu_profile(), p);
    return p;
  }();
  return path;
}

}  // namespace sppo::testing
