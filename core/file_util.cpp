#include "core/file_util.h"

#include <csignal>
#include <cstdlib>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <memory>
#include <utility>
#include <vector>

namespace laplace {

namespace {

// strerror() is not thread-safe; strerror_r comes in a GNU flavour (returns
// char*) and an XSI one (returns int). These overloads accept either.
[[maybe_unused]] const char* pick_strerror(char* r, char* /*buf*/) { return r; }
[[maybe_unused]] const char* pick_strerror(int r, char* buf) { return r == 0 ? buf : "unknown error"; }

std::string os_error(int err) {
  char buf[256];
  buf[0] = '\0';
  return pick_strerror(strerror_r(err, buf, sizeof(buf)), buf);
}

// "<path>: <what>: <strerror>", with the Status code chosen from errno so that
// callers can tell a missing file (often expected) from a real failure.
Status errno_status(const std::string& path, const std::string& what, int err) {
  std::string msg = path + ": " + what + ": " + os_error(err);
  if (err == ENOENT || err == ENOTDIR) return Status::not_found(std::move(msg));
  return Status::io_error(std::move(msg));
}

// open(2) retried on EINTR (a signal during open on a slow filesystem is not an error).
int open_retry(const char* p, int flags, mode_t mode = 0) {
  int fd;
  do {
    fd = ::open(p, flags, mode);
  } while (fd < 0 && errno == EINTR);
  return fd;
}

// Removes the temp file of write_file_atomic on every path that does not reach
// the rename (early returns and exceptions thrown by the writer alike).
class TempFileGuard {
 public:
  explicit TempFileGuard(std::string tmp) : tmp_(std::move(tmp)) {}
  ~TempFileGuard() {
    if (f_ != nullptr) std::fclose(f_);
    if (!committed_) ::unlink(tmp_.c_str());
  }
  TempFileGuard(const TempFileGuard&) = delete;
  TempFileGuard& operator=(const TempFileGuard&) = delete;

  void set_file(std::FILE* f) { f_ = f; }
  // Closes the stream; returns fclose's result (0 or EOF) and leaves errno set.
  int close() {
    int r = std::fclose(f_);
    f_ = nullptr;  // fclose releases the stream even when it fails
    return r;
  }
  void commit() { committed_ = true; }

