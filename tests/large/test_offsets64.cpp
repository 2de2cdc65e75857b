// The CPU kernels, a copy stream with the memory tiers, and the safetensors writer and reader on
// tensors past 2^31 elements (label large: the program runs alone; at its peak it holds about
// 8.5 GiB, with a 4 GiB file on /dev/shm for a while). An element offset, byte count or loop
// index in 32 bits would wrap there.
//
// Memory: every large buffer is an anonymous mapping with MAP_NORESERVE, whose pages cost
// nothing until written (untouched pages read as zeros). Inputs are zeros except a few rows at
// the far end, filled with fresh random values; outputs are checked on those rows against a
// float64 reference computed from them alone. Two shapes reach past 2^31:
//  - dense [T, H] rows (T H > 2^31): the kernel writes every row, so the output takes its
//    8 GiB; one output buffer serves a chain of kernels, each checked on the far rows;
//  - a few rows of a huge stride (ld = 2^20 + 16 floats, 2112 rows): the row offsets pass
//    2^31 while only the rows' pages are touched, which reaches the kernels with strides
//    (attention, the linear layer through OpenBLAS, the column copies, RoPE) for a few MiB.
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "backends/cpu/attention.h"
#include "backends/cpu/ops.h"
#include "core/check.h"
#include "core/rope.h"
#include "io/fileutil.h"
#include "io/safetensors.h"
#include "runtime/memory.h"
#include "support/expect_error.h"

namespace sppo {
namespace {

constexpr i64 k2to31 = i64{1} << 31;

// Memory that costs nothing until written: untouched pages read as zeros.
// `whole`: the buffer is read or written whole, in huge pages where the system has them (a
// few thousand page faults instead of two million); otherwise in 4 KiB pages, so that each
// touched row of a strided buffer costs 4 KiB, not 2 MiB.
class Sparse {
 public:
  explicit Sparse(std::size_t bytes, bool whole = false) : bytes_(bytes) {
    p_ = mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    SPPO_ASSERT_MSG(p_ != MAP_FAILED, "mmap of " << bytes_ << " bytes (MAP_NORESERVE) failed");
    madvise(p_, bytes_, whole ? MADV_HUGEPAGE : MADV_NOHUGEPAGE);
  }
  ~Sparse() { munmap(p_, bytes_); }
  Sparse(const Sparse&) = delete;
  Sparse& operator=(const Sparse&) = delete;
  float* f() const { return static_cast<float*>(p_); }
  void* get() const { return p_; }

