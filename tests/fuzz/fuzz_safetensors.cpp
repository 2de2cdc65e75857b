// The safetensors reader on arbitrary files; what it accepts must read, write back and
// read again as the same tensors.
#include <cstring>
#include <vector>

#include "core/check.h"
#include "fuzz_util.h"
#include "io/safetensors.h"

using namespace sppo;

namespace {
constexpr std::uint64_t kMaxTensorBytes = std::uint64_t{1} << 20;
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string path = fuzz::write_input("in.safetensors", data, size);
  try {
    const io::SafetensorsReader r(path);
    std::vector<io::TensorView> views;
    std::vector<std::vector<unsigned char>> bufs;
    for (const auto& t : r.tensors()) {
      if (t.nbytes() > kMaxTensorBytes) return 0;
      bufs.emplace_back(t.nbytes());
      r.read(t.name, t.dtype, t.shape, bufs.back().data());
      views.push_back({t.name, t.dtype, t.shape, bufs.back().data()});
    }
    (void)r.find("x");
    const std::string copy = fuzz::scratch().file("copy.safetensors");
    io::write_safetensors(copy, views, r.metadata());
    const io::SafetensorsReader again(copy);
    if (again.tensors().size() != r.tensors().size() || again.metadata() != r.metadata()) __builtin_trap();
    std::vector<unsigned char> back;
    for (std::size_t k = 0; k < views.size(); ++k) {
      back.resize(bufs[k].size());
      again.read(views[k].name, views[k].dtype, views[k].shape, back.data());
      if (back != bufs[k]) __builtin_trap();
    }
  } catch (const Error&) {
  }
  return 0;
}