 private:
  std::string tmp_;
  std::FILE* f_ = nullptr;
  bool committed_ = false;
};

std::string parent_dir(const std::string& path) {
  std::string dir = std::filesystem::path(path).parent_path().string();
  return dir.empty() ? std::string(".") : dir;
}

// Opens `path` read-only and stats it; on failure nothing is left open.
Status open_for_reading(const std::string& path, int* fd_out, struct stat* st) {
  int fd = open_retry(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return errno_status(path, "cannot open for reading", errno);
  if (::fstat(fd, st) != 0) {
    int e = errno;
    ::close(fd);
    return errno_status(path, "cannot stat", e);
  }
  *fd_out = fd;
  return Status::ok();
}

}  // namespace

Status read_file(const std::string& path, std::string* out) {
  out->clear();
  // Size hint: read a regular file straight into a buffer of its size. Reading
  // continues to EOF regardless, so pipes, /proc files and files that grow
  // while we read are still read whole.
  int fd;
  struct stat st;
  LAPLACE_RETURN_IF_ERROR(open_for_reading(path, &fd, &st));
  // A directory opens fine with O_RDONLY; report it clearly instead of EISDIR on read.
  if (S_ISDIR(st.st_mode)) {
    ::close(fd);
    return Status::io_error(path + ": is a directory, not a file");
  }
  size_t pos = 0;
  if (S_ISREG(st.st_mode) && st.st_size > 0) out->resize(static_cast<size_t>(st.st_size));

  char chunk[1 << 16];
  for (;;) {
    char* dst;
    size_t want;
    if (pos < out->size()) {
      dst = out->data() + pos;
      want = out->size() - pos;
    } else {
      dst = chunk;
      want = sizeof(chunk);
    }
    ssize_t r = ::read(fd, dst, want);
    if (r < 0) {
      if (errno == EINTR) continue;
      int e = errno;
      ::close(fd);
      out->clear();
      return errno_status(path, "read failed after " + std::to_string(pos) + " bytes", e);
    }
    if (r == 0) break;  // EOF
    if (dst == chunk) {
      out->append(chunk, static_cast<size_t>(r));
    }
    pos += static_cast<size_t>(r);
  }
  out->resize(pos);  // the file may have shrunk since fstat
  ::close(fd);
  return Status::ok();
}

Status write_all(std::FILE* f, const void* data, size_t n) {
  if (n == 0) return Status::ok();
  // fwrite need not reset errno; clear it so a stale value is never reported.
  errno = 0;
  size_t w = std::fwrite(data, 1, n, f);
  if (w != n) {
    int e = errno;
    return Status::io_error("write failed after " + std::to_string(w) + " of " + std::to_string(n) +
                            " bytes: " + (e != 0 ? os_error(e) : std::string("short write")));
  }
  return Status::ok();
}

// Fault injection for the crash-safety tests: LAPLACE_TEST_KILL_DURING_WRITE=SUFFIX:N
// kills the process with SIGKILL during the N-th atomic write of a path ending in
// SUFFIX, after half of the temporary file reached the disk and before the rename:
// exactly the moment a real crash would hurt. Unset in normal use (one getenv).
static void maybe_kill_for_test(const std::string& path, std::FILE* f) {
  static const char* spec = std::getenv("LAPLACE_TEST_KILL_DURING_WRITE");
  if (spec == nullptr) return;
  static int seen = 0;
  std::string s = spec;
  const size_t colon = s.rfind(':');
  const std::string suffix = s.substr(0, colon);
  const int nth = colon == std::string::npos ? 1 : std::atoi(s.c_str() + colon + 1);
  if (path.size() < suffix.size() || path.compare(path.size() - suffix.size(), suffix.size(), suffix) != 0) return;
  if (++seen != nth) return;
  std::fflush(f);
  const off_t size = ::lseek(::fileno(f), 0, SEEK_END);
  if (size > 0 && ::ftruncate(::fileno(f), size / 2) != 0) std::perror("ftruncate");
  ::fsync(::fileno(f));
  ::kill(::getpid(), SIGKILL);
}

Status FileLock::lock(const std::string& path) {
  unlock();
  for (int attempt = 0; attempt < 1000; ++attempt) {
    const int fd = open_retry(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
    if (fd < 0) return errno_status(path, "cannot open the lock file", errno);
    struct flock fl{};
    fl.l_type = F_WRLCK;
    fl.l_whence = SEEK_SET;
    int rc;
    do rc = ::fcntl(fd, F_OFD_SETLKW, &fl);
    while (rc != 0 && errno == EINTR);
    if (rc != 0) {
      const int e = errno;
      ::close(fd);
      return errno_status(path, "cannot lock", e);
    }
    // Still the file at `path`? A holder may have removed it while we waited.
    struct stat held{}, now{};
    if (::fstat(fd, &held) == 0 && ::stat(path.c_str(), &now) == 0 && held.st_ino == now.st_ino &&
        held.st_dev == now.st_dev) {
      fd_ = fd;
      path_ = path;
      return Status::ok();
    }
    ::close(fd);
  }
  return Status::io_error(path + ": the lock file keeps being replaced");
}

void FileLock::unlock() {
  if (fd_ >= 0) ::close(fd_);  // closing the description releases its lock
  fd_ = -1;
}

void FileLock::remove_and_unlock() {
  if (fd_ >= 0) ::unlink(path_.c_str());
  unlock();
}

Status hash_files(const std::vector<std::string>& paths, std::string* hex) {
  XXH3_state_t* st = XXH3_createState();
  if (st == nullptr) return Status::out_of_memory("hash_files: no memory for the hash state");
  std::unique_ptr<XXH3_state_t, XXH_errorcode (*)(XXH3_state_t*)> own(st, XXH3_freeState);
  XXH3_128bits_reset(st);
  std::vector<char> buf(size_t(4) << 20);
  for (const std::string& path : paths) {
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) return errno_status(path, "cannot open it to hash it", errno);
    struct stat sb{};
    ::fstat(fd, &sb);
    const uint64_t size = static_cast<uint64_t>(sb.st_size);
    XXH3_128bits_update(st, &size, sizeof(size));  // so that moving bytes between files changes the digest
    while (true) {
      const ssize_t n = ::read(fd, buf.data(), buf.size());
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) {
        const int e = errno;
        ::close(fd);
        return errno_status(path, "read failed while hashing it", e);
      }
      if (n == 0) break;
      XXH3_128bits_update(st, buf.data(), static_cast<size_t>(n));
    }
    ::close(fd);
  }
  const XXH128_hash_t h = XXH3_128bits_digest(st);
  char out[33];
  std::snprintf(out, sizeof(out), "%016llx%016llx", static_cast<unsigned long long>(h.high64),
                static_cast<unsigned long long>(h.low64));
  *hex = out;
  return Status::ok();
}

// A pid means something only on the machine (or container) that wrote it, and a directory
// may be shared by several (sessions on NFS): temporaries carry their machine's tag.
const std::string& temporary_host_tag() {
  static const std::string tag = [] {
    char name[256] = {0};
    if (::gethostname(name, sizeof(name) - 1) != 0) name[0] = 0;
    uint32_t h = 2166136261u;  // FNV-1a: a tag, not a digest
    for (const char* c = name; *c; ++c) h = (h ^ static_cast<uint8_t>(*c)) * 16777619u;
    char out[16];
    std::snprintf(out, sizeof(out), "%08x", h);
    return std::string(out);
  }();
  return tag;
}

namespace {

// `NAME.tmp.<pid>[.<n>[.h<tag>]]`: the pid of the writer (0 when `file` is not such a
// name); *tag its host's tag ("" for names from before tags, taken as this machine's).
long temporary_owner(const std::string& file, std::string* target, std::string* tag) {
  const size_t at = file.rfind(".tmp.");
  if (at == std::string::npos || at == 0) return 0;
  std::vector<std::string> parts;
  for (size_t from = at + 5;;) {
    const size_t dot = file.find('.', from);
    parts.push_back(file.substr(from, dot == std::string::npos ? std::string::npos : dot - from));
    if (dot == std::string::npos) break;
    from = dot + 1;
  }
  auto digits = [](const std::string& x) {
    return !x.empty() && x.size() <= 10 && std::all_of(x.begin(), x.end(), [](char c) { return c >= '0' && c <= '9'; });
  };
  tag->clear();
  if (parts.size() == 3) {
    if (parts[2].size() != 9 || parts[2][0] != 'h') return 0;
    *tag = parts[2].substr(1);
  }
  if (parts.empty() || parts.size() > 3 || !digits(parts[0]) || (parts.size() >= 2 && !digits(parts[1]))) return 0;
  *target = file.substr(0, at);
  return std::atol(parts[0].c_str());
}

bool process_gone(long pid) { return pid > 0 && ::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH; }

// Whether a temporary is a dead writer's: on this machine, its process is gone; from
// another machine (a shared directory), it has not been written to for an hour (no
// atomic write takes that long; a live writer's file is never that old).
bool stale(const std::filesystem::path& p, long pid, const std::string& tag) {
  if (tag.empty() || tag == temporary_host_tag()) return process_gone(pid);
  struct stat st{};
  if (::stat(p.c_str(), &st) != 0) return false;
  return ::time(nullptr) - st.st_mtime > 3600;
}

}  // namespace

int64_t remove_stale_temporaries(const std::string& dir, const std::string& name_suffix) {
  int64_t removed = 0;
  std::error_code ec;
  for (std::filesystem::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string file = it->path().filename().string();
    std::string target, tag;
    const long pid = temporary_owner(file, &target, &tag);
    if (pid == 0 || (!name_suffix.empty() && (target.size() < name_suffix.size() ||
                                              target.compare(target.size() - name_suffix.size(), name_suffix.size(),
                                                             name_suffix) != 0)))
      continue;
    if (stale(it->path(), pid, tag) && ::unlink(it->path().c_str()) == 0) ++removed;
  }
  return removed;
}

int64_t remove_stale_temporaries_of(const std::string& path) {
  const std::filesystem::path p(path);
  const std::string name = p.filename().string();
  int64_t removed = 0;
  std::error_code ec;
  for (std::filesystem::directory_iterator it(parent_dir(path), ec), end; !ec && it != end; it.increment(ec)) {
    const std::string file = it->path().filename().string();
    std::string target, tag;
    const long pid = temporary_owner(file, &target, &tag);
    if (pid != 0 && target == name && stale(it->path(), pid, tag) && ::unlink(it->path().c_str()) == 0) ++removed;
  }
  return removed;
}

Status write_file_atomic(const std::string& path, const std::function<Status(std::FILE*)>& writer, unsigned mode,
                         bool tidy) {
  // What a crashed writer of this path left behind (its process is gone) goes first.
  if (tidy) remove_stale_temporaries_of(path);
  // Same directory as the target: rename(2) is atomic only within one filesystem. A
  // temporary of its own per write (pid and a counter, created O_EXCL): writers never
  // share one, so concurrent writes of a path cannot interleave their bytes.
  static std::atomic<uint64_t> counter{0};
  std::string tmp;
  int fd = -1;
  for (int attempt = 0; attempt < 16 && fd < 0; ++attempt) {
    tmp = path + ".tmp." + std::to_string(::getpid()) + "." + std::to_string(counter.fetch_add(1)) + ".h" + temporary_host_tag();
    fd = open_retry(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, static_cast<mode_t>(mode));
    if (fd < 0 && errno != EEXIST) break;
  }
  if (fd < 0) return errno_status(path, "cannot create temporary file " + tmp, errno);
  TempFileGuard guard(tmp);
  std::FILE* f = ::fdopen(fd, "wb");
  if (f == nullptr) {
    int e = errno;
    ::close(fd);
    return errno_status(path, "fdopen failed", e);
  }
  guard.set_file(f);

  Status s = writer(f);
  if (!s.is_ok()) return s.with_context(path);
  maybe_kill_for_test(path, f);

  // Buffered data reaches the kernel only here; ENOSPC often shows up at this point.
  errno = 0;
  if (std::fflush(f) != 0) return errno_status(path, "flush failed", errno);
  // Without fsync, a crash after the rename could leave a renamed but empty file.
  if (::fsync(::fileno(f)) != 0) return errno_status(path, "fsync failed", errno);
  errno = 0;
  if (guard.close() != 0) return errno_status(path, "close failed", errno);

  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    return errno_status(path, "cannot rename " + tmp + " over it", errno);
  }
  guard.commit();

