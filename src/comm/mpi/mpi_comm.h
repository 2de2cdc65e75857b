// The OpenMPI implementation of comm::Comm (internal to comm/). MPI is initialised when
// it is made and finalised at exit; the rest of the engine sees only comm/comm.h.
//
// Note [Counts past MPI's int]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// MPI 3 (OpenMPI 4 has no MPI 4 large-count calls) counts elements and places blocks with
// int: past 2^31 - 1 elements a count or a displacement overflows, and so do the totals an
// implementation computes inside a v-collective. The interface's counts are 64-bit, so the
// MPI transport cuts:
//  - a reduce-scatter or all-gather whose blocks, all together, fit the limit is one MPI call
//    (MPI_Ireduce_scatter, MPI_Iallgatherv); past it each block goes alone, cut into chunks
//    of at most the limit and addressed by pointer rather than by displacement: one
//    MPI_Ireduce per chunk to the block's member, one MPI_Ibcast per chunk from it. Every
//    member holds the same counts, so every member takes the same path and posts the same
//    calls in the same order, and they match;
//  - an all-reduce or a broadcast goes chunk by chunk (one call where it fits);
//  - an all-to-all is a receive and a send per chunk between each pair of members (what
//    MPI's own non-blocking all-to-all posts), on a communicator apart from the runtime's
//    messages: a member knows only its own counts, so no size could pick a path that every
//    member agrees on, and pairs need none (a send's chunks are its receive's chunks).
// One request covers all of an operation's calls. chunks() is the cutting, with no MPI in it,
// so that a unit test checks it under a small limit, and set_mpi_count_limit() lets the MPI
// tests run every split path on small buffers.
#pragma once

#include <memory>
#include <vector>

#include "comm/comm.h"

namespace sppo::comm {

std::unique_ptr<Comm> make_mpi();

// The text set_activity() last stored (for the message of a rank the launcher ends).
const char* current_activity();

// A piece of a block: elements [offset, offset + count) of it.
struct Chunk {
  i64 offset = 0, count = 0;
  bool operator==(const Chunk&) const = default;
};
// `count` elements as chunks of at most `limit` (>= 1), in order; none for zero.
std::vector<Chunk> chunks(i64 count, i64 limit);

// The most elements one MPI call moves or places: 2^31 - 1. Tests lower it (every rank alike)
// to run the split paths of Note [Counts past MPI's int].
i64 mpi_count_limit();
void set_mpi_count_limit(i64 elements);

}  // namespace sppo::comm
