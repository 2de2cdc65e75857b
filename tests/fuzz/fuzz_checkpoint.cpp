// Checkpoint reading with a fuzzed manifest.json, or a fuzzed state.json whose manifest
// entry matches it (as a user editing a checkpoint by hand would leave it). A state that
// loads must also be usable: its data position is given to both kinds of data source.
#include <nlohmann/json.hpp>
#include <vector>

#include "core/check.h"
#include "fuzz_util.h"
#include "io/checkpoint.h"
#include "io/data.h"

using namespace sppo;

namespace {

struct Fixture {
  std::string dir;
  std::vector<float> w = std::vector<float>(64, 1.0f), m = std::vector<float>(64, 2.0f);
  std::string manifest, state;
  std::unique_ptr<io::TokenSource> tokens;

  std::vector<io::CheckpointTensor> weights() { return {{"w", {8, 8}, w.data()}}; }
  std::vector<io::CheckpointTensor> optimizer() { return {{"w.m", {8, 8}, m.data()}}; }

  Fixture() {
    dir = fuzz::scratch().file("ckpt");
    const nlohmann::json s = {{"step", 3},
                              {"config", {{"vocab", 16}, {"hidden", 8}, {"layers", 1}, {"heads", 2}}},
                              {"data_position", {{"kind", "repeat"}, {"alphabet", 16}, {"seed", 1}, {"sequence", 3}}}};
    io::save_checkpoint(dir, weights(), optimizer(), s);
    manifest = io::read_file(dir + "/manifest.json");
    state = io::read_file(dir + "/state.json");
    const std::string tok = fuzz::scratch().file("tokens.u16");
    const std::uint16_t ids[] = {1, 2, 3, 4, 5, 6, 7, 8};
    io::write_file_atomic(tok, std::string_view(reinterpret_cast<const char*>(ids), sizeof ids));
    tokens = io::open_data(tok, 16, 0);
  }
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  static Fixture f;
  if (size == 0) return 0;
  const std::string_view text(reinterpret_cast<const char*>(data) + 1, size - 1);
  if (data[0] & 1) {
    io::write_file_atomic(f.dir + "/state.json", text);
    nlohmann::json manifest = nlohmann::json::parse(f.manifest);
    const io::FileDigest d = io::digest_file(f.dir + "/state.json");
    manifest["files"]["state.json"] = {{"size", d.size}, {"xxh64", io::hex64(d.xxh64)}};
    io::write_file_atomic(f.dir + "/manifest.json", manifest.dump());
  } else {
    io::write_file_atomic(f.dir + "/state.json", f.state);
    io::write_file_atomic(f.dir + "/manifest.json", text);
  }
  try {
    (void)io::checkpoint_exists(f.dir);
    const nlohmann::json state = io::load_checkpoint(f.dir, f.weights(), f.optimizer());
    const io::CheckpointState s = io::parse_checkpoint_state(state, "state.json");
    (void)s.config.num_params();
    try {
      io::RepeatTask task(16, 1);
      task.seek(s.data_position);
    } catch (const Error&) {
    }
    f.tokens->seek(s.data_position);
  } catch (const Error&) {
  }
  return 0;
}
