#include <gtest/gtest.h>

#include <cstring>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "core/check.h"
#include "io/fileutil.h"
#include "support/expect_error.h"
#include "io/safetensors.h"

namespace sppo::io {
namespace {

using ::sppo::testing::error_of;

std::string le64(std::uint64_t v) {
  std::string s;
  for (int i = 0; i < 8; ++i) s.push_back(static_cast<char>((v >> (8 * i)) & 0xFF));
  return s;
}

// A safetensors file from its parts, padded as the format asks unless told otherwise.
std::string make_file(std::string header, const std::string& data, bool pad = true) {
  if (pad) header.append((8 - header.size() % 8) % 8, ' ');
  return le64(header.size()) + header + data;
}

std::vector<float> random_floats(std::size_t n, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> d;
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

TEST(IoSafetensors, ReadsAFileWrittenByteByByte) {
  TempDir tmp("sppo-io-test");
  // "b" is listed first but stored second: the reader must go by data_offsets.
  const std::string header =
      R"({"b":{"dtype":"I32","shape":[1,1],"data_offsets":[8,12]},)"
      R"("__metadata__":{"format":"pt"},)"
      R"("a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  std::string data;
  for (unsigned char c : {0x00, 0x00, 0xC0, 0x3F,    // 1.5f
                          0x00, 0x00, 0x00, 0xC0,    // -2.0f
                          0x07, 0x00, 0x00, 0x00})   // int32 7
    data.push_back(static_cast<char>(c));
  const std::string path = tmp.file("hand.safetensors");
  write_file_atomic(path, make_file(header, data));

  SafetensorsReader r(path);
  ASSERT_EQ(r.tensors().size(), 2u);
  EXPECT_EQ(r.tensors()[0].name, "a");
  EXPECT_EQ(r.tensors()[1].name, "b");
  EXPECT_EQ(r.metadata().at("format"), "pt");
  EXPECT_EQ(r.at("b").shape, (std::vector<std::int64_t>{1, 1}));
  EXPECT_EQ(r.at("b").dtype, DType::I32);
  float a[2] = {0, 0};
  r.read<float>("a", {2}, a);
  EXPECT_EQ(a[0], 1.5f);
  EXPECT_EQ(a[1], -2.0f);
  std::int32_t b = 0;
  r.read<std::int32_t>("b", {1, 1}, &b);
  EXPECT_EQ(b, 7);
  EXPECT_EQ(r.find("c"), nullptr);
  EXPECT_ERROR_WITH(r.at("c"), "no tensor named 'c'", "hand.safetensors");
}

TEST(IoSafetensors, WriterProducesTheStandardLayout) {
  TempDir tmp("sppo-io-test");
  const float w[3] = {1.0f, 2.0f, 3.0f};
  const std::uint32_t ids[2] = {5, 0xFFFFFFFFu};
  const std::string path = tmp.file("w.safetensors");
  const FileDigest d = write_safetensors(
      path, {{"w", DType::F32, {3}, w}, {"ids", DType::U32, {2, 1}, ids}}, {{"step", "12"}});

  const std::string bytes = read_file(path);
  EXPECT_EQ(d.size, bytes.size());
  EXPECT_EQ(d.xxh64, xxh64(bytes.data(), bytes.size()));
  std::uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= std::uint64_t{static_cast<unsigned char>(bytes[i])} << (8 * i);
  ASSERT_LE(8 + n, bytes.size());
  EXPECT_EQ((8 + n) % 8, 0u) << "header must be padded to a multiple of 8";
  const std::string header = bytes.substr(8, n);
  EXPECT_EQ(header.front(), '{');
  const auto json_end = header.find_last_of('}');
  EXPECT_EQ(header.find_first_not_of(' ', json_end + 1), std::string::npos) << "padding must be spaces";
  const auto j = nlohmann::json::parse(header);
  EXPECT_EQ(j["w"]["dtype"], "F32");
  EXPECT_EQ(j["w"]["shape"], nlohmann::json({3}));
  EXPECT_EQ(j["w"]["data_offsets"], nlohmann::json({0, 12}));
  EXPECT_EQ(j["ids"]["dtype"], "U32");
  EXPECT_EQ(j["ids"]["shape"], nlohmann::json({2, 1}));
  EXPECT_EQ(j["ids"]["data_offsets"], nlohmann::json({12, 20}));
  EXPECT_EQ(j["__metadata__"]["step"], "12");
  const std::string data = bytes.substr(8 + n);
  ASSERT_EQ(data.size(), 20u);
  EXPECT_EQ(std::memcmp(data.data(), w, 12), 0);
  EXPECT_EQ(std::memcmp(data.data() + 12, ids, 8), 0);
}

TEST(IoSafetensors, RoundTripsRandomTensorsOfEveryWritableType) {
  TempDir tmp("sppo-io-test");
  std::mt19937_64 rng(11);
  const auto big = random_floats(std::size_t{1} << 22, 1);  // 16 MiB
  const auto small = random_floats(7, 2);
  std::vector<double> f64(5);
  for (auto& x : f64) x = static_cast<double>(rng()) / 3.0;
  std::vector<std::int32_t> i32(6);
  for (auto& x : i32) x = static_cast<std::int32_t>(rng());
  std::vector<std::uint64_t> u64(3);
  for (auto& x : u64) x = rng();
  std::vector<std::uint32_t> u32(4);
  for (auto& x : u32) x = static_cast<std::uint32_t>(rng());
  const float scalar = 42.5f;
  const std::string path = tmp.file("rt.safetensors");
  write_safetensors(path, {{"big", DType::F32, {1024, 4096}, big.data()},
                           {"small", DType::F32, {7}, small.data()},
                           {"empty", DType::F32, {0, 5}, nullptr},
                           {"scalar", DType::F32, {}, &scalar},
                           {"f64", DType::F64, {5}, f64.data()},
                           {"i32", DType::I32, {2, 3}, i32.data()},
                           {"u64", DType::U64, {3}, u64.data()},
                           {"u32", DType::U32, {4}, u32.data()}},
                    {{"k", "v"}});

  SafetensorsReader r(path);
  EXPECT_EQ(r.tensors().size(), 8u);
  EXPECT_EQ(r.metadata().size(), 1u);
  std::vector<float> big2(big.size()), small2(small.size());
  r.read<float>("big", {1024, 4096}, big2.data());
  r.read<float>("small", {7}, small2.data());
  EXPECT_EQ(big2, big);
  EXPECT_EQ(small2, small);
  float scalar2 = 0;
  r.read<float>("scalar", {}, &scalar2);
  EXPECT_EQ(scalar2, scalar);
  r.read<float>("empty", {0, 5}, nullptr);
  std::vector<double> f64b(5);
  r.read<double>("f64", {5}, f64b.data());
  EXPECT_EQ(f64b, f64);
  std::vector<std::int32_t> i32b(6);
  r.read<std::int32_t>("i32", {2, 3}, i32b.data());
  EXPECT_EQ(i32b, i32);
  std::vector<std::uint64_t> u64b(3);
  r.read<std::uint64_t>("u64", {3}, u64b.data());
  EXPECT_EQ(u64b, u64);
  std::vector<std::uint32_t> u32b(4);
  r.read<std::uint32_t>("u32", {4}, u32b.data());
  EXPECT_EQ(u32b, u32);
}

TEST(IoSafetensors, WrongShapeOrDtypeIsRefusedAndBufferUntouched) {
  TempDir tmp("sppo-io-test");
  const auto w = random_floats(6, 3);
  const std::string path = tmp.file("s.safetensors");
  write_safetensors(path, {{"layer.0.w", DType::F32, {2, 3}, w.data()}});
  SafetensorsReader r(path);
  std::vector<float> out(6, -7.0f);
  EXPECT_ERROR_WITH(r.read<float>("layer.0.w", {3, 2}, out.data()), "layer.0.w", "[2, 3]", "[3, 2]",
                    "s.safetensors");
  std::vector<double> outd(6, -7.0);
  EXPECT_ERROR_WITH(r.read<double>("layer.0.w", {2, 3}, outd.data()), "stored as F32", "F64");
  EXPECT_EQ(out, std::vector<float>(6, -7.0f));
  EXPECT_EQ(outd, std::vector<double>(6, -7.0));
}

TEST(IoSafetensors, WriterRefusesBadInput) {
  TempDir tmp("sppo-io-test");
  const float x = 1;
  const std::string path = tmp.file("bad.safetensors");
  EXPECT_ERROR_WITH(write_safetensors(path, {{"a", DType::F32, {1}, &x}, {"a", DType::F32, {1}, &x}}),
                    "'a'", "twice");
  EXPECT_ERROR_WITH(write_safetensors(path, {{"__metadata__", DType::F32, {1}, &x}}), "reserved");
  EXPECT_ERROR_WITH(write_safetensors(path, {{"n", DType::F32, {-1}, &x}}), "negative");
  EXPECT_ERROR_WITH(write_safetensors(path, {{"z", DType::F32, {1}, nullptr}}), "null");
  EXPECT_FALSE(std::filesystem::exists(path));
}

TEST(IoSafetensors, EveryTruncationIsRefused) {
  TempDir tmp("sppo-io-test");
  const auto w = random_floats(10, 4);
  const std::string good = tmp.file("good.safetensors");
  write_safetensors(good, {{"w", DType::F32, {10}, w.data()}, {"v", DType::F32, {0}, nullptr}});
  const std::string bytes = read_file(good);
  const std::string cut = tmp.file("cut.safetensors");
  for (std::size_t len = 0; len < bytes.size(); ++len) {
    write_file_atomic(cut, std::string_view(bytes.data(), len));
    const std::string msg = error_of([&] { SafetensorsReader r(cut); });
    EXPECT_NE(msg.find("cut.safetensors"), std::string::npos) << "length " << len << ": '" << msg << "'";
  }
  // Appended bytes are refused too: nothing may follow the last tensor.
  write_file_atomic(cut, bytes + "x");
  EXPECT_ERROR_WITH(SafetensorsReader r(cut), "trailing");
}

TEST(IoSafetensors, CorruptHeadersAreRefusedWithReasons) {
  TempDir tmp("sppo-io-test");
  const std::string path = tmp.file("c.safetensors");
  const std::string d12(12, '\0');
  auto check = [&](const std::string& file, std::initializer_list<const char*> parts) {
    write_file_atomic(path, file);
    const std::string msg = error_of([&] { SafetensorsReader r(path); });
    EXPECT_FALSE(msg.empty()) << "accepted: " << file.substr(8);
    EXPECT_NE(msg.find("c.safetensors"), std::string::npos) << msg;
    for (const char* p : parts) EXPECT_NE(msg.find(p), std::string::npos) << "lacks \"" << p << "\": " << msg;
  };
  check(le64(1000) + "{}", {"header length 1000"});
  check(le64(std::uint64_t{1} << 40) + "{}", {"limit"});
  check(make_file(R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,12]})", d12), {"not valid JSON"});
  check(make_file(R"([1,2])", ""), {"JSON object"});
  check(make_file(R"({"a":{"dtype":"F33","shape":[3],"data_offsets":[0,12]}})", d12), {"'a'", "unknown dtype", "F33"});
  check(make_file(R"({"a":{"shape":[3],"data_offsets":[0,12]}})", d12), {"'a'", "dtype"});
  check(make_file(R"({"a":{"dtype":"F32","shape":[-3],"data_offsets":[0,12]}})", d12), {"'a'", "non-negative"});
  check(make_file(R"({"a":{"dtype":"F32","shape":[1.5],"data_offsets":[0,12]}})", d12), {"'a'", "non-negative"});
  check(make_file(R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,16]}})", d12), {"'a'", "run past"});
  check(make_file(R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[12,0]}})", d12), {"'a'", "begin <= end"});
  check(make_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,12]}})", d12), {"'a'", "needs 2 x 4"});
  check(make_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                  R"("b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", std::string(8, '\0')),
        {"'b'", "overlaps"});
  check(make_file(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                  R"("b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}})", d12),
        {"'b'", "holes"});
  check(make_file(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                  R"("a":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})", d12),
        {"'a' twice"});
  check(make_file(R"({"__metadata__":{"k":1},"a":{"dtype":"F32","shape":[3],"data_offsets":[0,12]}})", d12),
        {"__metadata__", "string"});
}

TEST(IoSafetensors, UnpaddedHeaderFromOtherWritersIsAccepted) {
  TempDir tmp("sppo-io-test");
  const std::string path = tmp.file("u.safetensors");
  write_file_atomic(path, make_file(R"({"a":{"dtype":"U8","shape":[3],"data_offsets":[0,3]}})", "xyz", false));
  SafetensorsReader r(path);
  EXPECT_EQ(r.at("a").dtype, DType::U8);
  EXPECT_EQ(r.at("a").nbytes(), 3u);
}

}  // namespace
}  // namespace sppo::io