  // The rename is only durable once the directory entry is on disk. From here on
  // the new file is in place; an error only means its durability is uncertain.
  const std::string dir = parent_dir(path);
  int dfd = open_retry(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd < 0) return errno_status(path, "written, but cannot open directory " + dir + " to fsync it", errno);
  int r = ::fsync(dfd);
  int e = errno;
  ::close(dfd);
  // Some filesystems cannot fsync a directory (EINVAL); nothing more can be done there.
  if (r != 0 && e != EINVAL) return errno_status(path, "written, but fsync of directory " + dir + " failed", e);
  return Status::ok();
}

Status write_file_atomic(const std::string& path, const void* data, size_t n, unsigned mode) {
  return write_file_atomic(path, [data, n](std::FILE* f) { return write_all(f, data, n); }, mode);
}

// ---- MappedFile ----

MappedFile::~MappedFile() { reset(); }

MappedFile::MappedFile(MappedFile&& o) noexcept
    : data_(std::exchange(o.data_, nullptr)),
      size_(std::exchange(o.size_, 0)),
      open_(std::exchange(o.open_, false)),
      path_(std::move(o.path_)) {}

MappedFile& MappedFile::operator=(MappedFile&& o) noexcept {
  if (this != &o) {
    reset();
    data_ = std::exchange(o.data_, nullptr);
    size_ = std::exchange(o.size_, 0);
    open_ = std::exchange(o.open_, false);
    path_ = std::move(o.path_);
  }
  return *this;
}

