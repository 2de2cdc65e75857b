// --config FILE: a command's options from a TOML file, the command line winning over it.
//
//     # run.toml                    sppo train --config run.toml --steps 20
//     model = "llama-tiny"
//     seq-len = "16K"               (any value an option takes on the command line)
//     lr = 2e-5
//     pack = true                   (a flag: true or false)
//
// Keys are the options' long names without the dashes, at the top of the file. An unknown
// key, a value the option refuses, a section, or a file that does not parse is an error
// naming the file and line. `train` writes the options of its run back as config.toml
// (config_toml), so that `--config` repeats the run exactly.
#pragma once

#include <map>
#include <set>
#include <string>

namespace CLI {
class App;
}

namespace sppo::cli {

// Registers --config FILE on `cmd`; `path` receives it.
void add_config_option(CLI::App* cmd, std::string& path);

// After the command line is parsed: gives each option of `cmd` that the command line did
// not give the file's value, as if it had been typed. A no-op for an empty path.
void apply_config_file(CLI::App* cmd, const std::string& path);

// The options given to `cmd` (on the command line, by --config, or restored), but those in
// `skip`, with `values` (long names) replacing or adding values resolved after parsing, as
// a TOML file that apply_config_file reads back. `title` is its first line's comment.
std::string config_toml(const CLI::App* cmd, const std::set<std::string>& skip,
                        const std::map<std::string, std::string>& values, const std::string& title);

}  // namespace sppo::cli
