// Test helper: run a statement that must throw sppo::Error, and check its message names
// what the user needs to read (the file, the field, the value, what would work).
#pragma once

#include <gtest/gtest.h>

#include <string>

#include "core/check.h"

namespace sppo::testing {

// The message of the sppo::Error that f() throws, or "" when it throws none.
template <typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

}  // namespace sppo::testing

#define EXPECT_ERROR_WITH(stmt, ...)                                          \
  do {                                                                        \
    const std::string msg_ = ::sppo::testing::error_of([&] { stmt; });        \
    EXPECT_FALSE(msg_.empty()) << "no sppo::Error from: " #stmt;              \
    for (const char* part_ : {__VA_ARGS__})                                   \
      EXPECT_NE(msg_.find(part_), std::string::npos)                          \
          << "message lacks \"" << part_ << "\": " << msg_;                   \
  } while (0)
