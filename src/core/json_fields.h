// Typed reads of JSON values from files a user may have edited (plans, profiles, model
// configs, checkpoint state). nlohmann's get<int>() on a float or an out-of-range number
// converts silently or with undefined behaviour, and value() on a field of the wrong type
// throws its own exception; these check first and throw sppo::Error naming the field.
#pragma once

#include <nlohmann/json_fwd.hpp>
#include <string>

#include "core/dims.h"

namespace sppo {

// `v` as an integer in [lo, hi]. A float, a string or a number out of range is refused:
// "[component] <what> must be an integer in [lo, hi] (got <v>)".
i64 json_integer(const nlohmann::json& v, i64 lo, i64 hi, const char* component, const std::string& what);

// Field `key` of object `j` as above, or `fallback` when absent. `where` prefixes the
// field name in errors ("plan.json: \"gpus\"").
i64 json_integer_field(const nlohmann::json& j, const char* key, i64 fallback, i64 lo, i64 hi,
                       const char* component, const std::string& where);

// Field `key` as a string, or `fallback` when absent; any other type is refused.
std::string json_string_field(const nlohmann::json& j, const char* key, const std::string& fallback,
                              const char* component, const std::string& where);

}  // namespace sppo
