#include "core/check.h"

#include <cstdio>
#include <cstdlib>

namespace sppo::detail {

void assert_fail(const char* expr, const char* file, int line, const std::string& msg) {
  std::fprintf(stderr, "%s:%d: bug: assertion failed: %s%s%s\n", file, line, expr,
               msg.empty() ? "" : ": ", msg.c_str());
  std::fflush(stderr);
  std::abort();
}

}  // namespace sppo::detail
