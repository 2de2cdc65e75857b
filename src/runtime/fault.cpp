#include "runtime/fault.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace sppo {

const FaultPlan& fault_plan() {
  static const FaultPlan plan = [] {
    FaultPlan p;
    const char* v = std::getenv("SPPO_FAULT");
    if (!v) return p;
    char kind[16] = {};
    if (std::sscanf(v, "%15[a-z]:%d:%d", kind, &p.rank, &p.count) == 3) {
      if (std::strcmp(kind, "die") == 0) p.kind = FaultPlan::Kind::Die;
      if (std::strcmp(kind, "drop") == 0) p.kind = FaultPlan::Kind::Drop;
      if (std::strcmp(kind, "nan") == 0) p.kind = FaultPlan::Kind::Nan;
    }
    return p;
  }();
  return plan;
}

}  // namespace sppo
