// Invariant checks for programming errors (wrong shapes passed between our own
// components, CUDA/BLAS failures). They print file:line and a hint, then abort:
// such errors are bugs, never the user's input. User input is validated with Status.
#pragma once

#include <cstdio>
#include <cstdlib>

namespace laplace {
[[noreturn]] void check_failed(const char* file, int line, const char* expr, const char* msg);
}  // namespace laplace

#define LAPLACE_CHECK(cond, msg)                                          \
  do {                                                                    \
    if (!(cond)) ::laplace::check_failed(__FILE__, __LINE__, #cond, msg); \
  } while (0)
