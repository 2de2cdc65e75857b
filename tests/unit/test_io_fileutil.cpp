#include <gtest/gtest.h>

#include <chrono>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "core/check.h"
#include "io/fileutil.h"
#include "support/expect_error.h"

namespace sppo::io {
namespace {

using ::sppo::testing::error_of;

namespace fs = std::filesystem;

std::vector<unsigned char> random_bytes(std::size_t n, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<unsigned char> v(n);
  for (auto& b : v) b = static_cast<unsigned char>(rng());
  return v;
}

// Published XXH64 digests (xxHash reference and python-xxhash documentation).
TEST(IoXxh64, KnownVectors) {
  auto h = [](const std::string& s, std::uint64_t seed = 0) { return xxh64(s.data(), s.size(), seed); };
  EXPECT_EQ(h(""), 0xEF46DB3751D8E999ULL);
  EXPECT_EQ(h("a"), 0xD24EC4F1A98C6E5BULL);
  EXPECT_EQ(h("abc"), 0x44BC2CF5AD770999ULL);
  EXPECT_EQ(h("Nobody inspects the spammish repetition"), 0xFBCEA83C8A378BF1ULL);
  EXPECT_EQ(h("xxhash", 20141025), 0xB559B98D844E0635ULL);
  EXPECT_EQ(hex64(0xFBCEA83C8A378BF1ULL), "fbcea83c8a378bf1");
  EXPECT_EQ(hex64(1), "0000000000000001");
}

TEST(IoXxh64, StreamingEqualsOneShotForAnySplit) {
  const auto data = random_bytes(1000, 1);
  std::mt19937_64 rng(2);
  for (std::size_t len : {0u, 1u, 3u, 4u, 7u, 8u, 31u, 32u, 33u, 63u, 64u, 65u, 999u, 1000u}) {
    const std::uint64_t want = xxh64(data.data(), len, 7);
    for (int trial = 0; trial < 20; ++trial) {
      Xxh64 h(7);
      std::size_t pos = 0;
      while (pos < len) {
        std::size_t n = std::min<std::size_t>(len - pos, rng() % 40);
        h.update(data.data() + pos, n);
        pos += n;
      }
      ASSERT_EQ(h.digest(), want) << "len " << len << " trial " << trial;
    }
  }
}

TEST(IoXxh64, DetectsEveryOneBitFlip) {
  auto data = random_bytes(256, 3);
  const std::uint64_t base = xxh64(data.data(), data.size());
  for (std::size_t i = 0; i < data.size(); ++i) {
    for (int bit = 0; bit < 8; ++bit) {
      data[i] ^= static_cast<unsigned char>(1u << bit);
      EXPECT_NE(xxh64(data.data(), data.size()), base) << "byte " << i << " bit " << bit;
      data[i] ^= static_cast<unsigned char>(1u << bit);
    }
  }
}

TEST(IoFiles, AtomicWriteCreatesReplacesAndDigests) {
  TempDir tmp("sppo-io-test");
  const std::string path = tmp.file("a.bin");
  const auto data = random_bytes(100000, 5);
  FileDigest d = write_file_atomic(path, [&](OutFile& f) {
    f.write(data.data(), 5);
    f.write(data.data() + 5, data.size() - 5);
  });
  EXPECT_EQ(d.size, data.size());
  EXPECT_EQ(d.xxh64, xxh64(data.data(), data.size()));
  const FileDigest on_disk = digest_file(path);
  EXPECT_EQ(on_disk.size, d.size);
  EXPECT_EQ(on_disk.xxh64, d.xxh64);
  EXPECT_EQ(read_file(path), std::string(data.begin(), data.end()));

  write_file_atomic(path, std::string_view("replaced"));
  EXPECT_EQ(read_file(path), "replaced");
  // Only the file itself remains: no temporary left behind.
  EXPECT_EQ(std::distance(fs::directory_iterator(tmp.path()), fs::directory_iterator()), 1);
}

TEST(IoFiles, FailedAtomicWriteLeavesOriginalAndNoTemporary) {
  TempDir tmp("sppo-io-test");
  const std::string path = tmp.file("keep.txt");
  write_file_atomic(path, std::string_view("original"));
  EXPECT_THROW(write_file_atomic(path,
                                 [](OutFile& f) {
                                   f.write(std::string_view("partial"));
                                   SPPO_CHECK(false, "test") << "writer gave up";
                                 }),
               Error);
  EXPECT_EQ(read_file(path), "original");
  EXPECT_EQ(std::distance(fs::directory_iterator(tmp.path()), fs::directory_iterator()), 1);
}

TEST(IoFiles, ErrorsNameThePath) {
  TempDir tmp("sppo-io-test");
  const std::string missing = tmp.file("nope/x.bin");
  EXPECT_NE(error_of([&] { InFile f(missing); }).find(missing), std::string::npos);
  EXPECT_NE(error_of([&] { write_file_atomic(missing, std::string_view("x")); }).find("nope"),
            std::string::npos);
  write_file_atomic(tmp.file("short"), std::string_view("abc"));
  InFile f(tmp.file("short"));
  char buf[8];
  const std::string msg = error_of([&] { f.read_at(1, buf, 5); });
  EXPECT_NE(msg.find("unexpected end"), std::string::npos) << msg;
}

TEST(IoFiles, MappedFileSeesContentAndEmptyFiles) {
  TempDir tmp("sppo-io-test");
  write_file_atomic(tmp.file("m"), std::string_view("hello"));
  MappedFile m(tmp.file("m"));
  ASSERT_EQ(m.size(), 5u);
  EXPECT_EQ(std::string(reinterpret_cast<const char*>(m.data()), 5), "hello");
  write_file_atomic(tmp.file("empty"), std::string_view(""));
  MappedFile e(tmp.file("empty"));
  EXPECT_EQ(e.size(), 0u);
  EXPECT_EQ(e.data(), nullptr);
}

TEST(IoFiles, TempDirIsRemoved) {
  std::string path;
  {
    TempDir tmp("sppo-io-test");
    path = tmp.path();
    write_file_atomic(tmp.file("x"), std::string_view("x"));
    fs::create_directory(tmp.file("sub"));
    EXPECT_TRUE(fs::is_directory(path));
  }
  EXPECT_FALSE(fs::exists(path));
}

}  // namespace
}  // namespace sppo::io
