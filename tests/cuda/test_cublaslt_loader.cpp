// cuBLASLt is opened on the CUDA backend's first call to it, not when a program starts
// (src/backends/cuda/cublaslt_loader.cpp). Runs without a GPU: the calls below only ask the
// library for names and host-side descriptors.
#include <cublasLt.h>
#include <gtest/gtest.h>

#include <fstream>
#include <string>

namespace {

bool mapped(const std::string& library) {
  std::ifstream maps("/proc/self/maps");
  std::string line;
  while (std::getline(maps, line)) {
    if (line.find(library) != std::string::npos) return true;
  }
  return false;
}

TEST(CublasLtLoader, OpensTheLibraryOnTheFirstCallOnly) {
  EXPECT_FALSE(mapped("libcublasLt")) << "the program was started with cuBLASLt loaded";
  EXPECT_STREQ(cublasLtGetStatusName(CUBLAS_STATUS_NOT_SUPPORTED), "CUBLAS_STATUS_NOT_SUPPORTED");
  EXPECT_TRUE(mapped("libcublasLt"));
  // Calls with arguments reach the library's functions with those arguments: no place for
  // the layout is refused, a place is not.
  EXPECT_EQ(cublasLtMatrixLayoutCreate(nullptr, CUDA_R_16BF, 96, 64, 96), CUBLAS_STATUS_INVALID_VALUE);
  cublasLtMatrixLayout_t layout = nullptr;
  ASSERT_EQ(cublasLtMatrixLayoutCreate(&layout, CUDA_R_16BF, 96, 64, 96), CUBLAS_STATUS_SUCCESS);
  EXPECT_NE(layout, nullptr);
  EXPECT_EQ(cublasLtMatrixLayoutDestroy(layout), CUBLAS_STATUS_SUCCESS);
}

}  // namespace
