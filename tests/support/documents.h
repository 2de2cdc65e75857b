// Test helper: a token file of random documents, each ended by token 0 (what --doc-sep 0
// --pack reads).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "io/fileutil.h"

namespace sppo::testing {

// Documents of 1 to max_len tokens (the last of each the separator 0, the others in [1, 60]),
// `tokens` or a few more in all, drawn from `seed`.
inline std::vector<std::uint16_t> random_documents(std::size_t tokens, std::uint32_t seed, std::uint32_t max_len) {
  std::vector<std::uint16_t> docs;
  std::uint32_t x = seed;
  while (docs.size() < tokens) {
    const std::uint32_t n = 1 + (x = x * 1103515245u + 12345u) % max_len;
    for (std::uint32_t k = 1; k < n; ++k) docs.push_back(std::uint16_t(1 + (x = x * 1103515245u + 12345u) % 60));
    docs.push_back(0);
  }
  return docs;
}

// Writes them as a raw .u16 token file.
inline void write_u16(const std::string& path, const std::vector<std::uint16_t>& tokens) {
  io::write_file_atomic(path, std::string_view(reinterpret_cast<const char*>(tokens.data()), tokens.size() * 2));
}

}  // namespace sppo::testing
