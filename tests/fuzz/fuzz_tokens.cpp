// Raw token files (.u16, .u32) and byte-level text read as training data: open, check the
// vocabulary, read windows, and resume from a saved position. The first byte picks the
// format, the vocabulary and the window length; the rest is the file.
#include <vector>

#include "core/check.h"
#include "fuzz_util.h"
#include "io/data.h"

using namespace sppo;

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size == 0) return 0;
  const int kind = data[0] % 3;
  const std::int64_t vocab = (data[0] >> 2) % 4 == 0 ? 0 : std::int64_t{1} << (4 * ((data[0] >> 2) % 4) + 4);
  const std::int64_t count = 2 + (data[0] >> 4);
  const char* names[] = {"in.u16", "in.u32", "in.txt"};
  const std::string path = fuzz::write_input(names[kind], data + 1, size - 1);
  try {
    auto src = io::open_data(path, vocab, 0);
    (void)src->describe();
    (void)src->vocab_hint();
    try {
      src->check_vocab(vocab > 0 ? vocab : 256);
    } catch (const Error&) {
    }
    src->check_length(count);
    std::vector<std::int32_t> seq(static_cast<std::size_t>(count)), again(static_cast<std::size_t>(count));
    for (int k = 0; k < 3; ++k) src->next(seq.data(), count);
    const nlohmann::json pos = src->position();
    src->next(seq.data(), count);
    auto resumed = io::open_data(path, vocab, 0);
    resumed->seek(nlohmann::json::parse(pos.dump()));
    resumed->next(again.data(), count);
    if (again != seq) __builtin_trap();
  } catch (const Error&) {
  }
  return 0;
}