 private:
  std::size_t bytes_;
  void* p_;
};

std::size_t floats(i64 n) { return std::size_t(n) * sizeof(float); }

// Fresh random values, never zero.
std::vector<float> randn(std::size_t n, std::mt19937& rng, float scale = 1.0f, float shift = 0.0f) {
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) {
    do x = d(rng);
    while (x == 0.0f);
    x = x * scale + shift;
  }
  return v;
}

// |got - want| <= atol + rtol |want| for each of n values; reports the first failures.
template <typename Got>
void expect_close(const Got& got, const std::vector<double>& want, double atol, double rtol, const std::string& what) {
  std::size_t bad = 0;
  for (std::size_t i = 0; i < want.size(); ++i) {
    const double g = got(i), w = want[i];
    if (!(std::fabs(g - w) <= atol + rtol * std::fabs(w)) && bad++ < 5)
      ADD_FAILURE() << what << " [" << i << "]: got " << g << ", want " << w;
  }
  EXPECT_EQ(bad, 0u) << what << ": " << bad << " of " << want.size() << " values out of tolerance";
}

double max_abs(const std::vector<double>& v) {
  double m = 0;
  for (double x : v) m = std::max(m, std::fabs(x));
  return m;
}

// The dense rows' shape: [T, H] of 2^31 + 8192 elements, whose last kFar rows start at 2^31.
constexpr int kH = 1024, kT = (1 << 21) + 8, kFar = 8;
static_assert(i64(kT - kFar) * kH == k2to31);

// The buffer the tests below write whole (a tensor read back, a copy's destination, the dense
// rows' output), T H floats (8 GiB), kept for the program's life: a page written the first time
// costs far more than the writes themselves (about 1.4 s a GiB on a virtual machine), so each is
// first written once. Every test writes what it reads of it.
float* arena() {
  static Sparse a(floats(i64(kT) * kH), true);
  return a.f();
}

// =============================================================================================
// Strided rows: 2112 rows 2^20 + 16 floats apart, the last ones past 2^31
// =============================================================================================

constexpr int kRows = 2112;
constexpr int kLd = (1 << 20) + 16;
constexpr int kFarRow = 2100;  // rows from here on start past 2^31
static_assert(i64(kFarRow) * kLd > k2to31);

struct Strided {
  Sparse buf{floats(i64(kRows) * kLd)};
  float* row(int t) const { return buf.f() + i64(t) * kLd; }
  void put(const std::vector<float>& dense, int width, int col = 0) {
    for (int t = 0; t < kRows; ++t) std::copy_n(dense.data() + std::size_t(t) * width, width, row(t) + col);
  }
};

// Causal attention with grouped-query heads (Z = 2 query heads read one key/value head), every
// operand kLd apart: the far query rows' out, lse and dq, the far key rows' dk and dv, and the
// delta of the far rows, against float64.
TEST(Offsets64, CpuAttentionOnStridedRowsPast2to31) {
  const int Z = 2, A = 64, W = Z * A, T = kRows;
  std::mt19937 rng(99);
  Strided q, k, v, out, dout, dq, dk, dv;
  const std::vector<float> qs = randn(std::size_t(T) * W, rng), ks = randn(std::size_t(T) * A, rng),
                           vs = randn(std::size_t(T) * A, rng), dos = randn(std::size_t(T) * W, rng);
  q.put(qs, W), k.put(ks, A), v.put(vs, A), dout.put(dos, W);
  cpu::AttnDims d;
  d.Tq = T, d.Z = Z, d.A = A, d.Zkv = 1;
  d.ldq = d.ldk = d.ldv = d.ldo = kLd;
  std::vector<float> lse(std::size_t(Z) * T), delta(std::size_t(Z) * T);
  cpu::attention_forward_blocks(out.buf.f(), lse.data(), q.buf.f(), {{k.buf.f(), v.buf.f(), dk.buf.f(), dv.buf.f(), T, 0}}, d);
  cpu::attention_backward_delta(delta.data(), dout.buf.f(), out.buf.f(), d);
  cpu::attention_backward_blocks(dq.buf.f(), dout.buf.f(), q.buf.f(), {{k.buf.f(), v.buf.f(), dk.buf.f(), dv.buf.f(), T, 0}},
                                 lse.data(), delta.data(), d);

  const double c = 1.0 / std::sqrt(double(A));
  const auto dot = [&](const std::vector<float>& a, int ra, int wa, int ca, const std::vector<float>& b, int rb, int wb,
                       int cb) {
    double s = 0;
    for (int j = 0; j < A; ++j) s += double(a[std::size_t(ra) * wa + ca + j]) * b[std::size_t(rb) * wb + cb + j];
    return s;
  };
  // Forward and dq of the far query rows, with float64 probabilities P and dS from the
  // float64 lse and delta.
  std::vector<double> oref, lref, dref, dqref;
  std::vector<std::vector<double>> lse64(Z, std::vector<double>(T)), delta64(Z, std::vector<double>(T));
  for (int t = kFarRow; t < T; ++t)
    for (int z = 0; z < Z; ++z) {
      double mx = -1e300, s = 0;
      for (int j = 0; j <= t; ++j) mx = std::max(mx, c * dot(qs, t, W, z * A, ks, j, A, 0));
      std::vector<double> o(A, 0.0);
      for (int j = 0; j <= t; ++j) {
        const double p = std::exp(c * dot(qs, t, W, z * A, ks, j, A, 0) - mx);
        s += p;
        for (int a = 0; a < A; ++a) o[a] += p * vs[std::size_t(j) * A + a];
      }
      lse64[z][t] = mx + std::log(s);
      double dl = 0;
      for (int a = 0; a < A; ++a) {
        o[a] /= s;
        oref.push_back(o[a]);
        dl += o[a] * dos[std::size_t(t) * W + z * A + a];
      }
      delta64[z][t] = dl;
      lref.push_back(lse64[z][t]);
      dref.push_back(dl);
      std::vector<double> g(A, 0.0);
      for (int j = 0; j <= t; ++j) {
        const double p = std::exp(c * dot(qs, t, W, z * A, ks, j, A, 0) - lse64[z][t]);
        const double ds = p * (dot(dos, t, W, z * A, vs, j, A, 0) - dl) * c;
        for (int a = 0; a < A; ++a) g[a] += ds * ks[std::size_t(j) * A + a];
      }
      dqref.insert(dqref.end(), g.begin(), g.end());
    }
  const auto rows_of = [&](const Strided& s) {
    return [&s](std::size_t i) {
      const std::size_t per_row = std::size_t(Z) * A;
      const int t = kFarRow + int(i / per_row);
      return double(s.row(t)[i % per_row]);
    };
  };
  const auto heads_of = [&](const std::vector<float>& x) {
    return [&x, Z, T](std::size_t i) { return double(x[std::size_t(i % Z) * T + kFarRow + i / Z]); };
  };
  expect_close(rows_of(out), oref, 1e-5, 1e-4, "attention out far rows");
  expect_close(heads_of(lse), lref, 1e-5, 1e-5, "attention lse far rows");
  expect_close(heads_of(delta), dref, 1e-5, 1e-4, "attention delta far rows");
  expect_close(rows_of(dq), dqref, 1e-4 * max_abs(dqref), 1e-4, "attention dq far rows");

  // dk, dv of the far key rows: the queries t >= s of both heads (their lse and delta in
  // float64 from the rows above).
  std::vector<double> dkref, dvref;
  for (int s = kFarRow; s < T; ++s) {
    std::vector<double> gk(A, 0.0), gv(A, 0.0);
    for (int t = s; t < T; ++t)
      for (int z = 0; z < Z; ++z) {
        const double p = std::exp(c * dot(qs, t, W, z * A, ks, s, A, 0) - lse64[z][t]);
        const double ds = p * (dot(dos, t, W, z * A, vs, s, A, 0) - delta64[z][t]) * c;
        for (int a = 0; a < A; ++a) {
          gk[a] += ds * qs[std::size_t(t) * W + z * A + a];
          gv[a] += p * dos[std::size_t(t) * W + z * A + a];
        }
      }
    dkref.insert(dkref.end(), gk.begin(), gk.end());
    dvref.insert(dvref.end(), gv.begin(), gv.end());
  }
  const auto kv_rows_of = [&](const Strided& s) {
    return [&s](std::size_t i) { return double(s.row(kFarRow + int(i / 64))[i % 64]); };
  };
  expect_close(kv_rows_of(dk), dkref, 1e-4 * max_abs(dkref), 1e-4, "attention dk far rows");
  expect_close(kv_rows_of(dv), dvref, 1e-4 * max_abs(dvref), 1e-4, "attention dv far rows");
}

// The linear layer (OpenBLAS with leading dimensions of 2^20 + 16 and 2112 rows: its own
// offsets pass 2^31), the column copies of the backend, and RoPE, on strided rows.
TEST(Offsets64, CpuLinearCopiesRopeOnStridedRowsPast2to31) {
  const int T = kRows, I = 48, O = 80;
  std::mt19937 rng(5);
  Strided in, out, dout;
  const std::vector<float> xs = randn(std::size_t(T) * I, rng), gs = randn(std::size_t(T) * O, rng),
                           w = randn(std::size_t(O) * I, rng), b = randn(O, rng);
  in.put(xs, I), dout.put(gs, O);
  cpu::linear_forward(out.buf.f(), in.buf.f(), w.data(), b.data(), T, I, O, kLd, kLd);
  std::vector<double> ref;
  for (int t = kFarRow; t < T; ++t)
    for (int o = 0; o < O; ++o) {
      double s = b[o];
      for (int i = 0; i < I; ++i) s += double(xs[std::size_t(t) * I + i]) * w[std::size_t(o) * I + i];
      ref.push_back(s);
    }
  expect_close([&](std::size_t i) { return double(out.row(kFarRow + int(i / O))[i % O]); }, ref, 1e-5, 1e-5,
               "linear_forward far rows");
  // Backward: din (dense) of the far rows; dw and db sum over every row.
  std::vector<float> din(std::size_t(T) * I), dw(std::size_t(O) * I, 0.0f), db(O, 0.0f);
  cpu::linear_backward(din.data(), dw.data(), db.data(), dout.buf.f(), in.buf.f(), w.data(), T, I, O, kLd, kLd);
  std::vector<double> dinref, dwref(std::size_t(O) * I, 0.0), dbref(O, 0.0);
  for (int t = kFarRow; t < T; ++t)
    for (int i = 0; i < I; ++i) {
      double s = 0;
      for (int o = 0; o < O; ++o) s += double(gs[std::size_t(t) * O + o]) * w[std::size_t(o) * I + i];
      dinref.push_back(s);
    }
  for (int t = 0; t < T; ++t)
    for (int o = 0; o < O; ++o) {
      dbref[o] += gs[std::size_t(t) * O + o];
      for (int i = 0; i < I; ++i) dwref[std::size_t(o) * I + i] += double(gs[std::size_t(t) * O + o]) * xs[std::size_t(t) * I + i];
    }
  expect_close([&](std::size_t i) { return double(din[std::size_t(kFarRow) * I + i]); }, dinref, 1e-5, 1e-5,
               "linear_backward din far rows");
  expect_close([&](std::size_t i) { return double(dw[i]); }, dwref, 1e-4, 1e-5, "linear_backward dw");
  expect_close([&](std::size_t i) { return double(db[i]); }, dbref, 1e-4, 1e-5, "linear_backward db");

  // The backend's column copies: dense -> columns [col, col + width) of the strided rows and back.
  auto be = make_backend("cpu");
  const int width = 24, col = 100;
  const std::vector<float> dense = randn(std::size_t(T) * width, rng);
  be->put_cols(out.buf.f(), dense.data(), true, T, width, kLd, col);
  std::vector<float> back(dense.size());
  be->copy_cols(back.data(), out.buf.f(), T, width, kLd, col);
  EXPECT_EQ(back, dense);
  for (int t = kFarRow; t < T; ++t) ASSERT_EQ(out.row(t)[col + width - 1], dense[std::size_t(t) * width + width - 1]);
  be->zero_cols(out.buf.f(), T, width, kLd, col);
  for (int t = kFarRow; t < T; ++t) ASSERT_EQ(out.row(t)[col], 0.0f);

  // RoPE on Z heads of A at the start of each strided row, at positions past 10^6: the far
  // rows against a float64 rotation.
  const int Z = 2, A = 64;
  const i64 pos0 = 1000003;
  const RopeTable table = rope_table(A, 10000.0);
  const std::vector<float> x0 = randn(std::size_t(T) * Z * A, rng);
  Strided r;
  r.put(x0, Z * A);
  cpu::rope_forward(r.buf.f(), T, Z, A, pos0, table, kLd);
  std::vector<double> rref;
  for (int t = kFarRow; t < T; ++t)
    for (int z = 0; z < Z; ++z)
      for (int j = 0; j < A; ++j) {
        const int jj = j % (A / 2);
        const double ang = double(pos0 + t) * table.inv_freq[jj], cs = std::cos(ang), sn = std::sin(ang);
        const double lo = x0[std::size_t(t) * Z * A + z * A + jj], hi = x0[std::size_t(t) * Z * A + z * A + jj + A / 2];
        rref.push_back(j < A / 2 ? lo * cs - hi * sn : hi * cs + lo * sn);
      }
  expect_close([&](std::size_t i) { return double(r.row(kFarRow + int(i / (Z * A)))[i % (Z * A)]); }, rref, 1e-5, 1e-5,
               "rope_forward far rows");
}

// =============================================================================================
// A copy stream and the memory tiers: one buffer of 2^32 + 4160 bytes (a bf16 tensor of more
// than 2^31 elements), offloaded to the host
// =============================================================================================

TEST(Offsets64, CopyStreamAndTiersPast2to32Bytes) {
  const i64 bytes = (i64{1} << 32) + 4160;  // not a whole number of 64-byte lines
  auto be = make_backend("cpu");
  MemoryTier device(Tier::Device, bytes + bytes / 2, be.get()), host(Tier::Host, 0, be.get());
  Buffer dev = device.alloc(bytes, "x");
  EXPECT_EQ(device.stats().current, bytes);
  // A second one does not fit the budget: the message names its bytes.
  EXPECT_ERROR_WITH(device.alloc(bytes, "y"), std::to_string(bytes).c_str(), "budget");
  std::mt19937 rng(1);
  std::vector<unsigned char> tail(1 << 20);
  for (auto& c : tail) c = static_cast<unsigned char>(rng() | 1);
  auto* d = static_cast<unsigned char*>(dev.data());
  std::memcpy(d + bytes - i64(tail.size()), tail.data(), tail.size());
  d[0] = 17, d[k2to31] = 29;

  // The host tier accounts for the copy; its bytes land in the arena (already written once).
  Buffer h = host.alloc(bytes, "x on the host");
  auto* hp = reinterpret_cast<unsigned char*>(arena());
  auto stream = be->make_copy_stream();
  bool released = false;
  device.expect_release(bytes);
  const auto done = stream->copy(hp, dev.data(), std::size_t(bytes), [&] {
    dev.reset();
    device.settle(bytes);
    released = true;
  });
  done->wait();
  stream->synchronize();
  EXPECT_TRUE(released);
  EXPECT_EQ(device.stats().current, 0);
  EXPECT_EQ(host.stats().peak, bytes);
  EXPECT_EQ(std::memcmp(hp + bytes - i64(tail.size()), tail.data(), tail.size()), 0) << "the far end did not arrive";
  EXPECT_EQ(hp[0], 17);
  EXPECT_EQ(hp[k2to31], 29);
}

// =============================================================================================
// safetensors: a bf16 tensor of 2^31 + 8 elements written and read back
// =============================================================================================

// On tmpfs (/dev/shm): on a disk the writer's fsync of 4 GiB takes half a minute.
TEST(Offsets64, SafetensorsWriteReadPast2to31Elements) {
  if (access("/dev/shm", W_OK) != 0) GTEST_SKIP() << "no writable /dev/shm for a 4 GiB file";
  const char* tmpdir = std::getenv("TMPDIR");
  const std::string saved = tmpdir != nullptr ? tmpdir : "";
  setenv("TMPDIR", "/dev/shm", 1);
  io::TempDir dir("sppo-offsets64");
  if (tmpdir != nullptr) setenv("TMPDIR", saved.c_str(), 1);
  else unsetenv("TMPDIR");
  const i64 numel = k2to31 + 8;
  const std::size_t bytes = std::size_t(numel) * 2;
  Sparse src(bytes);
  std::mt19937 rng(3);
  std::vector<std::uint16_t> far(4096);
  for (auto& v : far) v = static_cast<std::uint16_t>(rng() | 1);
  auto* s = static_cast<std::uint16_t*>(src.get());
  std::copy(far.begin(), far.end(), s + numel - i64(far.size()));  // across element 2^31
  const std::vector<float> small = randn(64, rng);
  const std::string path = dir.file("big.safetensors");
  io::write_safetensors(path, {{"big", io::DType::BF16, {numel}, src.get()}, {"small", io::DType::F32, {8, 8}, small.data()}});

  io::SafetensorsReader r(path);
  EXPECT_EQ(r.at("big").nbytes(), bytes);
  EXPECT_EQ(r.at("small").begin, bytes);
  std::vector<float> got(64);
  r.read<float>("small", {8, 8}, got.data());
  EXPECT_EQ(got, small);
  r.read("big", io::DType::BF16, {numel}, arena());
  const auto* bp = reinterpret_cast<const std::uint16_t*>(arena());
  const auto diff = std::mismatch(far.begin(), far.end(), bp + numel - i64(far.size()));
  EXPECT_TRUE(diff.first == far.end()) << "the far end did not come back: element "
                                       << numel - i64(far.size()) + (diff.first - far.begin()) << " is " << *diff.second
                                       << ", not " << *diff.first;
  EXPECT_EQ(bp[12345], 0);
}

// =============================================================================================
// Dense rows: a [T, H] fp32 tensor of 2^31 + 8192 elements through a chain of kernels
// =============================================================================================

TEST(Offsets64, CpuKernelsOnDenseRowsPast2to31) {
  const int T = kT, H = kH, t0 = T - kFar;
  const i64 n = i64(T) * H, at = i64(t0) * H;
  std::mt19937 rng(2024);
  Sparse x(floats(n), true);
  float* const out = arena();  // written whole by the first kernel
  const std::vector<float> xf = randn(std::size_t(kFar) * H, rng, 2.0f, 1.0f);
  std::copy(xf.begin(), xf.end(), x.f() + at);
  const std::vector<float> w = randn(H, rng), b = randn(H, rng);
  std::vector<float> mean(T), rstd(T);
  const auto far = [&](std::size_t i) { return double(out[at + i64(i)]); };
  const auto xv = [&](int t, int h) { return double(xf[std::size_t(t) * H + h]); };
  const float eps = 1e-5f;

  // LayerNorm forward, statistics in double.
  cpu::layernorm_forward(out, mean.data(), rstd.data(), x.f(), w.data(), b.data(), T, H, eps);
  std::vector<double> ref(std::size_t(kFar) * H), mu(kFar), rs(kFar);
  for (int t = 0; t < kFar; ++t) {
    double s = 0, ss = 0;
    for (int h = 0; h < H; ++h) s += xv(t, h);
    mu[t] = s / H;
    for (int h = 0; h < H; ++h) ss += (xv(t, h) - mu[t]) * (xv(t, h) - mu[t]);
    rs[t] = 1.0 / std::sqrt(ss / H + eps);
    for (int h = 0; h < H; ++h) ref[std::size_t(t) * H + h] = (xv(t, h) - mu[t]) * rs[t] * w[h] + b[h];
    EXPECT_NEAR(mean[t0 + t], mu[t], 1e-6 * std::fabs(mu[t]));
    EXPECT_NEAR(rstd[t0 + t], rs[t], 1e-6 * rs[t]);
  }
  expect_close(far, ref, 1e-5 * max_abs(ref), 1e-5, "layernorm_forward far rows");
  // A row of zeros (all but the far end) normalises to the bias.
  EXPECT_EQ(out[at - H + 7], b[7]);

  // The residual add through the backend (one fp32 add per element: exact against double).
  auto be = make_backend("cpu");
  for (std::size_t i = 0; i < ref.size(); ++i) ref[i] = double(float(far(i)) + xf[i]);
  be->add_inplace(out, x.f(), n);
  expect_close(far, ref, 0.0, 0.0, "add_inplace far rows");

  // GeLU's backward in place (din aliases dout): out = out * gelu'(x).
  for (std::size_t i = 0; i < ref.size(); ++i) {
    const double xx = xf[i], u = 0.7978845608028654 * (xx + 0.044715 * xx * xx * xx);
    const double th = std::tanh(u);
    const double d = 0.5 * (1 + th) + 0.5 * xx * (1 - th * th) * 0.7978845608028654 * (1 + 3 * 0.044715 * xx * xx);
    ref[i] = far(i) * d;
  }
  cpu::gelu_backward(out, out, x.f(), n);
  expect_close(far, ref, 1e-6 * max_abs(ref), 1e-5, "gelu_backward far rows");

  // LayerNorm backward: dx (out) accumulates; dw, db sum over every row, where only the far
  // rows are not zero (dout = x).
  std::vector<float> dw(H, 0.5f), db(H, -0.25f);
  std::vector<double> dwr(H, 0.5), dbr(H, -0.25);
  for (int t = 0; t < kFar; ++t) {
    const double m = mean[t0 + t], r = rstd[t0 + t];
    double sg = 0, sgx = 0;
    for (int h = 0; h < H; ++h) {
      const double xhat = (xv(t, h) - m) * r, g = xv(t, h) * w[h];
      sg += g, sgx += g * xhat;
      dwr[h] += xv(t, h) * xhat, dbr[h] += xv(t, h);
    }
    for (int h = 0; h < H; ++h) {
      const double xhat = (xv(t, h) - m) * r;
      ref[std::size_t(t) * H + h] = far(std::size_t(t) * H + h) + r * (xv(t, h) * w[h] - sg / H - xhat * sgx / H);
    }
  }
  cpu::layernorm_backward(out, dw.data(), db.data(), x.f(), x.f(), w.data(), mean.data(), rstd.data(), T, H);
  expect_close(far, ref, 1e-5 * max_abs(ref), 1e-5, "layernorm_backward dx far rows");
  expect_close([&](std::size_t i) { return double(dw[i]); }, dwr, 1e-5 * max_abs(dwr), 1e-5, "layernorm_backward dw");
  expect_close([&](std::size_t i) { return double(db[i]); }, dbr, 1e-5 * max_abs(dbr), 1e-5, "layernorm_backward db");

  // Cross-entropy over rows of V = H logits, in place: the far rows' losses and gradients, and
  // the total. Every other row holds b gelu'(0) = b / 2 by now (LayerNorm of zeros is b).
  std::vector<std::int32_t> targets(T);
  std::uniform_int_distribution<std::int32_t> pick(0, H - 1);
  for (auto& t : targets) t = pick(rng);
  targets[T - 2] = kNoTarget;  // a row not predicted, at the far end
  std::vector<float> losses(T);
  const float scale = 1.0f / 3.0f;
  std::vector<double> lref(kFar);
  double half_b_lse = 0, half_b_max = -1e300;
  for (int h = 0; h < H; ++h) half_b_max = std::max(half_b_max, 0.5 * b[h]);
  for (int h = 0; h < H; ++h) half_b_lse += std::exp(0.5 * b[h] - half_b_max);
  half_b_lse = half_b_max + std::log(half_b_lse);
  double total_ref = 0;
  for (int t = 0; t < t0; ++t) total_ref += half_b_lse - 0.5 * b[targets[t]];
  for (int t = 0; t < kFar; ++t) {
    const int tg = targets[t0 + t];
    double mx = -1e300, s = 0;
    for (int h = 0; h < H; ++h) mx = std::max(mx, far(std::size_t(t) * H + h));
    for (int h = 0; h < H; ++h) s += std::exp(far(std::size_t(t) * H + h) - mx);
    const double lse = mx + std::log(s);
    lref[t] = tg == kNoTarget ? 0.0 : lse - far(std::size_t(t) * H + tg);
    total_ref += lref[t];
    for (int h = 0; h < H; ++h) {
      double d = std::exp(far(std::size_t(t) * H + h) - lse) - (h == tg ? 1.0 : 0.0);
      ref[std::size_t(t) * H + h] = tg == kNoTarget ? 0.0 : d * scale;
    }
  }
  const double total = cpu::xent_forward_backward(out, losses.data(), targets.data(), T, H, scale);
  expect_close(far, ref, 1e-7 * scale, 1e-5, "xent dlogits far rows");
  expect_close([&](std::size_t i) { return double(losses[std::size_t(t0) + i]); }, lref, 1e-5, 1e-5, "xent losses");
  EXPECT_NEAR(total, total_ref, 1e-6 * std::fabs(total_ref));

  // The optimizer's norm over all n elements of x (only the far rows are not zero), and its
  // scaling, of out (x stays unwritten).
  double ss = 0;
  for (float v : xf) ss += double(v) * v;
  EXPECT_NEAR(cpu::sum_squares(x.f(), n), ss, 1e-12 * ss);
  const float last = out[n - 1], first = out[at];
  cpu::scale_inplace(out, n, 0.5f);
  EXPECT_EQ(out[n - 1], last * 0.5f);
  EXPECT_EQ(out[at], first * 0.5f);
}


// The embedding table of a vocabulary of 2^21 + 8 tokens of H = 1024 (2^31 + 8192 floats): the
// rows of token ids past 2^21 start past 2^31. Only those rows are touched.
TEST(Offsets64, CpuEmbeddingPast2to31) {
  const int V = kT, H = kH, T = 6;
  Sparse embed(floats(i64(V) * H)), dembed(floats(i64(V) * H));
  std::mt19937 rng(8);
  const std::vector<std::int32_t> ids = {V - 1, 3, V - 5, V - 1, V - 8, V - 6};
  std::vector<float> rows = randn(std::size_t(T) * H, rng);
  for (int t = 0; t < T; ++t) std::copy_n(rows.data() + std::size_t(t) * H, H, embed.f() + i64(ids[t]) * H);
  std::vector<float> out(std::size_t(T) * H);
  cpu::embedding_forward(out.data(), ids.data(), embed.f(), T, H);
  for (int t = 0; t < T; ++t)
    for (int h = 0; h < H; ++h)
      ASSERT_EQ(out[std::size_t(t) * H + h], embed.f()[i64(ids[t]) * H + h]) << "token " << t << " id " << ids[t];
  // The backward adds each token's row into its id's row, in token order (id V - 1 twice).
  const std::vector<float> dout = randn(std::size_t(T) * H, rng);
  cpu::embedding_backward(dembed.f(), dout.data(), ids.data(), T, H, V);
  for (int h = 0; h < H; ++h) {
    EXPECT_EQ(dembed.f()[i64(V - 1) * H + h], (0.0f + dout[h]) + dout[std::size_t(3) * H + h]);
    EXPECT_EQ(dembed.f()[i64(V - 8) * H + h], dout[std::size_t(4) * H + h]);
    EXPECT_EQ(dembed.f()[i64(3) * H + h], dout[std::size_t(1) * H + h]);
  }
  // The shard of the table from row v0 = 4 (its row 0): its rows id - v0, past 2^31 floats from
  // its start for the far ids.
  const int v0 = 4, Vr = V - v0;
  std::fill(out.begin(), out.end(), -1.0f);
  cpu::embedding_shard_forward(out.data(), ids.data(), embed.f() + i64(v0) * H, T, H, v0, Vr);
  for (int h = 0; h < H; ++h) {
    EXPECT_EQ(out[h], embed.f()[i64(V - 1) * H + h]);
    EXPECT_EQ(out[std::size_t(1) * H + h], 0.0f);  // id 3: another shard's
  }
}

}  // namespace
}  // namespace sppo
