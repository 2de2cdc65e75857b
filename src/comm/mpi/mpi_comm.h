// The OpenMPI implementation of comm::Comm (internal to comm/). MPI is initialised when
// it is made and finalised at exit; the rest of the engine sees only comm/comm.h.
#pragma once

#include <memory>

#include "comm/comm.h"

namespace sppo::comm {

std::unique_ptr<Comm> make_mpi();

// The text set_activity() last stored (for the message of a rank the launcher ends).
const char* current_activity();

}  // namespace sppo::comm
