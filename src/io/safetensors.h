// safetensors: the weights format users already have (Hugging Face).
//
// Layout of a file (all integers little-endian):
//   u64 N                      length of the header in bytes
//   N bytes of JSON            {"<name>": {"dtype": "F32", "shape": [..],
//                                          "data_offsets": [begin, end]}, ...,
//                               "__metadata__": {"<key>": "<string>", ...}}  (optional)
//                              padded with spaces so that 8 + N is a multiple of 8
//   data section               raw row-major tensor bytes; data_offsets are relative to
//                              its start
//
// The reader validates the whole header when it opens a file (header length against the
// file size, JSON syntax, no duplicate names, known dtypes, integer shapes, offsets inside
// the data section, end - begin == numel * dtype size, and tensors that tile the data
// section exactly, as the format requires: no overlaps, no holes, nothing after the last
// tensor). Tensor data is then read with pread straight into the caller's buffer; the
// file is never copied whole into memory. The writer streams each tensor from the
// caller's memory into an atomically replaced file (fileutil.h).
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "io/fileutil.h"

namespace sppo::io {

enum class DType { F64, F32, F16, BF16, I64, I32, I16, I8, U64, U32, U16, U8, Bool };

std::size_t dtype_size(DType dtype);
const char* dtype_name(DType dtype);  // the safetensors spelling: "F32", "BF16", ...
// Throws for unknown names; `context` prefixes the message (file and tensor).
DType parse_dtype(const std::string& name, const std::string& context);

template <typename T> constexpr DType dtype_of();
template <> constexpr DType dtype_of<double>() { return DType::F64; }
template <> constexpr DType dtype_of<float>() { return DType::F32; }
template <> constexpr DType dtype_of<std::int64_t>() { return DType::I64; }
template <> constexpr DType dtype_of<std::int32_t>() { return DType::I32; }
template <> constexpr DType dtype_of<std::uint64_t>() { return DType::U64; }
template <> constexpr DType dtype_of<std::uint32_t>() { return DType::U32; }

// Product of the dims; throws on a negative dim or overflow. An empty shape is a scalar.
std::int64_t shape_numel(const std::vector<std::int64_t>& shape, const std::string& context);
std::string shape_str(const std::vector<std::int64_t>& shape);  // "[2, 3]"

using Metadata = std::map<std::string, std::string>;

// One tensor to write; `data` points to caller memory holding numel * dtype_size bytes.
struct TensorView {
  std::string name;
  DType dtype = DType::F32;
  std::vector<std::int64_t> shape;
  const void* data = nullptr;
};

// Writes tensors in the given order (data offsets increase in that order). Names must be
// unique, non-empty and not "__metadata__". Returns the file's size and checksum.
FileDigest write_safetensors(const std::string& path, const std::vector<TensorView>& tensors,
                             const Metadata& metadata = {});

struct TensorInfo {
  std::string name;
  DType dtype = DType::F32;
  std::vector<std::int64_t> shape;
  std::uint64_t begin = 0;  // byte offsets relative to the data section
  std::uint64_t end = 0;
  std::int64_t numel() const;
  std::uint64_t nbytes() const { return end - begin; }
};

class SafetensorsReader {
 public:
  // Opens and validates; every error names the file (and the tensor where one is at fault).
  explicit SafetensorsReader(const std::string& path);

  const std::string& path() const { return file_.path(); }
  // In data order (ascending offsets).
  const std::vector<TensorInfo>& tensors() const { return tensors_; }
  const Metadata& metadata() const { return metadata_; }
  bool contains(const std::string& name) const { return index_.count(name) != 0; }
  const TensorInfo* find(const std::string& name) const;
  const TensorInfo& at(const std::string& name) const;  // throws naming file and tensor

  // Reads tensor `name` into `out` after checking that its dtype and shape are exactly the
  // expected ones.
  void read(const std::string& name, DType dtype, const std::vector<std::int64_t>& shape,
            void* out) const;
  template <typename T>
  void read(const std::string& name, const std::vector<std::int64_t>& shape, T* out) const {
    read(name, dtype_of<T>(), shape, out);
  }

 private:
  InFile file_;
  std::uint64_t data_start_ = 0;  // 8 + N
  std::vector<TensorInfo> tensors_;
  std::map<std::string, std::size_t> index_;
  Metadata metadata_;
};

// Largest header the reader accepts (the reference implementation's limit).
inline constexpr std::uint64_t kMaxSafetensorsHeaderBytes = std::uint64_t{100} << 20;

}  // namespace sppo::io
