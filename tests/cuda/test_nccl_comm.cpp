// The communicators of CUDA ranks on device memory, on one GPU and one rank (what a machine
// with one GPU can run): NCCL's (backends/cuda/nccl_comm.h, a one-rank communicator) through
// every collective of comm/comm.h in every type, apart and in place, ZeRO's in-place pieces,
// and messages to itself (several tags, received in another order than sent: Note
// [Rendezvous]); and the staged transport (runtime/staged_comm.h) through the same
// collectives. Each result against what the operation means on one rank, on fresh random
// data. Between two GPUs NCCL runs on no machine these tests reach, and with them the paths
// that only several members take (uneven blocks: a reduce per block, grouped sends and
// receives; an all-to-all's sends and receives). Needs a GPU and NCCL: skips without.
#include <gtest/gtest.h>

#include <memory>
#include <random>
#include <string>

#include "backend/backend.h"
#include "comm/comm.h"
#include "core/check.h"
#include "cuda/cuda_test.h"
#include "runtime/staged_comm.h"
#include "support/collectives.h"

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
  // The collectives every transport runs, in every type, on device buffers, against their
  // one-rank meaning: the receive buffer starts as other random elements and ends as the send
  // buffer's, which stays as it was; in place, nothing changes.
  void collectives(comm::Comm& c) {
    const comm::Group one{0};
    std::mt19937_64 rng(rng_());
    for (const comm::Type t : every_type()) {
      for (const i64 n : {i64{0}, i64{1000}, i64{4097}}) {
        const std::string what = std::string(comm::type_name(t)) + " x " + std::to_string(n);
        const Elements x = random_elements(t, n, rng);
        Dev d = upload_elements(x);
        comm::wait(c, c.iallreduce(d.get(), n, t, one), "all-reduce");
        EXPECT_EQ(download_elements(d, t, n), x) << "all-reduce of " << what;
        comm::wait(c, c.ibroadcast(d.get(), n, t, 0, one), "broadcast");
        EXPECT_EQ(download_elements(d, t, n), x) << "broadcast of " << what;
        Dev rs = upload_elements(random_elements(t, n, rng)), ag = upload_elements(random_elements(t, n, rng)),
            a2a = upload_elements(random_elements(t, n, rng));
        comm::wait(c, c.ireduce_scatter(d.get(), rs.get(), {n}, t, one), "reduce-scatter");
        EXPECT_EQ(download_elements(rs, t, n), x) << "reduce-scatter of " << what;
        comm::wait(c, c.iallgather(d.get(), ag.get(), {n}, t, one), "all-gather");
        EXPECT_EQ(download_elements(ag, t, n), x) << "all-gather of " << what;
        comm::wait(c, c.ialltoall(d.get(), {n}, a2a.get(), {n}, t, one), "all-to-all");
        EXPECT_EQ(download_elements(a2a, t, n), x) << "all-to-all of " << what;
        EXPECT_EQ(download_elements(d, t, n), x) << "the send buffer of " << what;
        comm::wait(c, c.ireduce_scatter(d.get(), d.get(), {n}, t, one), "reduce-scatter in place");
        EXPECT_EQ(download_elements(d, t, n), x) << "reduce-scatter in place of " << what;
        comm::wait(c, c.iallgather(d.get(), d.get(), {n}, t, one), "all-gather in place");
        EXPECT_EQ(download_elements(d, t, n), x) << "all-gather in place of " << what;
      }
    }
    // ZeRO's in-place pieces, and host memory, which passes through the host's communicator.
    const Elements x = random_elements(comm::Type::F32, 1001, rng);
    Dev d = upload_elements(x);
    comm::wait(c, comm::ireduce_scatter_pieces(c, d.as<float>(), 1001, one), "reduce-scatter of pieces");
    comm::wait(c, comm::iallgather_pieces(c, d.as<float>(), 1001, one), "all-gather of pieces");
    EXPECT_EQ(download_elements(d, comm::Type::F32, 1001), x) << "pieces";
    const Elements h = random_elements(comm::Type::F64, 5, rng);
    Elements hr = random_elements(comm::Type::F64, 5, rng);
    comm::wait(c, c.ialltoall(h.data(), {5}, hr.data(), {5}, comm::Type::F64, one), "a host all-to-all");
    EXPECT_EQ(hr, h);
  }
  static Dev upload_elements(const Elements& x) {
    Dev d(std::size_t(x.size() * comm::type_bytes(x.type())));
    SPPO_CUDA_CHECK(cudaMemcpy(d.get(), x.data(), std::size_t(x.size() * comm::type_bytes(x.type())),
                               cudaMemcpyHostToDevice));
    SPPO_CUDA_CHECK(cudaDeviceSynchronize());
    return d;
  }
  static Elements download_elements(const Dev& d, comm::Type t, i64 n) {
    SPPO_CUDA_CHECK(cudaDeviceSynchronize());
    Elements x(t, n);
    SPPO_CUDA_CHECK(cudaMemcpy(x.data(), d.get(), std::size_t(n * comm::type_bytes(t)), cudaMemcpyDeviceToHost));
    return x;
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
