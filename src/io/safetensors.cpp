#include "io/safetensors.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "core/check.h"

namespace sppo::io {

namespace {

constexpr const char* kComponent = "safetensors";
constexpr const char* kMetadataKey = "__metadata__";

struct DTypeEntry {
  DType dtype;
  const char* name;
  std::size_t size;
};

constexpr DTypeEntry kDTypes[] = {
    {DType::F64, "F64", 8}, {DType::F32, "F32", 4}, {DType::F16, "F16", 2},
    {DType::BF16, "BF16", 2}, {DType::I64, "I64", 8}, {DType::I32, "I32", 4},
    {DType::I16, "I16", 2}, {DType::I8, "I8", 1}, {DType::U64, "U64", 8},
    {DType::U32, "U32", 4}, {DType::U16, "U16", 2}, {DType::U8, "U8", 1},
    {DType::Bool, "BOOL", 1},
};

const DTypeEntry& entry(DType dtype) {
  for (const auto& e : kDTypes)
    if (e.dtype == dtype) return e;
  SPPO_ASSERT_MSG(false, "dtype " << static_cast<int>(dtype) << " missing from kDTypes");
  __builtin_unreachable();
}

std::string tensor_context(const std::string& path, const std::string& name) {
  return path + ": tensor '" + name + "'";
}

// A JSON value that is a non-negative integer (nlohmann parses those as unsigned).
bool read_u64(const nlohmann::json& j, std::uint64_t* out) {
  if (!j.is_number_unsigned()) return false;
  *out = j.get<std::uint64_t>();
  return true;
}

}  // namespace

std::size_t dtype_size(DType dtype) { return entry(dtype).size; }
const char* dtype_name(DType dtype) { return entry(dtype).name; }

DType parse_dtype(const std::string& name, const std::string& context) {
  for (const auto& e : kDTypes)
    if (name == e.name) return e.dtype;
  std::ostringstream known;
  for (const auto& e : kDTypes) known << (&e == kDTypes ? "" : ", ") << e.name;
  SPPO_CHECK(false, kComponent) << context << ": unknown dtype \"" << name
                                << "\" (known: " << known.str() << ")";
  __builtin_unreachable();
}

std::int64_t shape_numel(const std::vector<std::int64_t>& shape, const std::string& context) {
  std::int64_t n = 1;
  for (std::int64_t d : shape) {
    SPPO_CHECK(d >= 0, kComponent) << context << ": negative dimension in shape " << shape_str(shape);
    SPPO_CHECK(d == 0 || n <= std::numeric_limits<std::int64_t>::max() / d, kComponent)
        << context << ": shape " << shape_str(shape) << " has too many elements";
    n *= d;
  }
  return n;
}

std::string shape_str(const std::vector<std::int64_t>& shape) {
  std::ostringstream os;
  os << '[';
  for (std::size_t i = 0; i < shape.size(); ++i) os << (i ? ", " : "") << shape[i];
  os << ']';
  return os.str();
}

std::int64_t TensorInfo::numel() const { return shape_numel(shape, name); }

// ---- writer --------------------------------------------------------------------------

FileDigest write_safetensors(const std::string& path, const std::vector<TensorView>& tensors,
                             const Metadata& metadata) {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) header[kMetadataKey] = metadata;
  std::set<std::string> seen;
  std::vector<std::uint64_t> sizes;
  std::uint64_t offset = 0;
  for (const auto& t : tensors) {
    const std::string ctx = tensor_context(path, t.name);
    SPPO_CHECK(!t.name.empty(), kComponent) << path << ": a tensor has an empty name";
    SPPO_CHECK(t.name != kMetadataKey, kComponent)
        << ctx << ": the name is reserved for metadata; rename the tensor";
    SPPO_CHECK(seen.insert(t.name).second, kComponent)
        << ctx << ": the name appears twice; tensor names must be unique";
    std::int64_t numel = shape_numel(t.shape, ctx);
    std::uint64_t bytes = static_cast<std::uint64_t>(numel) * dtype_size(t.dtype);
    SPPO_CHECK(bytes == 0 || t.data != nullptr, kComponent) << ctx << ": data pointer is null";
    header[t.name] = {{"dtype", dtype_name(t.dtype)},
                      {"shape", t.shape},
                      {"data_offsets", {offset, offset + bytes}}};
    sizes.push_back(bytes);
    offset += bytes;
  }
  std::string json = header.dump();
  json.append((8 - json.size() % 8) % 8, ' ');
  const std::uint64_t n = json.size();

