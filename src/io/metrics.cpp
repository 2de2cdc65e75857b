#include "io/metrics.h"

#include <cerrno>
#include <cstring>

#include "core/check.h"

namespace sppo::io {

namespace {
constexpr const char* kComponent = "metrics";
}

JsonlWriter::JsonlWriter(const std::string& path, Mode mode) : path_(path) {
  file_ = std::fopen(path.c_str(), mode == Mode::Append ? "ae" : "we");
  SPPO_CHECK(file_ != nullptr, kComponent)
      << "cannot open " << path << " for writing: " << std::strerror(errno)
      << " (check that the directory exists and is writable)";
}

JsonlWriter::~JsonlWriter() {
  if (file_ != nullptr) std::fclose(file_);
}

void JsonlWriter::write(const nlohmann::json& record) {
  SPPO_CHECK(file_ != nullptr, kComponent) << path_ << " is closed";
  SPPO_CHECK(record.is_object(), kComponent)
      << "a metrics record must be a JSON object, got " << record.type_name();
  // Replacing invalid UTF-8 keeps one bad string from aborting a long run's log.
  const std::string line = record.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
  SPPO_CHECK(std::fwrite(line.data(), 1, line.size(), file_) == line.size() && std::fflush(file_) == 0,
             kComponent)
      << "write to " << path_ << " failed: " << std::strerror(errno) << " (is the disk full?)";
}

void JsonlWriter::close() {
  if (file_ == nullptr) return;
  std::FILE* f = file_;
  file_ = nullptr;
  SPPO_CHECK(std::fclose(f) == 0, kComponent) << "close of " << path_ << " failed: " << std::strerror(errno);
}

}  // namespace sppo::io
