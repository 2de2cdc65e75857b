// Emulated cuBLASLt (tests/cuda/emulate): only what backends/cuda/check.h names.
#pragma once

enum cublasStatus_t { CUBLAS_STATUS_SUCCESS = 0 };
inline const char* cublasLtGetStatusName(cublasStatus_t) { return "CUBLAS_STATUS (emulated)"; }
inline const char* cublasLtGetStatusString(cublasStatus_t) { return "emulated"; }
