#include "io/fileutil.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <bit>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <vector>

#include "core/check.h"

namespace sppo::io {

static_assert(std::endian::native == std::endian::little,
              "the io formats (safetensors, token files, MMIDIDX) are little-endian; "
              "a big-endian host would need byte swaps");

namespace {

constexpr const char* kComponent = "io";
constexpr std::size_t kReadChunkBytes = std::size_t{8} << 20;  // 8 MiB per read in digest_file

std::string errno_text() { return std::strerror(errno); }

// ---- XXH64 ---------------------------------------------------------------------------

constexpr std::uint64_t kP1 = 0x9E3779B185EBCA87ULL;
constexpr std::uint64_t kP2 = 0xC2B2AE3D27D4EB4FULL;
constexpr std::uint64_t kP3 = 0x165667B19E3779F9ULL;
constexpr std::uint64_t kP4 = 0x85EBCA77C2B2AE63ULL;
constexpr std::uint64_t kP5 = 0x27D4EB2F165667C5ULL;

inline std::uint64_t load64(const unsigned char* p) {
  std::uint64_t v;
  std::memcpy(&v, p, 8);
  return v;
}

inline std::uint32_t load32(const unsigned char* p) {
  std::uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

inline std::uint64_t xxh_round(std::uint64_t acc, std::uint64_t input) {
  acc += input * kP2;
  acc = std::rotl(acc, 31);
  return acc * kP1;
}

inline std::uint64_t xxh_merge(std::uint64_t acc, std::uint64_t v) {
  acc ^= xxh_round(0, v);
  return acc * kP1 + kP4;
}

// Consumes whole 32-byte stripes; returns the number of bytes consumed.
std::size_t xxh_stripes(std::uint64_t v[4], const unsigned char* p, std::size_t bytes) {
  std::uint64_t v0 = v[0], v1 = v[1], v2 = v[2], v3 = v[3];
  std::size_t n = bytes / 32 * 32;
  for (std::size_t i = 0; i < n; i += 32) {
    v0 = xxh_round(v0, load64(p + i));
    v1 = xxh_round(v1, load64(p + i + 8));
    v2 = xxh_round(v2, load64(p + i + 16));
    v3 = xxh_round(v3, load64(p + i + 24));
  }
  v[0] = v0, v[1] = v1, v[2] = v2, v[3] = v3;
  return n;
}

std::uint64_t xxh_finish(std::uint64_t h, const unsigned char* p, std::size_t rem) {
  while (rem >= 8) {
    h ^= xxh_round(0, load64(p));
    h = std::rotl(h, 27) * kP1 + kP4;
    p += 8, rem -= 8;
  }
  if (rem >= 4) {
    h ^= std::uint64_t{load32(p)} * kP1;
    h = std::rotl(h, 23) * kP2 + kP3;
    p += 4, rem -= 4;
  }
  while (rem > 0) {
    h ^= std::uint64_t{*p} * kP5;
    h = std::rotl(h, 11) * kP1;
    ++p, --rem;
  }
  h ^= h >> 33;
  h *= kP2;
  h ^= h >> 29;
  h *= kP3;
  h ^= h >> 32;
  return h;
}

}  // namespace

Xxh64::Xxh64(std::uint64_t seed) : seed_(seed) {
  v_[0] = seed + kP1 + kP2;
  v_[1] = seed + kP2;
  v_[2] = seed;
  v_[3] = seed - kP1;
}

void Xxh64::update(const void* data, std::size_t bytes) {
  if (bytes == 0) return;  // data may be null then
  const auto* p = static_cast<const unsigned char*>(data);
  total_ += bytes;
  if (buffered_ > 0) {
    std::size_t take = std::min(bytes, 32 - buffered_);
    std::memcpy(buf_ + buffered_, p, take);
    buffered_ += take, p += take, bytes -= take;
    if (buffered_ < 32) return;
    xxh_stripes(v_, buf_, 32);
    buffered_ = 0;
  }
  std::size_t used = xxh_stripes(v_, p, bytes);
  p += used, bytes -= used;
  std::memcpy(buf_, p, bytes);
  buffered_ = bytes;
}

std::uint64_t Xxh64::digest() const {
  std::uint64_t h;
  if (total_ >= 32) {
    h = std::rotl(v_[0], 1) + std::rotl(v_[1], 7) + std::rotl(v_[2], 12) + std::rotl(v_[3], 18);
    for (int i = 0; i < 4; ++i) h = xxh_merge(h, v_[i]);
  } else {
    h = seed_ + kP5;
  }
  h += total_;
  return xxh_finish(h, buf_, buffered_);
}

std::uint64_t xxh64(const void* data, std::size_t bytes, std::uint64_t seed) {
  Xxh64 h(seed);
  h.update(data, bytes);
  return h.digest();
}

std::string hex64(std::uint64_t v) {
  char s[17];
  std::snprintf(s, sizeof s, "%016llx", static_cast<unsigned long long>(v));
  return s;
}

FileDigest digest_file(const std::string& path) {
  InFile f(path);
  std::vector<unsigned char> buf(std::min<std::uint64_t>(kReadChunkBytes, f.size()));
  Xxh64 h;
  for (std::uint64_t off = 0; off < f.size();) {
    std::size_t n = std::min<std::uint64_t>(buf.size(), f.size() - off);
    f.read_at(off, buf.data(), n);
    h.update(buf.data(), n);
    off += n;
  }
  return {f.size(), h.digest()};
}

// ---- OutFile -------------------------------------------------------------------------

OutFile::OutFile(const std::string& path) : path_(path) {
  fd_ = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  SPPO_CHECK(fd_ >= 0, kComponent) << "cannot create " << path << ": " << errno_text()
                                   << " (check that the directory exists and is writable)";
}

OutFile::~OutFile() {
  if (fd_ >= 0) ::close(fd_);
}

void OutFile::write(const void* data, std::size_t bytes) {
  SPPO_ASSERT(fd_ >= 0);
  hash_.update(data, bytes);
  const auto* p = static_cast<const char*>(data);
  while (bytes > 0) {
    ssize_t n = ::write(fd_, p, bytes);
    if (n < 0 && errno == EINTR) continue;
    SPPO_CHECK(n > 0, kComponent) << "write to " << path_ << " failed after " << written_
                                  << " bytes: " << (n < 0 ? errno_text() : "no progress")
                                  << " (is the disk full?)";
    p += n, bytes -= static_cast<std::size_t>(n), written_ += static_cast<std::uint64_t>(n);
  }
}

void OutFile::sync() {
  SPPO_ASSERT(fd_ >= 0);
  SPPO_CHECK(::fsync(fd_) == 0, kComponent) << "fsync of " << path_ << " failed: " << errno_text();
}

void OutFile::close() {
  if (fd_ < 0) return;
  int fd = fd_;
  fd_ = -1;
  SPPO_CHECK(::close(fd) == 0, kComponent) << "close of " << path_ << " failed: " << errno_text();
}

// ---- InFile --------------------------------------------------------------------------

InFile::InFile(const std::string& path) : path_(path) {
  fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  SPPO_CHECK(fd_ >= 0, kComponent) << "cannot open " << path << " for reading: " << errno_text();
  struct stat st;
  if (::fstat(fd_, &st) != 0) {
    std::string err = errno_text();
    ::close(fd_);
    SPPO_CHECK(false, kComponent) << "cannot stat " << path << ": " << err;
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd_);
    SPPO_CHECK(false, kComponent) << path << " is not a regular file";
  }
  size_ = static_cast<std::uint64_t>(st.st_size);
}

InFile::InFile(InFile&& o) noexcept : path_(std::move(o.path_)), fd_(o.fd_), size_(o.size_) {
  o.fd_ = -1;
}

InFile::~InFile() {
  if (fd_ >= 0) ::close(fd_);
}

void InFile::read_at(std::uint64_t offset, void* out, std::size_t bytes) const {
  SPPO_ASSERT(fd_ >= 0);
  auto* p = static_cast<char*>(out);
  std::uint64_t pos = offset;
  while (bytes > 0) {
    ssize_t n = ::pread(fd_, p, bytes, static_cast<off_t>(pos));
    if (n < 0 && errno == EINTR) continue;
    SPPO_CHECK(n >= 0, kComponent) << "read of " << path_ << " at byte " << pos
                                   << " failed: " << errno_text();
    SPPO_CHECK(n > 0, kComponent) << "unexpected end of " << path_ << " at byte " << pos
                                  << " (the file is shorter than expected; was it truncated "
                                     "while being read?)";
    p += n, bytes -= static_cast<std::size_t>(n), pos += static_cast<std::uint64_t>(n);
  }
}

// ---- MappedFile ----------------------------------------------------------------------

MappedFile::MappedFile(const std::string& path) : path_(path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  SPPO_CHECK(fd >= 0, kComponent) << "cannot open " << path << " for reading: " << errno_text();
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    std::string err = errno_text();
    ::close(fd);
    SPPO_CHECK(false, kComponent) << "cannot stat " << path << ": " << err;
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    SPPO_CHECK(false, kComponent) << path << " is not a regular file";
  }
  size_ = static_cast<std::uint64_t>(st.st_size);
  if (size_ > 0) {
    void* p = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0);
    if (p == MAP_FAILED) {
      std::string err = errno_text();
      ::close(fd);
      SPPO_CHECK(false, kComponent) << "mmap of " << path << " (" << size_ << " bytes) failed: " << err;
    }
    data_ = static_cast<const unsigned char*>(p);
  }
  // The mapping keeps the file alive; the descriptor is no longer needed.
  SPPO_CHECK(::close(fd) == 0, kComponent) << "close of " << path << " failed: " << errno_text();
}

