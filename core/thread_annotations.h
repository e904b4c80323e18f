// Clang thread-safety annotations (https://clang.llvm.org/docs/ThreadSafetyAnalysis.html):
// they say which mutex guards a field and which lock a function expects to hold, so that a
// reader sees the locking rule beside the data, and clang's -Wthread-safety can check it.
// Under clang they expand to the attributes; under other compilers (GCC builds the project)
// to nothing, so they never change the generated code.
//
// The checking needs a standard library whose std::mutex and std::lock_guard are annotated
// themselves: libc++ with _LIBCPP_ENABLE_THREAD_SAFETY_ANNOTATIONS. With libstdc++ (Debian's
// default) clang cannot see a lock_guard take the mutex, so -Wthread-safety would flag every
// guarded access: there the annotations are documentation, and the build does not enable it.
#pragma once

#if defined(__clang__)
#define LAPLACE_THREAD_ANNOTATION(x) __attribute__((x))
#else
#define LAPLACE_THREAD_ANNOTATION(x)
#endif

// A type that is a lock (a mutex class of our own).
#define CAPABILITY(x) LAPLACE_THREAD_ANNOTATION(capability(x))
// An RAII type that holds a lock for its lifetime.
#define SCOPED_CAPABILITY LAPLACE_THREAD_ANNOTATION(scoped_lockable)

// A field read or written only with `x` held.
#define GUARDED_BY(x) LAPLACE_THREAD_ANNOTATION(guarded_by(x))
// A pointer (or smart pointer) whose pointee is read or written only with `x` held.
#define PT_GUARDED_BY(x) LAPLACE_THREAD_ANNOTATION(pt_guarded_by(x))

// Lock ordering: this mutex is taken before / after the others.
#define ACQUIRED_BEFORE(...) LAPLACE_THREAD_ANNOTATION(acquired_before(__VA_ARGS__))
#define ACQUIRED_AFTER(...) LAPLACE_THREAD_ANNOTATION(acquired_after(__VA_ARGS__))

// The caller must hold the lock(s) (exclusively / shared) when calling the function.
#define REQUIRES(...) LAPLACE_THREAD_ANNOTATION(requires_capability(__VA_ARGS__))
#define REQUIRES_SHARED(...) LAPLACE_THREAD_ANNOTATION(requires_shared_capability(__VA_ARGS__))

// The function takes / releases the lock(s) and returns with them held / released.
#define ACQUIRE(...) LAPLACE_THREAD_ANNOTATION(acquire_capability(__VA_ARGS__))
#define ACQUIRE_SHARED(...) LAPLACE_THREAD_ANNOTATION(acquire_shared_capability(__VA_ARGS__))
#define RELEASE(...) LAPLACE_THREAD_ANNOTATION(release_capability(__VA_ARGS__))
#define RELEASE_SHARED(...) LAPLACE_THREAD_ANNOTATION(release_shared_capability(__VA_ARGS__))
#define TRY_ACQUIRE(...) LAPLACE_THREAD_ANNOTATION(try_acquire_capability(__VA_ARGS__))

// The caller must not hold the lock(s): the function takes them itself.
#define EXCLUDES(...) LAPLACE_THREAD_ANNOTATION(locks_excluded(__VA_ARGS__))

// The function checks at run time that the lock is held.
#define ASSERT_CAPABILITY(x) LAPLACE_THREAD_ANNOTATION(assert_capability(x))

// The function returns a reference to the given lock.
#define RETURN_CAPABILITY(x) LAPLACE_THREAD_ANNOTATION(lock_returned(x))

// Turns the analysis off for one function (code whose locking it cannot follow).
#define NO_THREAD_SAFETY_ANALYSIS LAPLACE_THREAD_ANNOTATION(no_thread_safety_analysis)
