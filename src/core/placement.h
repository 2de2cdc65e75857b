// Where a step keeps what it saves and holds (docs/design.md 4): every placement past the
// paper's offload ratio, as one typed value (Placements) that the options and a plan's JSON
// parse into once, the setup and the planner choose, and the schedule carries to the three
// that follow it: the runtime, the memory rules and the simulator (STYLE.md, Conventions
// 14). An option that may be left to the engine is an Auto<T> (std::nullopt: auto), never a
// string or a -1 compared in several files.
#pragma once

#include <algorithm>
#include <optional>
#include <string>
#include <vector>

#include "core/layout.h"

namespace sppo {

// An option's value, or auto: the engine's choice (a plan's under --plan; else what fits
// the budgets, as each option's help says).
template <class T>
using Auto = std::optional<T>;
inline constexpr std::nullopt_t kAuto = std::nullopt;

// Where a layer keeps the K/V of finished subsequences (Schedule::place.kv): on the device;
// on the host, streamed back a chunk at a time; or not at all, recomputed from the layer's
// input when a later subsequence or the backward needs them.
enum class KvPlace : char { Device, Host, Recompute };
const char* to_string(KvPlace p);  // "device" | "host" | "recompute"

// The order of a stage's backward.
// Subseq, the paper's: the subsequences in reverse, each through all the stage's layers, so
// every layer's dK/dV sums live until the backward reaches the first subsequence.
// Layer: the layers from the last, each over the subsequences in reverse, so only one
// layer's sums live at a time; each subsequence's residual gradient waits between its
// layers (Note [Layer-major backward] in schedule/builders.cpp).
enum class BackwardOrder : char { Subseq, Layer };
const char* to_string(BackwardOrder o);                       // "subseq" | "layer"
BackwardOrder parse_backward_order(const std::string& text);  // throws sppo::Error naming the choices

const char* to_string(Tier t);                                          // "device" | "host"
Tier parse_tier(const std::string& text, const std::string& what);      // throws naming `what`

struct Placements {
  // Where each layer keeps its K/V ([layers]); empty: every layer on the device.
  std::vector<KvPlace> kv;
  // The saved tensors every layer's backward recomputes (Note [Recomputed tensors] in
  // core/layout.h; a closed set of groups).
  SavedSet recompute = 0;
  // Rows of every layer's MLP tiles (Note [MLP tiles] in core/layout.h); 0: none.
  i64 mlp_tile_rows = 0;
  BackwardOrder backward = BackwardOrder::Subseq;
  // Where a layer-major backward's residual gradients wait between its layers (Note
  // [Residual gradients on the host] in schedule/builders.cpp).
  Tier residual_grads = Tier::Device;
  // Where the transformer layers' weights and gradients live between their uses (Note
  // [Weights on the host] in schedule/weights.h); Host needs the optimizer state there.
  Tier weights = Tier::Device;
  // Where the fp32 master weights and AdamW m, v live and update (Note [Optimizer state on
  // the host] in runtime/host_optimizer.h).
  Tier optimizer_state = Tier::Device;
  // Layers whose input the forward does not keep ([layers]; empty: none; Note [Rebuilt
  // layer inputs] in schedule/builders.cpp).
  std::vector<bool> inputs_rebuilt;

  KvPlace kv_at(int layer) const { return kv.empty() ? KvPlace::Device : kv[std::size_t(layer)]; }
  // Host or Recompute: earlier blocks stream through a window, their sums on the host.
  bool kv_streamed(int layer) const { return kv_at(layer) != KvPlace::Device; }
  bool kv_recomputed(int layer) const { return kv_at(layer) == KvPlace::Recompute; }
  bool any_kv_streamed() const {
    return std::any_of(kv.begin(), kv.end(), [](KvPlace p) { return p != KvPlace::Device; });
  }
  // The layers whose K/V are `p`, ascending.
  std::vector<int> kv_layers(KvPlace p) const;
  bool input_rebuilt(int layer) const {
    return layer < int(inputs_rebuilt.size()) && inputs_rebuilt[std::size_t(layer)];
  }
  bool any_input_rebuilt() const {
    return std::find(inputs_rebuilt.begin(), inputs_rebuilt.end(), true) != inputs_rebuilt.end();
  }
  std::vector<int> rebuilt_layers() const;
  bool layer_major() const { return backward == BackwardOrder::Layer; }
  bool residual_host() const { return residual_grads == Tier::Host; }
  bool weights_host() const { return weights == Tier::Host; }
  bool optimizer_host() const { return optimizer_state == Tier::Host; }
  MlpTiles mlp_tiles() const { return {mlp_tile_rows, in_set(recompute, kSavedFcPre)}; }

  bool operator==(const Placements&) const = default;
};

// --rebuild-inputs: which layers' inputs a run rebuilds.
struct RebuildRequest {
  enum class Kind : char {
    Auto,    // the plan's under --plan; in the planner, where rebuilding pays (Note [Rebuilt inputs in the search])
    None,
    Odd,     // every other layer: 1, 3, 5, ... (in a plan, of each stage)
    Layers,  // `layers`
  };
  Kind kind = Kind::Auto;
  std::vector<int> layers;
  bool operator==(const RebuildRequest&) const = default;
};

// The placement options as given (train's and plan's --kv-cache, --recompute-tensors,
// --backward-order, --optimizer-state, --weights, --residual-grads, --rebuild-inputs),
// parsed once at the command line's edge.
struct PlacementRequest {
  Auto<KvPlace> kv;                 // every layer's
  Auto<SavedSet> recompute;
  Auto<BackwardOrder> backward;
  Auto<Tier> optimizer_state;
  Auto<Tier> weights;
  Tier residual_grads = Tier::Device;
  RebuildRequest rebuild;
  bool operator==(const PlacementRequest&) const = default;
};

// The options' texts; each throws sppo::Error naming the option and its choices.
Auto<KvPlace> parse_kv_cache(const std::string& text);                          // device|host|recompute|auto
Auto<BackwardOrder> parse_backward_order_option(const std::string& text);       // subseq|layer|auto
Auto<Tier> parse_tier_option(const std::string& text, const std::string& option);  // device|host|auto
Auto<SavedSet> parse_recompute_option(const std::string& text);                 // a list, none, all, or auto
RebuildRequest parse_rebuild_inputs(const std::string& text);                   // none|odd|LIST|auto

}  // namespace sppo
