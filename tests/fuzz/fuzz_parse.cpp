// The size and option parsers: counts (--seq-len, --subseqs), byte sizes
// (--device-memory, --budget), presets, data specs and model config JSON. Whatever they
// accept must lie within their stated limits.
#include <nlohmann/json.hpp>
#include <string>

#include "core/check.h"
#include "core/config.h"
#include "io/data.h"

using namespace sppo;

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  try {
    const i64 n = parse_count(text, "--seq-len");
    if (n < 0 || n > kMaxCount) __builtin_trap();
  } catch (const Error&) {
  }
  try {
    const i64 b = parse_bytes(text, "--device-memory");
    if (b <= 0 || b > kMaxBytes) __builtin_trap();
  } catch (const Error&) {
  }
  try {
    (void)preset(text);
  } catch (const Error&) {
  }
  try {
    (void)io::open_data("repeat:" + text, 64, 1);
  } catch (const Error&) {
  }
  const nlohmann::json j = nlohmann::json::parse(text, nullptr, false);
  if (!j.is_discarded()) {
    try {
      const ModelConfig c = model_config_from_json(j);
      (void)c.num_params();
    } catch (const Error&) {
    }
  }
  return 0;
}