void MappedFile::reset() {
  if (data_ != nullptr) ::munmap(const_cast<uint8_t*>(data_), static_cast<size_t>(size_));
  data_ = nullptr;
  size_ = 0;
  open_ = false;
  path_.clear();
}

Status MappedFile::open(const std::string& path, MappedFile* out) {
  int fd;
  struct stat st;
  LAPLACE_RETURN_IF_ERROR(open_for_reading(path, &fd, &st));
  // mmap of a directory, pipe or device either fails obscurely or has no fixed size.
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    return Status::io_error(path + ": not a regular file, cannot map it");
  }
  MappedFile m;
  m.size_ = static_cast<uint64_t>(st.st_size);
  m.path_ = path;
  m.open_ = true;
  // mmap rejects a length of 0; an empty file is simply an empty mapping.
  if (m.size_ > 0) {
    void* p = ::mmap(nullptr, static_cast<size_t>(m.size_), PROT_READ, MAP_PRIVATE, fd, 0);
    if (p == MAP_FAILED) {
      int e = errno;
      ::close(fd);
      return errno_status(path, "mmap of " + std::to_string(m.size_) + " bytes failed", e);
    }
    m.data_ = static_cast<const uint8_t*>(p);
  }
  ::close(fd);  // the mapping keeps the file alive
  *out = std::move(m);
  return Status::ok();
}

}  // namespace laplace
