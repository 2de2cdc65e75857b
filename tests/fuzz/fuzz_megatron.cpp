// Megatron indexed datasets (.idx + .bin). Input: a little-endian u16 n, then n bytes of
// .idx, then the .bin (its token type comes from the index).
#include <cstring>
#include <vector>

#include "core/check.h"
#include "fuzz_util.h"
#include "io/data.h"

using namespace sppo;

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size < 2) return 0;
  std::size_t n = std::size_t(data[0]) | std::size_t(data[1]) << 8;
  n = std::min(n, size - 2);
  fuzz::write_input("ds.idx", data + 2, n);
  fuzz::write_input("ds.bin", data + 2 + n, size - 2 - n);
  try {
    auto src = io::open_data(fuzz::scratch().file("ds"), 0, 0);
    (void)src->describe();
    (void)src->max_token();
    src->check_length(5);
    std::vector<std::int32_t> seq(5);
    for (int k = 0; k < 4; ++k) src->next(seq.data(), 5);
    auto resumed = io::open_megatron(fuzz::scratch().file("ds.bin"), 0);
    resumed->seek(src->position());
  } catch (const Error&) {
  }
  return 0;
}
