// The data and safetensors readers at offsets past 2^31 tokens and 2^32 bytes, on sparse files:
// each file is sized with ftruncate (its holes take no disk and read as zeros) and holds real
// values only at its far end, which every test reads back. A token offset, byte offset or
// element count computed in 32 bits would read the wrong place, or refuse the file.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "core/check.h"
#include "io/data.h"
#include "io/fileutil.h"
#include "io/safetensors.h"
#include "support/expect_error.h"
#include "support/megatron.h"

namespace sppo::io {
namespace {

using ::sppo::testing::error_of;
using ::sppo::testing::le_bytes;
using ::sppo::testing::put;

constexpr std::int64_t k2to31 = std::int64_t{1} << 31;
constexpr std::uint64_t k2to32 = std::uint64_t{1} << 32;

// A file of `size` bytes that are all holes, then `bytes` written at each offset given.
void sparse_file(const std::string& path, std::uint64_t size,
                 const std::vector<std::pair<std::uint64_t, std::string>>& pieces) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  ASSERT_GE(fd, 0) << path;
  ASSERT_EQ(::ftruncate(fd, static_cast<off_t>(size)), 0) << path;
  for (const auto& [at, bytes] : pieces)
    ASSERT_EQ(::pwrite(fd, bytes.data(), bytes.size(), static_cast<off_t>(at)), static_cast<ssize_t>(bytes.size()))
        << path << " at " << at;
  ASSERT_EQ(::close(fd), 0);
}

template <typename T>
std::vector<T> random_ids(std::size_t n, T lo, T hi, std::mt19937& rng) {
  std::uniform_int_distribution<std::int64_t> d(lo, hi);
  std::vector<T> v(n);
  for (T& x : v) x = static_cast<T>(d(rng));
  return v;
}

std::vector<std::int32_t> take(TokenSource& src, std::int64_t count) {
  std::vector<std::int32_t> v(static_cast<std::size_t>(count));
  src.next(v.data(), count);
  return v;
}

// A raw uint32 token file of 2^31 + 8192 tokens (8 GiB, sparse): windows at token offsets past
// 2^31 (byte offsets past 2^33), the wrap from its end to its start, and an id out of range at
// the far end reported with its true offsets.
TEST(IoOffsets64, RawTokensPast2to31) {
  TempDir dir;
  const std::string path = dir.file("tokens.u32");
  const std::int64_t n = k2to31 + 8192, tail = 4096;
  std::mt19937 rng(7);
  const std::vector<std::uint32_t> far = random_ids<std::uint32_t>(tail, 1, 49999, rng);
  sparse_file(path, std::uint64_t(n) * 4, {{std::uint64_t(n - tail) * 4, le_bytes(far)}});

  auto src = open_raw_tokens(path, TokenDType::U32, 50000);
  ASSERT_EQ(src->size(), n);
  // The last 1000 tokens, then the wrap to token 0 (a hole: id 0).
  src->seek({{"kind", "tokens-uint32"}, {"offset", n - 1000}, {"tokens", n}});
  const auto seq = take(*src, 1500);
  for (int i = 0; i < 1000; ++i) ASSERT_EQ(seq[i], std::int32_t(far[tail - 1000 + i])) << "token " << n - 1000 + i;
  for (int i = 1000; i < 1500; ++i) ASSERT_EQ(seq[i], 0) << "token " << i - 1000 << " after the wrap";
  EXPECT_EQ(src->position()["offset"].get<std::int64_t>(), 499);  // windows share one token
  // A window wholly past 2^31 tokens, read twice through a saved position.
  src->seek({{"kind", "tokens-uint32"}, {"offset", n - tail + 10}, {"tokens", n}});
  const nlohmann::json at = src->position();
  const auto a = take(*src, 2000);
  src->seek(at);
  EXPECT_EQ(take(*src, 2000), a);
  for (int i = 0; i < 2000; ++i) ASSERT_EQ(a[i], std::int32_t(far[10 + i]));

  // An id past the vocabulary at token n - 3: its token and byte offsets in the message.
  const std::string bad_path = dir.file("bad.u32");
  sparse_file(bad_path, std::uint64_t(n) * 4, {{std::uint64_t(n - 3) * 4, le_bytes(std::vector<std::uint32_t>{60000})}});
  auto bad = open_raw_tokens(bad_path, TokenDType::U32, 50000);
  bad->seek({{"kind", "tokens-uint32"}, {"offset", n - 100}, {"tokens", n}});
  std::vector<std::int32_t> out(200);
  const std::string msg = error_of([&] { bad->next(out.data(), 200); });
  EXPECT_NE(msg.find("token id 60000 at token offset " + std::to_string(n - 3)), std::string::npos) << msg;
  EXPECT_NE(msg.find("byte offset " + std::to_string((n - 3) * 4)), std::string::npos) << msg;
}

// A Megatron dataset whose .bin passes 2^33 bytes: document 0 is a sequence of 2^31 - 1 uint16
// tokens and one right after it (one segment of more than 2^31 tokens, past 2^32 bytes),
// document 1 a sequence at byte 2^33. A window from document 0's end into document 1.
TEST(IoOffsets64, MegatronPast2to32Bytes) {
  TempDir dir;
  const std::string prefix = dir.file("corpus");
  const std::int32_t big = std::int32_t(k2to31 - 1), small = 4096;
  const std::uint64_t seq1_at = std::uint64_t(big) * 2, seq2_at = std::uint64_t{1} << 33;
  std::mt19937 rng(11);
  const std::vector<std::uint16_t> seq1 = random_ids<std::uint16_t>(small, 1, 65000, rng),
                                   seq2 = random_ids<std::uint16_t>(small, 1, 65000, rng);
  sparse_file(prefix + ".bin", seq2_at + std::uint64_t(small) * 2, {{seq1_at, le_bytes(seq1)}, {seq2_at, le_bytes(seq2)}});
  std::string idx("MMIDIDX\0\0", 9);
  put<std::uint64_t>(idx, 1);
  put<std::uint8_t>(idx, 8);  // uint16
  put<std::uint64_t>(idx, 3);
  put<std::uint64_t>(idx, 3);
  idx += le_bytes(std::vector<std::int32_t>{big, small, small});
  idx += le_bytes(std::vector<std::int64_t>{0, std::int64_t(seq1_at), std::int64_t(seq2_at)});
  idx += le_bytes(std::vector<std::int64_t>{0, 2, 3});
  write_file_atomic(prefix + ".idx", idx);

  auto src = open_megatron(prefix, 65536);
  const std::int64_t total = std::int64_t(big) + 2 * small, doc1 = std::int64_t(big) + small;
  ASSERT_EQ(src->size(), total);
  ASSERT_TRUE(src->has_documents());
  src->seek({{"kind", "megatron"}, {"offset", doc1 - 100}, {"tokens", total}});
  const auto seq = take(*src, 300);
  for (int i = 0; i < 100; ++i) ASSERT_EQ(seq[i], seq1[small - 100 + i]) << "token " << doc1 - 100 + i;
  for (int i = 100; i < 300; ++i) ASSERT_EQ(seq[i], seq2[i - 100]) << "token " << doc1 + i - 100;
  EXPECT_EQ(src->last_document_starts(), std::vector<std::int64_t>{100});
  // Document 0's first sequence is holes (id 0); its end meets the second sequence.
  src->seek({{"kind", "megatron"}, {"offset", std::int64_t(big) - 5}, {"tokens", total}});
  const auto join = take(*src, 10);
  for (int i = 0; i < 5; ++i) EXPECT_EQ(join[i], 0);
  for (int i = 5; i < 10; ++i) EXPECT_EQ(join[i], seq1[i - 5]);
}

// A safetensors file whose first tensor holds 2^31 + 8 bf16 elements (4 GiB of holes): its
// shape, size and offsets pass validation, and the tensor after it, at byte 2^32 + 16 of the
// data, reads back.
TEST(IoOffsets64, SafetensorsPast2to31Elements) {
  TempDir dir;
  const std::string path = dir.file("big.safetensors");
  const std::int64_t numel = k2to31 + 8;
  const std::uint64_t big_bytes = std::uint64_t(numel) * 2;
  std::vector<float> tail(1024);
  std::mt19937 rng(3);
  std::normal_distribution<float> nd;
  for (float& x : tail) x = nd(rng) + 10.0f;
  const std::string json = "{\"big\":{\"dtype\":\"BF16\",\"shape\":[" + std::to_string(numel) +
                           "],\"data_offsets\":[0," + std::to_string(big_bytes) + "]},\"tail\":{\"dtype\":\"F32\",\"shape\":[32,32],"
                           "\"data_offsets\":[" + std::to_string(big_bytes) + "," + std::to_string(big_bytes + 4096) + "]}}";
  std::string header;
  put<std::uint64_t>(header, json.size());
  header += json;
  const std::uint64_t data = header.size();
  sparse_file(path, data + big_bytes + 4096, {{0, header}, {data + big_bytes, le_bytes(tail)}});

  SafetensorsReader r(path);
  const TensorInfo& t = r.at("big");
  EXPECT_EQ(t.numel(), numel);
  EXPECT_EQ(t.nbytes(), big_bytes);
  EXPECT_EQ(r.at("tail").begin, big_bytes);
  std::vector<float> got(1024);
  r.read<float>("tail", {32, 32}, got.data());
  EXPECT_EQ(got, tail);
  // A shape one element short of the offsets' span is refused, naming both.
  const std::string bad = "{\"big\":{\"dtype\":\"BF16\",\"shape\":[" + std::to_string(numel - 1) +
                          "],\"data_offsets\":[0," + std::to_string(big_bytes) + "]}}";
  std::string h2;
  put<std::uint64_t>(h2, bad.size());
  h2 += bad;
  const std::string bad_path = dir.file("short.safetensors");
  sparse_file(bad_path, h2.size() + big_bytes, {{0, h2}});
  const std::string msg = error_of([&] { SafetensorsReader{bad_path}; });
  EXPECT_NE(msg.find("span " + std::to_string(big_bytes) + " bytes"), std::string::npos) << msg;
}

}  // namespace
}  // namespace sppo::io
