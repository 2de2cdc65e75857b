#include "cli/config_file.h"

#include <CLI/CLI.hpp>
#include <charconv>
#include <sstream>
#include <toml++/toml.h>

#include "core/check.h"

namespace sppo::cli {

namespace {

constexpr const char* kComponent = "config";

// A TOML number as the command line would spell it: integers exactly, floats in the
// shortest form that reads back the same.
std::string number_text(double v) {
  char buf[64];
  const auto r = std::to_chars(buf, buf + sizeof buf, v);
  return std::string(buf, r.ptr);
}

// The key's value as command-line text, or an error naming where it is.
std::string value_text(const toml::node& value, const std::string& where, bool flag) {
  if (flag) {
    SPPO_CHECK(value.is_boolean(), kComponent) << where << " is a flag: give true or false";
    return *value.value<bool>() ? "true" : "false";
  }
  if (auto s = value.as_string()) return s->get();
  if (auto i = value.as_integer()) return std::to_string(i->get());
  if (auto f = value.as_floating_point()) return number_text(f->get());
  SPPO_CHECK(!value.is_boolean(), kComponent) << where << " takes a value, not true or false";
  SPPO_CHECK(false, kComponent) << where << " must be a string or a number, as the option takes on the command line"
                                << (value.is_array() ? " (a list goes in one string, comma-separated)" : "");
  __builtin_unreachable();
}

bool is_flag(const CLI::Option* op) { return op->get_expected_min() == 0; }

}  // namespace

void add_config_option(CLI::App* cmd, std::string& path) {
  cmd->add_option("--config", path,
                  "Read options from this TOML file (keys are the long option names without dashes, e.g. "
                  "seq-len = \"16K\", lr = 2e-5, pack = true); the command line wins over it");
}

void apply_config_file(CLI::App* cmd, const std::string& path) {
  if (path.empty()) return;
  toml::table file;
  try {
    file = toml::parse_file(path);
  } catch (const toml::parse_error& e) {
    const auto& at = e.source().begin;
    SPPO_CHECK(at.line > 0, kComponent) << "cannot read --config " << path << ": " << e.description();
    SPPO_CHECK(false, kComponent) << path << " line " << at.line << ": " << e.description()
                                  << " (the file is TOML: key = value, one a line)";
  }
  const std::string command = "sppo " + cmd->get_name();
  for (const auto& [key, value] : file) {
    const std::string name(key.str());
    const std::string where = path + " line " + std::to_string(value.source().begin.line) + ": " + name;
    SPPO_CHECK(!value.is_table(), kComponent)
        << where << " is a section; " << command << " takes its options as keys at the top of the file";
    CLI::Option* op = name == "config" || name == "help" ? nullptr : cmd->get_option_no_throw("--" + name);
    SPPO_CHECK(op != nullptr, kComponent)
        << where << " is not an option of " << command << " (see " << command << " --help)";
    const std::string text = value_text(value, where, is_flag(op));
    if (op->count() > 0) continue;  // the command line wins
    try {
      op->add_result(text);
      op->run_callback();
    } catch (const CLI::Error& e) {
      SPPO_CHECK(false, kComponent) << where << " = " << text << ": " << e.what();
    }
  }
}

std::string config_toml(const CLI::App* cmd, const std::set<std::string>& skip,
                        const std::map<std::string, std::string>& values, const std::string& title) {
  std::map<std::string, std::string> given;  // long name -> value
  for (const CLI::Option* op : cmd->get_options()) {
    const std::string name = op->get_single_name();
    if (op->count() == 0 || name == "help" || name == "config" || skip.count(name)) continue;
    given[name] = is_flag(op) ? (op->as<bool>() ? "true" : "false") : op->results().back();
  }
  for (const auto& [name, value] : values) given[name] = value;
  std::ostringstream os;
  os << "# " << title << "\n";
  for (const auto& [name, value] : given) {
    const CLI::Option* op = cmd->get_option_no_throw("--" + name);
    os << name << " = ";
    // Flags are booleans; numbers stay numbers where they read back as themselves; the rest
    // are strings (toml++ quotes them).
    std::int64_t i = 0;
    double f = 0;
    const char* end = value.data() + value.size();
    if (op && is_flag(op)) os << value;
    else if (!value.empty() && std::from_chars(value.data(), end, i).ptr == end) os << i;
    else if (!value.empty() && std::from_chars(value.data(), end, f).ptr == end && number_text(f) == value &&
             value.find_first_of(".e") != std::string::npos)
      os << value;
    else os << toml::value<std::string>(value);
    os << "\n";
  }
  return os.str();
}

}  // namespace sppo::cli