  return write_file_atomic(path, [&](OutFile& f) {
    f.write(&n, sizeof n);
    f.write(json);
    for (std::size_t i = 0; i < tensors.size(); ++i) f.write(tensors[i].data, sizes[i]);
  });
}

// ---- reader --------------------------------------------------------------------------

SafetensorsReader::SafetensorsReader(const std::string& path) : file_(path) {
  const std::uint64_t size = file_.size();
  SPPO_CHECK(size >= 8, kComponent) << path << ": file is " << size
                                    << " bytes, too short to be safetensors (it needs an "
                                       "8-byte header length first)";
  std::uint64_t n = 0;
  file_.read_at(0, &n, sizeof n);
  SPPO_CHECK(n <= kMaxSafetensorsHeaderBytes, kComponent)
      << path << ": header length " << n << " exceeds the " << kMaxSafetensorsHeaderBytes
      << "-byte limit (not a safetensors file, or a corrupted one)";
  SPPO_CHECK(n <= size - 8, kComponent)
      << path << ": header length " << n << " runs past the end of the " << size
      << "-byte file (truncated or not a safetensors file)";
  data_start_ = 8 + n;
  const std::uint64_t data_size = size - data_start_;

  std::string text(n, '\0');
  file_.read_at(8, text.data(), n);

  // Duplicate top-level keys would silently shadow each other in a json object.
  std::set<std::string> keys;
  std::string duplicate;
  auto on_event = [&](int depth, nlohmann::json::parse_event_t event, nlohmann::json& parsed) {
    if (depth == 1 && event == nlohmann::json::parse_event_t::key && parsed.is_string() &&
        !keys.insert(parsed.get<std::string>()).second && duplicate.empty())
      duplicate = parsed.get<std::string>();
    return true;
  };
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(text, on_event);
  } catch (const nlohmann::json::exception& e) {  // parse_error, or out_of_range for 1e999
    SPPO_CHECK(false, kComponent) << path << ": header is not valid JSON (" << e.what()
                                  << "); the file is corrupted or not safetensors";
  }
  SPPO_CHECK(header.is_object(), kComponent)
      << path << ": header must be a JSON object, found " << header.type_name();
  SPPO_CHECK(duplicate.empty(), kComponent)
      << path << ": header names '" << duplicate << "' twice";

  for (const auto& [name, spec] : header.items()) {
    if (name == kMetadataKey) {
      SPPO_CHECK(spec.is_object(), kComponent) << path << ": __metadata__ must be an object";
      for (const auto& [k, v] : spec.items()) {
        SPPO_CHECK(v.is_string(), kComponent)
            << path << ": __metadata__ value of '" << k << "' must be a string, found "
            << v.type_name();
        metadata_[k] = v.get<std::string>();
      }
      continue;
    }
    const std::string ctx = tensor_context(path, name);
    SPPO_CHECK(spec.is_object(), kComponent) << ctx << ": entry must be an object";
    SPPO_CHECK(spec.contains("dtype") && spec["dtype"].is_string(), kComponent)
        << ctx << ": missing string field \"dtype\"";
    SPPO_CHECK(spec.contains("shape") && spec["shape"].is_array(), kComponent)
        << ctx << ": missing array field \"shape\"";
    SPPO_CHECK(spec.contains("data_offsets") && spec["data_offsets"].is_array() &&
                   spec["data_offsets"].size() == 2,
               kComponent)
        << ctx << ": missing field \"data_offsets\" ([begin, end])";
    TensorInfo t;
    t.name = name;
    t.dtype = parse_dtype(spec["dtype"].get<std::string>(), ctx);
    for (const auto& d : spec["shape"]) {
      std::uint64_t v = 0;
      SPPO_CHECK(read_u64(d, &v) && v <= static_cast<std::uint64_t>(
                                            std::numeric_limits<std::int64_t>::max()),
                 kComponent)
          << ctx << ": shape " << spec["shape"].dump() << " must hold non-negative integers";
      t.shape.push_back(static_cast<std::int64_t>(v));
    }
    SPPO_CHECK(read_u64(spec["data_offsets"][0], &t.begin) &&
                   read_u64(spec["data_offsets"][1], &t.end) && t.begin <= t.end,
               kComponent)
        << ctx << ": data_offsets " << spec["data_offsets"].dump()
        << " must be two non-negative integers with begin <= end";
    SPPO_CHECK(t.end <= data_size, kComponent)
        << ctx << ": data_offsets " << spec["data_offsets"].dump() << " run past the "
        << data_size << "-byte data section (file truncated?)";
    const std::int64_t numel = shape_numel(t.shape, ctx);
    const std::size_t esize = dtype_size(t.dtype);
    SPPO_CHECK(static_cast<std::uint64_t>(numel) <= std::numeric_limits<std::uint64_t>::max() / esize &&
                   t.nbytes() == static_cast<std::uint64_t>(numel) * esize,
               kComponent)
        << ctx << ": data_offsets span " << t.nbytes() << " bytes but shape "
        << shape_str(t.shape) << " of " << dtype_name(t.dtype) << " needs " << numel << " x "
        << esize << " bytes";
    tensors_.push_back(std::move(t));
  }

  std::stable_sort(tensors_.begin(), tensors_.end(), [](const TensorInfo& a, const TensorInfo& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  std::uint64_t cursor = 0;
  for (const auto& t : tensors_) {
    SPPO_CHECK(t.begin >= cursor, kComponent)
        << tensor_context(path, t.name) << ": data [" << t.begin << ", " << t.end
        << ") overlaps the previous tensor, which ends at " << cursor;
    SPPO_CHECK(t.begin == cursor, kComponent)
        << tensor_context(path, t.name) << ": data starts at " << t.begin
        << " but the previous tensor ends at " << cursor
        << " (safetensors data must have no holes)";
    cursor = t.end;
  }
  SPPO_CHECK(cursor == data_size, kComponent)
      << path << ": the tensors cover " << cursor << " bytes of a " << data_size
      << "-byte data section (trailing bytes: the file was appended to or is corrupted)";
  for (std::size_t i = 0; i < tensors_.size(); ++i) index_[tensors_[i].name] = i;
}

const TensorInfo* SafetensorsReader::find(const std::string& name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : &tensors_[it->second];
}

const TensorInfo& SafetensorsReader::at(const std::string& name) const {
  const TensorInfo* t = find(name);
  SPPO_CHECK(t != nullptr, kComponent)
      << path() << ": no tensor named '" << name << "' (the file holds " << tensors_.size()
      << " tensors)";
  return *t;
}

void SafetensorsReader::read(const std::string& name, DType dtype,
                             const std::vector<std::int64_t>& shape, void* out) const {
  const TensorInfo& t = at(name);
  const std::string ctx = tensor_context(path(), name);
  SPPO_CHECK(t.dtype == dtype, kComponent)
      << ctx << ": stored as " << dtype_name(t.dtype) << " but " << dtype_name(dtype)
      << " was requested";
  SPPO_CHECK(t.shape == shape, kComponent)
      << ctx << ": stored with shape " << shape_str(t.shape) << " but shape "
      << shape_str(shape) << " was expected";
  if (t.nbytes() > 0) file_.read_at(data_start_ + t.begin, out, t.nbytes());
}

}  // namespace sppo::io
