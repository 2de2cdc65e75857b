// What the launcher that started the ranks (Open MPI's mpirun, Slurm's srun, MPICH's
// mpiexec) tells each process through its environment. MPI itself gives the rank and the
// world's size (comm/mpi); these give what MPI does not: the local rank, which picks a GPU,
// and how many ranks share this machine's cores and memory.
//
// Note [Launchers]
// ~~~~~~~~~~~~~~~~
// mpirun sets OMPI_COMM_WORLD_LOCAL_RANK and OMPI_COMM_WORLD_LOCAL_SIZE; MPICH's mpiexec
// MPI_LOCALRANKID and MPI_LOCALNRANKS; srun SLURM_LOCALID, and SLURM_STEP_TASKS_PER_NODE with
// SLURM_NODEID (the node's index in the step). Slurm's are read last, and only inside an
// srun step (SLURM_STEP_NUM_TASKS set): a batch script's environment carries SLURM_LOCALID=0
// into every rank that an mpirun or mpiexec inside it starts, and those launchers start
// their remote daemons with srun, one task per node, so each rank there would read 0.
// Under srun the ranks find each other through the MPI plugin (srun --mpi=pmix, which sets
// PMIX_RANK); without one, MPI_Init in each task makes a world of one, and every task would
// train the whole model alone: check_launch refuses that before any work.
#pragma once

namespace sppo::comm {

// This process's rank among the job's ranks on this machine, or -1 where no launcher says.
int launcher_local_rank();

// How many of the job's ranks run on this machine, or 0 where no launcher says.
int launcher_local_size();

// The tasks of the srun step that started this process (SLURM_STEP_NUM_TASKS), 0 outside
// one.
int srun_tasks();

// Throws sppo::Error where an srun of several tasks started this process without an MPI
// plugin, so that each task would run alone (Note [Launchers]).
void check_launch();

}  // namespace sppo::comm
