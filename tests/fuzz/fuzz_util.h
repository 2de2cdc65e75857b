// Shared by the fuzz targets: a scratch directory for inputs that the readers take as
// files, and the rule every target follows.
//
// The rule: a reader given any bytes either succeeds or throws sppo::Error (a message for
// the user). Anything else -- another exception, which the CLI would not catch, an
// assertion, a sanitizer report, a hang -- is a bug, and libFuzzer stops on it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <unistd.h>

#include "io/fileutil.h"

namespace sppo::fuzz {

// A directory for this process, on tmpfs where there is one (inputs are files).
inline const io::TempDir& scratch() {
  static const io::TempDir dir = [] {
    if (access("/dev/shm", W_OK) == 0) setenv("TMPDIR", "/dev/shm", 1);
    return io::TempDir("sppo-fuzz");
  }();
  return dir;
}

// Writes `size` bytes to `name` in the scratch directory; returns its path.
inline std::string write_input(const std::string& name, const std::uint8_t* data, std::size_t size) {
  const std::string path = scratch().file(name);
  io::write_file_atomic(path, std::string_view(reinterpret_cast<const char*>(data), size));
  return path;
}

}  // namespace sppo::fuzz
