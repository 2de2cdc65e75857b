#include "core/json_fields.h"

#include <nlohmann/json.hpp>

#include "core/check.h"

namespace sppo {

i64 json_integer(const nlohmann::json& v, i64 lo, i64 hi, const char* component, const std::string& what) {
  bool ok = false;
  i64 value = 0;
  if (v.is_number_unsigned()) {
    const auto u = v.get<std::uint64_t>();
    ok = hi >= 0 && u <= std::uint64_t(hi);
    value = ok ? i64(u) : 0;
  } else if (v.is_number_integer()) {
    value = v.get<i64>();
    ok = true;
  }
  ok = ok && value >= lo && value <= hi;
  SPPO_CHECK(ok, component) << what << " must be an integer in [" << lo << ", " << hi << "] (got " << v.dump() << ")";
  return value;
}

i64 json_integer_field(const nlohmann::json& j, const char* key, i64 fallback, i64 lo, i64 hi,
                       const char* component, const std::string& where) {
  const auto it = j.find(key);
  if (it == j.end()) return fallback;
  return json_integer(*it, lo, hi, component, where + "\"" + key + "\"");
}

std::string json_string_field(const nlohmann::json& j, const char* key, const std::string& fallback,
                              const char* component, const std::string& where) {
  const auto it = j.find(key);
  if (it == j.end()) return fallback;
  SPPO_CHECK(it->is_string(), component) << where << "\"" << key << "\" must be a string (got " << it->dump() << ")";
  return it->get<std::string>();
}

}  // namespace sppo
