// File helpers: whole-file reads, crash-safe (atomic) writes and read-only
// memory maps. Every error names the path and the OS error (strerror), so a
// failed checkpoint save or load says exactly which file and why.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "core/status.h"

namespace laplace {

// Reads the whole file at `path` into *out (replacing its contents).
// Errors: not_found (no such file or directory), io_error (permission denied,
// a directory, a read error). *out is unspecified on error.
Status read_file(const std::string& path, std::string* out);

// Writes exactly n bytes to f. Buffered write errors (e.g. ENOSPC) may only show
// at fflush/fclose, which write_file_atomic checks. The message carries the OS
// error but not the path (a FILE* does not know it); write_file_atomic adds it.
Status write_all(std::FILE* f, const void* data, size_t n);

// Crash-safe replacement of `path`:
//   1. creates `path + ".tmp.<pid>.<n>.h<host>"` (n: a per-process counter, host: a tag of
//      this machine's name; O_EXCL, so no
//      two writers, threads or processes, ever share a temporary) in the same
//      directory (so the rename below stays within one filesystem and is atomic),
//      with permissions `mode` (before the umask); temporaries of `path` left by
//      processes that no longer exist (a crash, kill -9) are removed first,
//   2. calls writer(f) on it, then checks fflush, fsyncs the file and closes it,
//   3. renames the temp file over `path`, then fsyncs the directory so the new
//      directory entry itself survives a power loss.
// On any failure (including the writer returning an error or throwing) the
// temp file is removed and the previous file at `path`, if any, is untouched;
// the returned error names `path`. Concurrent writers of one path each write
// their own temporary; the last rename wins, and the file is always one of them whole.
// `tidy` false skips step 1's removal of dead writers' temporaries, which lists the whole
// directory: for a writer that tidies its directory itself (the session store, whose
// directory may hold tens of thousands of files).
Status write_file_atomic(const std::string& path, const std::function<Status(std::FILE*)>& writer,
                         unsigned mode = 0666, bool tidy = true);
Status write_file_atomic(const std::string& path, const void* data, size_t n, unsigned mode = 0666);

// Removes the temporaries of write_file_atomic in `dir` (`NAME.tmp.<pid>[.<n>[.h<host>]]`)
// whose writer is dead: written on this machine by a process that is gone (kill(pid, 0)
// fails with ESRCH), or written by another machine sharing the directory (NFS) and not
// touched for an hour; `name_suffix` non-empty limits it to NAMEs ending so (".session").
// A temporary of a live writer is left alone. Returns how many were removed (errors are
// ignored: this is tidying).
int64_t remove_stale_temporaries(const std::string& dir, const std::string& name_suffix = "");
// The same for one target path's temporaries (`path.tmp.*`).
// An exclusive lock between processes (and threads) on the file `path`, created 0600 when
// absent: an open file description lock (fcntl F_OFD_SETLKW), which the kernel drops when
// its holder dies (kill -9 included: never a stuck lock) and which NFS carries as a POSIX
// lock. The lock file may be removed by its holder (remove_and_unlock); a waiter that then
// gets it finds it unlinked and takes the new one instead, so two holders never coexist.
class FileLock {
 public:
  FileLock() = default;
  FileLock(const FileLock&) = delete;
  FileLock& operator=(const FileLock&) = delete;
  ~FileLock() { unlock(); }
  // Blocks until held. Errors: io_error naming the path.
  Status lock(const std::string& path);
  void unlock();
  // Removes the lock file, then unlocks.
  void remove_and_unlock();
  bool held() const { return fd_ >= 0; }

 private:
  int fd_ = -1;
  std::string path_;
};

// A digest that identifies the contents of `paths`, in order (each file's size and bytes):
// 32 hex digits of XXH3-128 (xxhash). For telling whether two processes hold the same files
// (a fleet's replicas, the same model), not for security. Reads the files once.
// Errors: not_found / io_error naming the file.
Status hash_files(const std::vector<std::string>& paths, std::string* hex);

// This machine's tag in temporary names: 8 hex digits of a hash of its host name.
const std::string& temporary_host_tag();
int64_t remove_stale_temporaries_of(const std::string& path);

// A read-only, private memory map of a whole file (for large checkpoints and
// data shards: pages load on demand and are shared with the page cache).
// An empty file maps to data() == nullptr, size() == 0.
// Note: if another process truncates the file while it is mapped, touching the
// lost pages raises SIGBUS; files we map are only ever replaced by rename.
class MappedFile {
 public:
  MappedFile() = default;
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  MappedFile(MappedFile&& o) noexcept;
  MappedFile& operator=(MappedFile&& o) noexcept;

  // Maps `path`; *out is replaced only on success. Errors: not_found,
  // io_error (permission, not a regular file, mmap failure).
  static Status open(const std::string& path, MappedFile* out);

  const uint8_t* data() const { return data_; }
  uint64_t size() const { return size_; }
  const std::string& path() const { return path_; }
  bool is_open() const { return open_; }

 private:
  void reset();

  const uint8_t* data_ = nullptr;
  uint64_t size_ = 0;
  bool open_ = false;
  std::string path_;
};

}  // namespace laplace