MappedFile::~MappedFile() {
  if (data_ != nullptr) ::munmap(const_cast<unsigned char*>(data_), size_);
}

// ---- whole files ---------------------------------------------------------------------

std::string read_file(const std::string& path) {
  InFile f(path);
  std::string s(f.size(), '\0');
  f.read_at(0, s.data(), s.size());
  return s;
}

void fsync_dir(const std::string& dir) {
  int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  SPPO_CHECK(fd >= 0, kComponent) << "cannot open directory " << dir << " to fsync it: " << errno_text();
  int rc = ::fsync(fd);
  std::string err = rc != 0 ? errno_text() : "";
  ::close(fd);
  SPPO_CHECK(rc == 0, kComponent) << "fsync of directory " << dir << " failed: " << err;
}

FileDigest write_file_atomic(const std::string& path, const std::function<void(OutFile&)>& fill) {
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  FileDigest digest;
  try {
    OutFile f(tmp);
    fill(f);
    f.sync();
    f.close();
    digest = f.digest();
    SPPO_CHECK(::rename(tmp.c_str(), path.c_str()) == 0, kComponent)
        << "cannot rename " << tmp << " to " << path << ": " << errno_text();
  } catch (...) {
    ::unlink(tmp.c_str());
    throw;
  }
  std::filesystem::path parent = std::filesystem::path(path).parent_path();
  fsync_dir(parent.empty() ? "." : parent.string());
  return digest;
}

