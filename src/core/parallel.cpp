#include "core/parallel.h"

#include <algorithm>
#include <sstream>

#include "core/check.h"

namespace sppo {

const char* to_string(RingLayout l) { return l == RingLayout::Zigzag ? "zigzag" : "contiguous"; }

RingLayout parse_ring_layout(const std::string& text) {
  if (text == "zigzag") return RingLayout::Zigzag;
  if (text == "contiguous") return RingLayout::Contiguous;
  SPPO_CHECK(false, "options") << "ring layout must be zigzag or contiguous (got '" << text << "')";
  return RingLayout::Contiguous;
}

const char* to_string(RingAlgorithm a) { return a == RingAlgorithm::Rsa ? "rsa" : "flash"; }

void parse_ring(const std::string& text, ParallelDims& par) {
  std::size_t b = 0;
  while (b <= text.size()) {
    const std::size_t e = std::min(text.find(',', b), text.size());
    const std::string word = text.substr(b, e - b);
    if (word == "zigzag" || word == "contiguous") {
      par.ring_layout = parse_ring_layout(word);
    } else if (word == "flash" || word == "rsa") {
      par.ring_algorithm = word == "rsa" ? RingAlgorithm::Rsa : RingAlgorithm::Flash;
    } else {
      SPPO_CHECK(false, "options") << "--ring '" << text << "': '" << word
                                   << "' is not a ring layout (zigzag, contiguous) or algorithm (flash, rsa); e.g. "
                                      "--ring zigzag or --ring rsa,contiguous";
    }
    b = e + 1;
  }
}

ZeroStage parse_zero_stage(long long n, int highest, const char* component, const std::string& what) {
  SPPO_CHECK(n >= 0 && n <= highest, component)
      << what << " " << n << " is not a ZeRO stage this build runs; use 0 (nothing sharded)"
      << (highest >= 1 ? ", 1 (the AdamW state sharded over the ranks that hold the same layers)" : "")
      << (highest >= 2 ? ", 2 (the gradients too: each layer's reduce-scattered as its backward ends)" : "")
      << (highest >= 3 ? ", 3 (the weights too: each layer's all-gathered for the ops that run it)" : "");
  return ZeroStage(n);
}

int ParallelDims::rank_of(const Coord& c) const {
  return (((c.replica * pp + c.stage) * cp + c.ring) * ulysses + c.ulysses) * tp + c.member;
}

ParallelDims::Coord ParallelDims::coord_of(int rank) const {
  Coord c;
  c.member = rank % tp;
  rank /= tp;
  c.ulysses = rank % ulysses;
  rank /= ulysses;
  c.ring = rank % cp;
  rank /= cp;
  c.stage = rank % pp;
  c.replica = rank / pp;
  return c;
}

std::vector<int> ParallelDims::tp_group(int rank) const {
  Coord c = coord_of(rank);
  std::vector<int> g;
  for (c.member = 0; c.member < tp; ++c.member) g.push_back(rank_of(c));
  return g;
}

std::vector<int> ParallelDims::ring_group(int rank) const {
  Coord c = coord_of(rank);
  std::vector<int> g;
  for (c.ring = 0; c.ring < cp; ++c.ring) g.push_back(rank_of(c));
  return g;
}

std::vector<int> ParallelDims::ulysses_group(int rank) const {
  Coord c = coord_of(rank);
  std::vector<int> g;
  for (c.ulysses = 0; c.ulysses < ulysses; ++c.ulysses) g.push_back(rank_of(c));
  return g;
}

std::vector<int> ParallelDims::layer_group(int rank) const {
  Coord c = coord_of(rank);
  std::vector<int> g;
  for (c.replica = 0; c.replica < dp; ++c.replica)
    for (c.ring = 0; c.ring < cp; ++c.ring)
      for (c.ulysses = 0; c.ulysses < ulysses; ++c.ulysses) g.push_back(rank_of(c));
  return g;
}

const char* ParallelDims::zero_sharding_refused() const {
  return dp * cp * ulysses < 2 ? "one rank holding each layer (no --dp, --cp or --ulysses to shard over)"
         : tp > 1              ? "--tp (each rank holds shards of every layer already)"
         : msp.on              ? "--msp on (helpers return a stage's gradients whole)"
                               : nullptr;
}

int ParallelDims::zero_index(int rank) const {
  if (zero == ZeroStage::None) return 0;
  const Coord c = coord_of(rank);
  return (c.replica * cp + c.ring) * ulysses + c.ulysses;
}

void ParallelDims::check(const char* component) const {
  SPPO_CHECK(tp >= 1 && ulysses >= 1 && cp >= 1 && pp >= 1 && dp >= 1, component)
      << "every parallel degree must be at least 1 (got " << layout_text(*this) << ")";
  long long n = 1;
  for (const int d : {tp, ulysses, cp, pp, dp}) n = std::min<long long>(n * d, (long long)kMaxRanks + 1);
  SPPO_CHECK(n <= kMaxRanks, component) << "the layout " << layout_text(*this) << " has more than " << kMaxRanks
                                        << " ranks";
}

std::string layout_text(const ParallelDims& d) {
  std::ostringstream os;
  if (d.tp > 1) os << "tp " << d.tp << " ";
  if (d.ulysses > 1) os << "ulysses " << d.ulysses << " ";
  if (d.cp > 1) os << "cp " << d.cp << " ";
  os << "pp " << d.pp << " dp " << d.dp;
  return os.str();
}

}  // namespace sppo
