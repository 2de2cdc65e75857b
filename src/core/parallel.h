// A step's parallelism (docs/design.md 6): the degree of every parallel dimension, the ZeRO
// stage, how the ranks are numbered and the groups they form. One typed value, built and
// checked once (ParallelDims::check), carried unchanged from the options (train --tp, --cp,
// --pp, --dp, --zero, --msp, --ring; a plan's layout) through the plan and the setup into
// the schedule, the simulator and the runtime, which ask it rather than recompute any of it
// (STYLE.md, Conventions 14).
//
// The kinds of sequence parallelism each have their own name, everywhere (docs/design.md 6):
//   tp       tensor parallelism with sequence-parallel regions (Megatron-LM's; the SPPO
//            paper's SP): every layer's heads, MLP and vocabulary split over tp ranks
//   cp       context parallelism by ring attention (Li et al.'s RSA; the ring): every
//            subsequence's tokens split over cp ranks, K and V travel around them
//   ulysses  DeepSpeed-Ulysses: every subsequence's tokens split over ulysses ranks, turned
//            into a split of the heads by an all-to-all around attention
// "sp" alone names none of them.
//
// Note [Rank layout]
// ~~~~~~~~~~~~~~~~~~
//   rank = (((replica * pp + stage) * cp + ring) * ulysses + u) * tp + member
// Innermost first: a tensor-parallel group is consecutive ranks (one node: its collectives
// run inside every layer); Ulysses groups of those next (one node too: its all-to-all moves
// every token's queries, keys and values); the ring's members outside them (USP: the
// all-to-all inside groups of U, the ring across them); then pipeline stages, then
// replicas. Rank 0 is the first of everything. This formula is written here only:
// everything else asks rank_of, coord_of or a group.
#pragma once

#include <string>
#include <vector>

namespace sppo {

// How the cp ranks of a ring hold a subsequence's tokens (Note [Ring attention load balance]
// in schedule/ir.h).
enum class RingLayout : char { Contiguous, Zigzag };
const char* to_string(RingLayout l);                    // "contiguous" | "zigzag"
RingLayout parse_ring_layout(const std::string& text);  // throws sppo::Error naming the choices

// The ring's algorithm: Flash, one pass with the partial outputs merged by their LSE; Rsa,
// the two-pass Ring Self-Attention of bidirectional models (runtime/ring.h RsaAttention).
enum class RingAlgorithm : char { Flash, Rsa };
const char* to_string(RingAlgorithm a);  // "flash" | "rsa"

struct ParallelDims;
// --ring: a comma-separated list of a layout (zigzag, contiguous) and an algorithm (flash,
// rsa), into par.ring_layout and par.ring_algorithm; throws naming the choices.
void parse_ring(const std::string& text, ParallelDims& par);

// What the ranks that hold the same layers shard among them (docs/design.md 6): nothing;
// the AdamW state (1); also the gradients (2); also the weights (3).
enum class ZeroStage : char { None = 0, OptimizerState = 1, Gradients = 2, Weights = 3 };
inline int stage_number(ZeroStage z) { return int(z); }
// Whether stage z shards the gradients (2 and 3), and the weights (3).
inline bool shards_gradients(ZeroStage z) { return z == ZeroStage::Gradients || z == ZeroStage::Weights; }
inline bool shards_weights(ZeroStage z) { return z == ZeroStage::Weights; }
// --zero N / a plan's "zero": 0 to `highest` (the stages this build runs); throws naming them.
ZeroStage parse_zero_stage(long long n, int highest, const char* component, const std::string& what);

// Multiplexed sequence partitioning (docs/design.md 6, §6.2): a pipeline's bubble-adjacent
// subsequences split over the stage groups that would idle. `reach`: the groups a split
// task runs on (Note [MSP reach] in schedule/msp.h); 0, every idle one.
struct Msp {
  bool on = false;
  int reach = 0;
  bool operator==(const Msp&) const = default;
};

// Ranks a layout may have; more would be a corrupted plan, and simulating it would build a
// schedule per rank.
inline constexpr int kMaxRanks = 1 << 20;

struct ParallelDims {
  int tp = 1;       // tensor parallel ranks a layer
  int ulysses = 1;  // Ulysses ranks a subsequence (inside a ring member)
  int cp = 1;       // ring members a subsequence
  int pp = 1;       // pipeline stages
  int dp = 1;       // data-parallel replicas
  ZeroStage zero = ZeroStage::None;
  RingLayout ring_layout = RingLayout::Zigzag;
  RingAlgorithm ring_algorithm = RingAlgorithm::Flash;
  Msp msp;

  // A rank's place along every dimension (Note [Rank layout]).
  struct Coord {
    int replica = 0, stage = 0, ring = 0, ulysses = 0, member = 0;
    bool operator==(const Coord&) const = default;
  };

  int ranks() const { return tp * ulysses * cp * pp * dp; }
  // The ranks of one pipeline stage of one replica: every ring, Ulysses and TP member.
  int stage_ranks() const { return tp * ulysses * cp; }
  // The ranks that split a subsequence's tokens between them outside the tensor-parallel
  // regions: ring members times Ulysses members.
  int sequence_shards() const { return cp * ulysses; }
  bool rsa() const { return cp > 1 && ring_algorithm == RingAlgorithm::Rsa; }

  int rank_of(const Coord& c) const;
  Coord coord_of(int rank) const;

  // Groups of world ranks, in rank order: the tensor-parallel group of `rank`, its ring (the
  // cp members with its replica, stage, Ulysses index and member), its Ulysses group, and the
  // ranks that hold the same layers and shards (every replica's, ring member's and Ulysses
  // member's with its stage and member: the weight gradients' all-reduce and the ZeRO shards).
  std::vector<int> tp_group(int rank) const;
  std::vector<int> ring_group(int rank) const;
  std::vector<int> ulysses_group(int rank) const;
  std::vector<int> layer_group(int rank) const;
  // Ranks the ZeRO stage shards over (the layer group's size; 1 without ZeRO), and `rank`'s
  // shard among them.
  int zero_shards() const { return zero == ZeroStage::None ? 1 : dp * cp * ulysses; }
  int zero_index(int rank) const;
  // What keeps ZeRO-2 and 3 (Notes [ZeRO-2] and [ZeRO-3] in schedule/weights.h) from
  // sharding this layout's gradients and weights, as a phrase naming the option; null where
  // they run: two or more ranks hold each layer, no tensor parallelism, no MSP. The planner
  // searches them where this is null; train refuses the rest with it.
  const char* zero_sharding_refused() const;

  // Every degree at least 1 and the ranks at most kMaxRanks; throws sppo::Error naming
  // `component`.
  void check(const char* component) const;

  bool operator==(const ParallelDims&) const = default;
};

// The layout's degrees as plans and logs print them, e.g. "tp 2 cp 4 pp 2 dp 1" (tp,
// ulysses and cp where above 1; pp and dp always).
std::string layout_text(const ParallelDims& d);

}  // namespace sppo