FileDigest write_file_atomic(const std::string& path, std::string_view bytes) {
  return write_file_atomic(path, [&](OutFile& f) { f.write(bytes); });
}

// ---- TempDir -------------------------------------------------------------------------

TempDir::TempDir(const std::string& prefix) {
  const char* base = std::getenv("TMPDIR");
  std::string templ = std::string(base != nullptr && *base != '\0' ? base : "/tmp") + "/" + prefix + "-XXXXXX";
  std::vector<char> buf(templ.begin(), templ.end());
  buf.push_back('\0');
  SPPO_CHECK(::mkdtemp(buf.data()) != nullptr, kComponent)
      << "mkdtemp(" << templ << ") failed: " << errno_text();
  path_ = buf.data();
}

TempDir::~TempDir() {
  std::error_code ec;
  std::filesystem::remove_all(path_, ec);  // best effort: a destructor must not throw
}

void check_output_file(const std::string& path, const char* option, bool make_parents) {
  namespace fs = std::filesystem;
  if (path.empty()) return;
  std::error_code ec;
  const fs::path p(path);
  SPPO_CHECK(!fs::is_directory(p, ec), "options") << option << " " << path << " is a directory; give a file name";
  const fs::path dir = p.has_parent_path() ? p.parent_path() : fs::path(".");
  if (make_parents && !fs::exists(dir, ec)) {
    fs::create_directories(dir, ec);
    SPPO_CHECK(!ec, "options") << option << " " << path << ": cannot create " << dir.string() << ": " << ec.message();
  }
  SPPO_CHECK(fs::is_directory(dir, ec), "options")
      << option << " " << path << ": the directory " << dir.string() << " does not exist; create it first";
  SPPO_CHECK(::access(dir.c_str(), W_OK) == 0 && (!fs::exists(p, ec) || ::access(p.c_str(), W_OK) == 0), "options")
      << option << " " << path << " is not writable";
}

}  // namespace sppo::io
