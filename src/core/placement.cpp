#include "core/placement.h"

#include <cstdlib>
#include <sstream>

#include "core/check.h"

namespace sppo {

const char* to_string(KvPlace p) {
  switch (p) {
    case KvPlace::Device: return "device";
    case KvPlace::Host: return "host";
    case KvPlace::Recompute: return "recompute";
  }
  return "";
}

const char* to_string(BackwardOrder o) { return o == BackwardOrder::Layer ? "layer" : "subseq"; }

BackwardOrder parse_backward_order(const std::string& text) {
  if (text == "subseq") return BackwardOrder::Subseq;
  if (text == "layer") return BackwardOrder::Layer;
  SPPO_CHECK(false, "options") << "backward order must be subseq or layer (got '" << text << "')";
  return BackwardOrder::Subseq;
}

const char* to_string(Tier t) { return t == Tier::Host ? "host" : "device"; }

Tier parse_tier(const std::string& text, const std::string& what) {
  if (text == "device") return Tier::Device;
  if (text == "host") return Tier::Host;
  SPPO_CHECK(false, "options") << what << " '" << text << "' is unknown; use device or host";
  return Tier::Device;
}

std::vector<int> Placements::kv_layers(KvPlace p) const {
  std::vector<int> out;
  for (int l = 0; l < int(kv.size()); ++l)
    if (kv[std::size_t(l)] == p) out.push_back(l);
  return out;
}

std::vector<int> Placements::rebuilt_layers() const {
  std::vector<int> out;
  for (int l = 0; l < int(inputs_rebuilt.size()); ++l)
    if (inputs_rebuilt[std::size_t(l)]) out.push_back(l);
  return out;
}

Auto<KvPlace> parse_kv_cache(const std::string& text) {
  if (text == "auto") return kAuto;
  if (text == "device") return KvPlace::Device;
  if (text == "host") return KvPlace::Host;
  if (text == "recompute") return KvPlace::Recompute;
  SPPO_CHECK(false, "options") << "--kv-cache '" << text << "' is unknown; use device, host, recompute or auto";
  return kAuto;
}

Auto<BackwardOrder> parse_backward_order_option(const std::string& text) {
  if (text == "auto") return kAuto;
  SPPO_CHECK(text == "subseq" || text == "layer", "options")
      << "--backward-order '" << text << "' is unknown; use subseq, layer or auto";
  return parse_backward_order(text);
}

Auto<Tier> parse_tier_option(const std::string& text, const std::string& option) {
  if (text == "auto") return kAuto;
  SPPO_CHECK(text == "device" || text == "host", "options")
      << option << " '" << text << "' is unknown; use device, host or auto";
  return parse_tier(text, option);
}

Auto<SavedSet> parse_recompute_option(const std::string& text) {
  if (text == "auto") return kAuto;
  return parse_recompute_tensors(text);
}

RebuildRequest parse_rebuild_inputs(const std::string& text) {
  RebuildRequest r;
  if (text == "auto") return r;
  if (text == "none" || text.empty()) {
    r.kind = RebuildRequest::Kind::None;
    return r;
  }
  if (text == "odd") {
    r.kind = RebuildRequest::Kind::Odd;
    return r;
  }
  r.kind = RebuildRequest::Kind::Layers;
  std::stringstream list(text);
  for (std::string item; std::getline(list, item, ',');) {
    char* end = nullptr;
    const long l = std::strtol(item.c_str(), &end, 10);
    SPPO_CHECK(!item.empty() && *end == 0 && l >= 0 && l < (1 << 20), "options")
        << "--rebuild-inputs '" << text << "': '" << item << "' is not a layer; use none, odd, auto, or a comma "
        << "list of layers (e.g. 1,3)";
    r.layers.push_back(int(l));
  }
  return r;
}

}  // namespace sppo
