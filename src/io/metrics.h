// Metrics as JSON Lines: one JSON object per line, flushed after every line so that a
// crashed run keeps everything it logged and `tail -f` shows progress.
#pragma once

#include <cstdio>
#include <nlohmann/json.hpp>
#include <string>

namespace sppo::io {

class JsonlWriter {
 public:
  enum class Mode { Truncate, Append };

  JsonlWriter(const std::string& path, Mode mode);
  ~JsonlWriter();
  JsonlWriter(const JsonlWriter&) = delete;
  JsonlWriter& operator=(const JsonlWriter&) = delete;

  // `record` must be a JSON object; it is written compactly on one line and flushed.
  void write(const nlohmann::json& record);
  void close();  // checked; the destructor closes unchecked if close() was not called
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  std::FILE* file_ = nullptr;
};

}  // namespace sppo::io
