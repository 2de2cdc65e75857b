// Test helper: writes token files in the formats the data sources read.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "io/fileutil.h"

namespace sppo::testing {

template <typename T>
inline std::string le_bytes(const std::vector<T>& v) {
  std::string s(v.size() * sizeof(T), '\0');
  if (!v.empty()) std::memcpy(s.data(), v.data(), s.size());
  return s;
}

template <typename T>
inline void put(std::string& s, T v) {
  s.append(reinterpret_cast<const char*>(&v), sizeof v);
}

// Writes PREFIX.bin and PREFIX.idx in the MMIDIDX layout (version 1): magic, version,
// dtype code, sequence count, document count, int32 sizes, int64 byte pointers, int64
// document boundaries. `gap` bytes of junk precede every sequence in the .bin, so the
// reader must follow the pointers rather than assume contiguity.
template <typename T>
inline void write_megatron(const std::string& prefix, std::uint8_t code,
                    const std::vector<std::vector<std::vector<T>>>& docs, std::size_t gap) {
  std::string bin;
  std::vector<std::int32_t> sizes;
  std::vector<std::int64_t> pointers, doc_idx{0};
  for (const auto& doc : docs) {
    for (const auto& seq : doc) {
      bin.append(gap, '\x7f');
      pointers.push_back(static_cast<std::int64_t>(bin.size()));
      sizes.push_back(static_cast<std::int32_t>(seq.size()));
      bin += le_bytes(seq);
    }
    doc_idx.push_back(static_cast<std::int64_t>(sizes.size()));
  }
  std::string idx("MMIDIDX\0\0", 9);
  put<std::uint64_t>(idx, 1);
  put<std::uint8_t>(idx, code);
  put<std::uint64_t>(idx, sizes.size());
  put<std::uint64_t>(idx, doc_idx.size());
  idx += le_bytes(sizes) + le_bytes(pointers) + le_bytes(doc_idx);
  io::write_file_atomic(prefix + ".bin", bin);
  io::write_file_atomic(prefix + ".idx", idx);
}

}  // namespace sppo::testing
