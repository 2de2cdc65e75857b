// The communicators of CUDA ranks on device memory, on one GPU and one rank (what a machine
// with one GPU can run): NCCL's (backends/cuda/nccl_comm.h, a one-rank communicator) through
// every collective the runtime uses, even and uneven pieces, and through messages to itself
// (several tags, received in another order than sent: Note [Rendezvous]); and the staged
// transport (runtime/staged_comm.h) through the same collectives. Each result against what
// the operation means on one rank, on fresh random data. Between two GPUs NCCL runs on no
// machine these tests reach. Needs a GPU and NCCL: skips without.
#include <gtest/gtest.h>

#include <memory>

#include "backend/backend.h"
#include "comm/comm.h"
#include "core/check.h"
#include "cuda/cuda_test.h"
#include "runtime/staged_comm.h"

namespace sppo {
namespace {

using namespace sppo::testing;

class DeviceComm : public Cuda {
 protected:
  void SetUp() override {
    Cuda::SetUp();
    if (IsSkipped()) return;
    be_ = make_backend("cuda", "fp32", "own");
    host_ = comm::make_solo();
  }
  // The collectives every transport runs, on device buffers, against their one-rank meaning.
  void collectives(comm::Comm& c) {
    const comm::Group one{0};
    for (const i64 n : {i64{1000}, i64{4096}}) {
      const Vec x = randn(std::size_t(n), rng_);
      Dev d = upload(x, DType::F32);
      comm::wait(c, c.iallreduce(d.get(), n, comm::Type::F32, one), "all-reduce");
      expect_equal(download(d, std::size_t(n), DType::F32), x, "all-reduce of " + std::to_string(n));
      comm::wait(c, comm::ireduce_scatter_pieces(c, d.as<float>(), n, one), "reduce-scatter");
      expect_equal(download(d, std::size_t(n), DType::F32), x, "reduce-scatter of " + std::to_string(n));
      comm::wait(c, comm::iallgather_pieces(c, d.as<float>(), n, one), "all-gather");
      expect_equal(download(d, std::size_t(n), DType::F32), x, "all-gather of " + std::to_string(n));
      comm::wait(c, c.ibroadcast(d.get(), n * 4, comm::Type::U8, 0, one), "broadcast");
      expect_equal(download(d, std::size_t(n), DType::F32), x, "broadcast of " + std::to_string(n));
    }
    // Host memory passes through the host's communicator.
    std::vector<double> h{1.5, -2.0};
    comm::wait(c, c.iallreduce(h.data(), 2, comm::Type::F64, one), "a host all-reduce");
    EXPECT_EQ(h[1], -2.0);
  }
  std::unique_ptr<Backend> be_;
  std::unique_ptr<comm::Comm> host_;
};

TEST_F(DeviceComm, NcclOnOneRankThroughEveryCollectiveAndMessagesToItself) {
  std::unique_ptr<comm::Comm> nccl;
  try {
    nccl = be_->make_nccl_comm(*host_);
  } catch (const Error& e) {
    GTEST_SKIP() << e.what();
  }
  collectives(*nccl);
  // Messages to itself: three tags, posted receives in another order than the sends, the
  // second receive of tag 5 after the first.
  const Vec a = randn(300, rng_), b = randn(500, rng_), c = randn(700, rng_);
  Dev sa = upload(a, DType::F32), sb = upload(b, DType::F32), sc = upload(c, DType::F32);
  Dev ra(300 * 4), rb(500 * 4), rc(700 * 4);
  const comm::Request r1 = nccl->irecv(rc.get(), 700 * 4, 0, 5);
  const comm::Request s1 = nccl->isend(sa.get(), 300 * 4, 0, 7);
  const comm::Request s2 = nccl->isend(sc.get(), 700 * 4, 0, 5);
  const comm::Request r2 = nccl->irecv(ra.get(), 300 * 4, 0, 7);
  const comm::Request s3 = nccl->isend(sb.get(), 500 * 4, 0, 5);
  const comm::Request r3 = nccl->irecv(rb.get(), 500 * 4, 0, 5);
  for (comm::Request r : {r3, s1, r1, s2, r2, s3}) comm::wait(*nccl, r, "a message to itself");
  expect_equal(download(ra, 300, DType::F32), a, "tag 7");
  expect_equal(download(rc, 700, DType::F32), c, "tag 5, first");
  expect_equal(download(rb, 500, DType::F32), b, "tag 5, second");
}

TEST_F(DeviceComm, StagedThroughEveryCollective) {
  StagedComm staged(*host_, *be_, false);
  collectives(staged);
  EXPECT_GT(staged.staged_out_bytes(), 0);
  EXPECT_GT(staged.staged_in_bytes(), 0);
}

}  // namespace
}  // namespace sppo
