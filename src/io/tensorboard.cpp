#include "io/tensorboard.h"

#include <unistd.h>

#include <array>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>

#include "core/check.h"

namespace sppo::io {

namespace {

constexpr std::uint32_t kCrc32cPolynomial = 0x82f63b78;  // reflected

std::array<std::uint32_t, 256> crc_table() {
  std::array<std::uint32_t, 256> t{};
  for (std::uint32_t i = 0; i < 256; ++i) {
    std::uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ kCrc32cPolynomial : c >> 1;
    t[i] = c;
  }
  return t;
}

std::uint32_t masked_crc(const void* data, std::size_t n) {
  const std::uint32_t c = crc32c(data, n);
  return ((c >> 15) | (c << 17)) + 0xa282ead8u;
}

// The protocol buffer wire format: a field's key is (number << 3) | wire type.
enum Wire : std::uint32_t { kVarint = 0, kFixed64 = 1, kBytes = 2, kFixed32 = 5 };

void varint(std::string& out, std::uint64_t v) {
  while (v >= 0x80) {
    out.push_back(char(v | 0x80));
    v >>= 7;
  }
  out.push_back(char(v));
}

void key(std::string& out, std::uint32_t field, Wire w) { varint(out, (field << 3) | w); }

template <typename T>
void little_endian(std::string& out, T v) {
  char b[sizeof v];
  std::memcpy(b, &v, sizeof v);  // every machine sppo builds for is little-endian
  out.append(b, sizeof v);
}

void bytes_field(std::string& out, std::uint32_t field, const std::string& v) {
  key(out, field, kBytes);
  varint(out, v.size());
  out += v;
}

// tensorflow.Event's fields: wall_time 1, step 2, file_version 3, summary 5.
std::string event_head(std::int64_t step) {
  std::string e;
  key(e, 1, kFixed64);
  little_endian(e, std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count());
  key(e, 2, kVarint);
  varint(e, std::uint64_t(step));
  return e;
}

}  // namespace

std::uint32_t crc32c(const void* data, std::size_t n) {
  static const std::array<std::uint32_t, 256> table = crc_table();
  const auto* p = static_cast<const unsigned char*>(data);
  std::uint32_t c = 0xffffffffu;
  for (std::size_t i = 0; i < n; ++i) c = table[(c ^ p[i]) & 0xff] ^ (c >> 8);
  return c ^ 0xffffffffu;
}

TensorboardWriter::TensorboardWriter(const std::string& dir) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  SPPO_CHECK(!ec && std::filesystem::is_directory(dir), "io")
      << "--tensorboard " << dir << ": cannot create the directory (" << ec.message() << ")";
  char host[256] = "localhost";
  gethostname(host, sizeof host - 1);
  const long long now = std::chrono::duration_cast<std::chrono::seconds>(
                            std::chrono::system_clock::now().time_since_epoch())
                            .count();
  path_ = (std::filesystem::path(dir) / ("events.out.tfevents." + std::to_string(now) + "." + host + "." +
                                         std::to_string(::getpid()) + ".sppo"))
              .string();
  file_ = std::fopen(path_.c_str(), "wb");
  SPPO_CHECK(file_ != nullptr, "io") << "--tensorboard: cannot write " << path_ << ": " << std::strerror(errno);
  std::string first = event_head(0);
  bytes_field(first, 3, "brain.Event:2");
  record(first);
}

TensorboardWriter::~TensorboardWriter() {
  if (file_) std::fclose(file_);
}

void TensorboardWriter::record(const std::string& event) {
  std::string r;
  little_endian(r, std::uint64_t(event.size()));
  little_endian(r, masked_crc(r.data(), 8));
  r += event;
  little_endian(r, masked_crc(event.data(), event.size()));
  SPPO_CHECK(std::fwrite(r.data(), 1, r.size(), file_) == r.size() && std::fflush(file_) == 0, "io")
      << "--tensorboard: writing " << path_ << " failed: " << std::strerror(errno);
}

void TensorboardWriter::scalars(std::int64_t step, const std::vector<std::pair<std::string, double>>& values) {
  // Summary { repeated Value value = 1 }, Value { string tag = 1; float simple_value = 2 }.
  std::string summary;
  for (const auto& [tag, v] : values) {
    std::string value;
    bytes_field(value, 1, tag);
    key(value, 2, kFixed32);
    little_endian(value, float(v));
    bytes_field(summary, 1, value);
  }
  std::string e = event_head(step);
  bytes_field(e, 5, summary);
  record(e);
}

}  // namespace sppo::io
