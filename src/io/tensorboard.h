// TensorBoard event files (train --tensorboard DIR): a run's scalars per step, beside its
// JSON Lines metrics, in the format TensorBoard reads.
//
// Note [TensorBoard's event files]: a file named events.out.tfevents.<seconds>.<host>.<pid>.sppo
// holds TFRecords: each an 8-byte little-endian length, the masked CRC-32C of those 8
// bytes, the record, and the masked CRC-32C of the record (mask: the CRC rotated right by
// 15 bits, plus 0xa282ead8). Each record is one serialized tensorflow.Event protocol
// buffer: the first carries file_version "brain.Event:2", each after it a wall time, the
// step and a Summary of (tag, simple_value) pairs, the value a 32-bit float as TensorBoard
// plots it. Written here by hand (the wire format's varints, fixed 32/64-bit fields and
// length-delimited fields), as neither protobuf's generated code nor a TFRecord writer is
// packaged for C++ in Debian. Every event is flushed as written, so a crashed run keeps
// what it logged; a resumed run writes a new file into the same directory, which
// TensorBoard reads as one run.
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

namespace sppo::io {

// CRC-32C (Castagnoli) of `n` bytes, as TFRecord frames each record.
std::uint32_t crc32c(const void* data, std::size_t n);

class TensorboardWriter {
 public:
  // Creates `dir` where it does not exist; throws sppo::Error naming what failed.
  explicit TensorboardWriter(const std::string& dir);
  ~TensorboardWriter();
  TensorboardWriter(const TensorboardWriter&) = delete;
  TensorboardWriter& operator=(const TensorboardWriter&) = delete;

  // One event at `step`: each (tag, value) a scalar.
  void scalars(std::int64_t step, const std::vector<std::pair<std::string, double>>& values);
  const std::string& path() const { return path_; }

 private:
  void record(const std::string& event);
  std::string path_;
  std::FILE* file_ = nullptr;
};

}  // namespace sppo::io
