// TensorBoard event files (Note [TensorBoard's event files] in io/tensorboard.h): CRC-32C
// against its published check value, and each record's framing read back byte by byte;
// tests/hf/check_tensorboard.py reads whole runs with TensorBoard's own loader.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>

#include "io/fileutil.h"
#include "io/tensorboard.h"
#include "support/expect_error.h"

namespace sppo::io {
namespace {

std::uint32_t masked(std::uint32_t c) { return ((c >> 15) | (c << 17)) + 0xa282ead8u; }

template <typename T>
T read_le(const std::string& s, std::size_t at) {
  T v;
  std::memcpy(&v, s.data() + at, sizeof v);
  return v;
}

TEST(Tensorboard, Crc32cIsCastagnolis) {
  EXPECT_EQ(crc32c("123456789", 9), 0xe3069283u);  // the CRC-32C check value (RFC 3720)
  EXPECT_EQ(crc32c("", 0), 0u);
  const std::string zeros(32, '\0');
  EXPECT_EQ(crc32c(zeros.data(), zeros.size()), 0x8a9136aau);  // RFC 3720, B.4: 32 bytes of zeros
}

TEST(Tensorboard, RecordsAreFramedAndCarryTheScalars) {
  TempDir dir("sppo-tb");
  std::string path;
  {
    TensorboardWriter w(dir.file("run"));
    path = w.path();
    w.scalars(7, {{"loss", 1.5}, {"peak_device_bytes", 4096}});
  }
  EXPECT_NE(std::filesystem::path(path).filename().string().find("events.out.tfevents."), std::string::npos);
  std::ifstream in(path, std::ios::binary);
  const std::string s((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<std::string> events;
  for (std::size_t at = 0; at < s.size();) {
    ASSERT_LE(at + 12, s.size());
    const auto n = read_le<std::uint64_t>(s, at);
    EXPECT_EQ(read_le<std::uint32_t>(s, at + 8), masked(crc32c(s.data() + at, 8)));
    ASSERT_LE(at + 12 + n + 4, s.size());
    const std::string event = s.substr(at + 12, n);
    EXPECT_EQ(read_le<std::uint32_t>(s, at + 12 + n), masked(crc32c(event.data(), event.size())));
    events.push_back(event);
    at += 12 + n + 4;
  }
  ASSERT_EQ(events.size(), 2u);
  EXPECT_NE(events[0].find("brain.Event:2"), std::string::npos);
  // Event.step = 7 (field 2, varint), then the summary with the tag and its float.
  EXPECT_NE(events[1].find(std::string("\x10\x07", 2)), std::string::npos);
  float v = 1.5f;
  EXPECT_NE(events[1].find("\x0a\x04loss\x15" + std::string(reinterpret_cast<const char*>(&v), 4)), std::string::npos);
  v = 4096.0f;
  EXPECT_NE(events[1].find("peak_device_bytes\x15" + std::string(reinterpret_cast<const char*>(&v), 4)),
            std::string::npos);
}

TEST(Tensorboard, ADirectoryItCannotMakeIsNamed) {
  TempDir dir("sppo-tb");
  std::ofstream(dir.file("file")) << "x";
  EXPECT_ERROR_WITH(TensorboardWriter(dir.file("file") + "/tb"), "--tensorboard", "file/tb");
}

}  // namespace
}  // namespace sppo::io
