// rewrite_state DIR TEXT: replaces DIR/state.json of a checkpoint with TEXT and updates its
// manifest entry (size and XXH64), as a user editing a checkpoint by hand would leave it:
// the checksums match, only the content is wrong. For tests/bad_inputs.sh.
#include <cstdio>
#include <nlohmann/json.hpp>
#include <string>

#include "core/check.h"
#include "io/checkpoint.h"
#include "io/fileutil.h"

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: rewrite_state CHECKPOINT_DIR STATE_JSON_TEXT\n");
    return 2;
  }
  using namespace sppo::io;
  try {
    const std::string dir = argv[1], state = dir + "/" + kCheckpointStateFile,
                      manifest_path = dir + "/" + kCheckpointManifestFile;
    write_file_atomic(state, std::string(argv[2]));
    nlohmann::json manifest = nlohmann::json::parse(read_file(manifest_path));
    const FileDigest d = digest_file(state);
    manifest["files"][kCheckpointStateFile] = {{"size", d.size}, {"xxh64", hex64(d.xxh64)}};
    write_file_atomic(manifest_path, manifest.dump(2) + "\n");
  } catch (const std::exception& e) {
    std::fprintf(stderr, "rewrite_state: %s\n", e.what());
    return 1;
  }
  return 0;
}
