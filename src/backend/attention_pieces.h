// How one attention call of the backend interface (backend.h: a query span against several
// key/value blocks, each at its own global positions) becomes calls of a fused attention
// library that knows one key/value tensor per call and two masks (cuDNN's SDPA, used by the
// CUDA backend: backends/cuda/library_attention.h). Pure functions of positions and
// pointers, so that the CPU tests check them.
//
// Note [Attention pieces]
// ~~~~~~~~~~~~~~~~~~~~~~~
// Query row t (global position q_pos0 + t) sees key row s of a block (position k_pos0 + s)
// iff k_pos0 + s <= q_pos0 + t. With off = q_pos0 - k_pos0, row t sees the block's keys
// [0, min(Tk, t + off + 1)): none for t < -off, all of them for t >= Tk - 1 - off, a prefix
// in between. A library call takes a rectangle of rows and keys with one of two masks:
//   None         every row sees every key of the call;
//   BottomRight  the causal mask aligned to the bottom-right corner: row i of `rows` sees
//                keys [0, keys - rows + i] (keys >= rows).
// So a block is at most two pieces: rows [t0, t1) BottomRight over keys [0, t1 + off), where
// t0 = max(0, -off) is the first row that sees a key and t1 the row after the first that
// sees them all (its last row sees exactly t1 + off keys, and row t0 + i sees t0 + i + off
// + 1: the corner); then rows [t1, Tq) None over every key. Where no row sees only part of
// the block, the block is one None piece (an earlier subsequence's block, a streamed chunk,
// a bidirectional model's keys); a subsequence's own block (off 0, Tq = Tk) is one
// BottomRight piece. Rows that see no key of any block are in no piece (out 0, lse -inf).
#pragma once

#include <cstddef>
#include <vector>

#include "backend/backend.h"
#include "core/config.h"

namespace sppo {

enum class PieceMask { None, BottomRight };

// One library call: query rows [q0, q0 + rows) of the span against key rows [0, keys) of
// block `block`, with `mask`.
struct AttnPiece {
  int block = 0;
  int q0 = 0, rows = 0;
  int keys = 0;
  PieceMask mask = PieceMask::None;
};

// Where a block's keys are: `rows` keys from global position pos0.
struct KeySpan {
  int rows = 0;
  i64 pos0 = 0;
};

// The pieces of Tq queries from q_pos0 against `blocks` (Note [Attention pieces]), block by
// block in order; within a block the BottomRight piece first.
std::vector<AttnPiece> attention_pieces(int Tq, i64 q_pos0, const std::vector<KeySpan>& blocks);

// The key spans of a call's blocks.
std::vector<KeySpan> key_spans(const std::vector<KVRef>& blocks);

// Blocks joined where one continues the previous in position and in memory (its k, v, and
// dk, dv when present, start where the previous ones end at the strides of `d`), so that a
// library call covers them at once. `act_bytes`: bytes of an activation element.
std::vector<KVRef> join_adjacent_blocks(const std::vector<KVRef>& blocks, const AttnShape& d, std::size_t act_bytes);

// Blocks cut into consecutive blocks of at most max_rows rows (the pointers and positions
// advanced to each part's first row).
std::vector<KVRef> split_blocks(const std::vector<KVRef>& blocks, int max_rows, const AttnShape& d,
                                std::size_t act_bytes);

// Note [Length classes] (backends/cuda/sdpa.h): the length a library graph is built for, n
// rounded up to 1/8 of its power of two, at least 64: at most 12.5% over n.
i64 sdpa_length_class(i64 n);

// Note [Library scratch]: what one library attention call takes from the kernels' scratch
// (Backend::block_scratch): Tq query rows of Z heads and key parts of at most Tk rows (Zkv
// heads), head size A, activations of act_bytes, lengths rounded to their classes:
//   forward   O and Stats of a piece's rows: class(rows) (Z A act + Z fp32);
//   backward  an output whose rowsum with dO is delta (Tq Z A act), the fp32 sum of dQ over
//             the pieces (Tq Z A fp32), a piece's Stats and dQ (class(rows) (Z fp32 + Z A
//             act)), dK and dV (2 class(keys) Zkv A act);
// and the library's own workspace for the graph (workspace_bytes, known once it is built);
// each buffer aligned to 256 bytes, plus the call's two lengths. So that the scratch does not
// grow with a subsequence (at 75 KB a token for gpt-7b's heads it would cost long runs more
// than the attention saves), a call given a block's scratch runs at most kLibraryQueryRows
// query rows and kLibraryKeyRows keys of a block at a time; the scratch holds one such call
// with the library's workspace at the size of cuDNN's backward (an fp32 dQ accumulator and
// row sums: Note [cuDNN's dP workspace] in backends/cuda/sdpa_cudnn.cpp). A call whose graph
// asks for more halves its key parts, then its query rows, until it fits
// (backends/cuda/library_attention.cpp). Callers that pass no scratch (the benchmarks) run
// each call whole, from CUDA's stream-ordered pool.
inline constexpr int kLibraryQueryRows = 8192;
inline constexpr int kLibraryKeyRows = 8192;
struct LibraryCallBytes {
  std::size_t rows_side = 0;    // everything but the key parts' dK, dV and the library's workspace
  std::size_t per_key_row = 0;  // dK, dV per row of a key part's class
};
LibraryCallBytes library_call_bytes(bool backward, int Tq, int rows_class, int pieces, int Z, int Zkv, int A,
                                    std::size_t act_bytes);
// The library's workspace the scratch allows a graph of `rows_class` query rows.
std::size_t library_workspace_bound(int rows_class, int Z, int A);

// The kernels' scratch a block reserves for library attention calls (Note [Library scratch]):
// fixed, whatever the block's length.
KernelScratch library_attention_scratch(const ModelConfig& c, std::size_t act_bytes);

}  // namespace sppo
