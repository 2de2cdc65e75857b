// cuBLASLt, opened the first time the CUDA backend calls it.
//
// Linked the ordinary way, libcublasLt (517 MB, 353 thousand relocations) was loaded and
// relocated by every start of every sppo process, a CPU run or `sppo plan` as much as a GPU
// one: 25 thousand page faults and about 0.1 s of CPU a start, most of what a small command
// cost. The functions the backend calls are defined here instead, each forwarding to the
// library's own, which is opened (dlopen) on the first call: by its soname, then by the path
// the build found it at (SPPO_CUBLASLT_SONAME, SPPO_CUBLASLT_PATH from CMakeLists.txt).
// The declarations are cublasLt.h's, so a changed signature fails to compile here.
#include <cublasLt.h>
#include <dlfcn.h>

#include <string>

#include "core/check.h"

namespace {

void* library() {
  static void* const handle = [] {
    void* h = dlopen(SPPO_CUBLASLT_SONAME, RTLD_NOW | RTLD_LOCAL);
    if (h != nullptr) return h;
    const std::string by_name = dlerror();
    h = dlopen(SPPO_CUBLASLT_PATH, RTLD_NOW | RTLD_LOCAL);
    SPPO_CHECK(h != nullptr, "cuda") << "the CUDA backend needs cuBLASLt, which could not be opened ("
                                     << by_name << "; " << dlerror()
                                     << "): install the CUDA toolkit's libraries of the version sppo was "
                                        "built with, or put their folder on LD_LIBRARY_PATH";
    return h;
  }();
  return handle;
}

template <class Fn>
Fn symbol(const char* name) {
  void* f = dlsym(library(), name);
  SPPO_CHECK(f != nullptr, "cuda") << "cuBLASLt (" << SPPO_CUBLASLT_SONAME << ") has no " << name
                                   << ": it is older than the CUDA toolkit sppo was built with";
  return reinterpret_cast<Fn>(f);
}

}  // namespace

// Each body: the library's function of the same name, looked up once.
#define SPPO_FORWARD(fn, ...)                                  \
  static const auto real = symbol<decltype(&fn)>(#fn);         \
  return real(__VA_ARGS__)

extern "C" {

cublasStatus_t CUBLASWINAPI cublasLtCreate(cublasLtHandle_t* handle) { SPPO_FORWARD(cublasLtCreate, handle); }

cublasStatus_t CUBLASWINAPI cublasLtDestroy(cublasLtHandle_t handle) { SPPO_FORWARD(cublasLtDestroy, handle); }

const char* CUBLASWINAPI cublasLtGetStatusName(cublasStatus_t status) {
  SPPO_FORWARD(cublasLtGetStatusName, status);
}

const char* CUBLASWINAPI cublasLtGetStatusString(cublasStatus_t status) {
  SPPO_FORWARD(cublasLtGetStatusString, status);
}

cublasStatus_t CUBLASWINAPI cublasLtMatmul(cublasLtHandle_t handle, cublasLtMatmulDesc_t desc, const void* alpha,
                                           const void* A, cublasLtMatrixLayout_t Adesc, const void* B,
                                           cublasLtMatrixLayout_t Bdesc, const void* beta, const void* C,
                                           cublasLtMatrixLayout_t Cdesc, void* D, cublasLtMatrixLayout_t Ddesc,
                                           const cublasLtMatmulAlgo_t* algo, void* workspace,
                                           size_t workspace_bytes, cudaStream_t stream) {
  SPPO_FORWARD(cublasLtMatmul, handle, desc, alpha, A, Adesc, B, Bdesc, beta, C, Cdesc, D, Ddesc, algo, workspace,
               workspace_bytes, stream);
}

cublasStatus_t CUBLASWINAPI cublasLtMatmulAlgoGetHeuristic(cublasLtHandle_t handle, cublasLtMatmulDesc_t desc,
                                                           cublasLtMatrixLayout_t Adesc, cublasLtMatrixLayout_t Bdesc,
                                                           cublasLtMatrixLayout_t Cdesc, cublasLtMatrixLayout_t Ddesc,
                                                           cublasLtMatmulPreference_t preference, int requested,
                                                           cublasLtMatmulHeuristicResult_t results[], int* returned) {
  SPPO_FORWARD(cublasLtMatmulAlgoGetHeuristic, handle, desc, Adesc, Bdesc, Cdesc, Ddesc, preference, requested,
               results, returned);
}

cublasStatus_t CUBLASWINAPI cublasLtMatmulDescCreate(cublasLtMatmulDesc_t* desc, cublasComputeType_t compute,
                                                     cudaDataType_t scale) {
  SPPO_FORWARD(cublasLtMatmulDescCreate, desc, compute, scale);
}

cublasStatus_t CUBLASWINAPI cublasLtMatmulDescDestroy(cublasLtMatmulDesc_t desc) {
  SPPO_FORWARD(cublasLtMatmulDescDestroy, desc);
}

cublasStatus_t CUBLASWINAPI cublasLtMatmulDescSetAttribute(cublasLtMatmulDesc_t desc,
                                                           cublasLtMatmulDescAttributes_t attr, const void* buf,
                                                           size_t bytes) {
  SPPO_FORWARD(cublasLtMatmulDescSetAttribute, desc, attr, buf, bytes);
}

cublasStatus_t CUBLASWINAPI cublasLtMatmulPreferenceCreate(cublasLtMatmulPreference_t* preference) {
  SPPO_FORWARD(cublasLtMatmulPreferenceCreate, preference);
}

cublasStatus_t CUBLASWINAPI cublasLtMatmulPreferenceDestroy(cublasLtMatmulPreference_t preference) {
  SPPO_FORWARD(cublasLtMatmulPreferenceDestroy, preference);
}

cublasStatus_t CUBLASWINAPI cublasLtMatmulPreferenceSetAttribute(cublasLtMatmulPreference_t preference,
                                                                 cublasLtMatmulPreferenceAttributes_t attr,
                                                                 const void* buf, size_t bytes) {
  SPPO_FORWARD(cublasLtMatmulPreferenceSetAttribute, preference, attr, buf, bytes);
}

cublasStatus_t CUBLASWINAPI cublasLtMatrixLayoutCreate(cublasLtMatrixLayout_t* layout, cudaDataType type,
                                                       uint64_t rows, uint64_t cols, int64_t ld) {
  SPPO_FORWARD(cublasLtMatrixLayoutCreate, layout, type, rows, cols, ld);
}

cublasStatus_t CUBLASWINAPI cublasLtMatrixLayoutDestroy(cublasLtMatrixLayout_t layout) {
  SPPO_FORWARD(cublasLtMatrixLayoutDestroy, layout);
}

}  // extern "C"
