// Two kinds of check (docs/design.md, Conventions 6):
//  - SPPO_CHECK(cond, component) << "message": bad input from a user. Throws sppo::Error
//    whose text is "[component] message"; the CLI turns it into exit status 2.
//    SPPO_CHECK_FITS is the same for a run that does not fit its memory (a budget, the
//    machine): it throws sppo::DoesNotFit, exit status 3.
//  - SPPO_ASSERT(cond): an invariant of the engine. Aborts with file:line and "bug".
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace sppo {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

class DoesNotFit : public Error {
 public:
  explicit DoesNotFit(const std::string& what) : Error(what) {}
};

namespace detail {

// Collects the streamed message and throws when it goes out of scope.
class CheckFailure {
 public:
  explicit CheckFailure(const char* component, bool fits = false) : fits_(fits) { os_ << '[' << component << "] "; }
  CheckFailure(const CheckFailure&) = delete;
  CheckFailure& operator=(const CheckFailure&) = delete;
  [[noreturn]] ~CheckFailure() noexcept(false) {
    if (fits_) throw DoesNotFit(os_.str());
    throw Error(os_.str());
  }
  template <typename T>
  CheckFailure& operator<<(const T& v) {
    os_ << v;
    return *this;
  }

 private:
  std::ostringstream os_;
  bool fits_;
};

[[noreturn]] void assert_fail(const char* expr, const char* file, int line, const std::string& msg);

}  // namespace detail
}  // namespace sppo

#define SPPO_CHECK(cond, component) \
  if (cond) {                       \
  } else                            \
    ::sppo::detail::CheckFailure(component)

#define SPPO_CHECK_FITS(cond, component) \
  if (cond) {                            \
  } else                                 \
    ::sppo::detail::CheckFailure(component, true)

#define SPPO_ASSERT(cond)                                                 \
  do {                                                                    \
    if (!(cond)) ::sppo::detail::assert_fail(#cond, __FILE__, __LINE__, ""); \
  } while (0)

#define SPPO_ASSERT_MSG(cond, msg)                                           \
  do {                                                                       \
    if (!(cond)) {                                                           \
      std::ostringstream sppo_assert_os_;                                    \
      sppo_assert_os_ << msg;                                                \
      ::sppo::detail::assert_fail(#cond, __FILE__, __LINE__, sppo_assert_os_.str()); \
    }                                                                        \
  } while (0)
