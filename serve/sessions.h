// Named sessions of `laplace serve` (docs/serving.md §9, "Sessions"): a whole context kept
// under a name, in memory and on disk, with caps on both.
//
// In memory: at most max_count sessions holding at most max_bytes of host memory. A
// request that will save its context at its end (save_session) reserves the room when it
// is admitted, so that the save cannot fail for lack of room once the work is done: the
// request is refused (429) up front instead of answering 200 with nothing saved.
//
// On disk: `DIR/NAME.session`, one writer per name at a time (concurrent saves of a name
// take turns; each writes a temporary of its own, fsyncs it and renames it over the file,
// so the file is always one whole save, never a mix or a truncation, even after kill -9),
// files 0600, at most max_disk_bytes / max_disk_files in all. Temporaries left by dead
// processes are removed when the store opens its directory.
//
// The directory may be shared by the replicas of a fleet (docs/deployment.md). Every file
// carries a version (1, 2, ...); a session in memory remembers the version it descends
// from. Saves of a name take turns across processes too (a lock file per name, see
// FileLock), and a save whose session descends from an older version than the file's is
// refused (conflict: another replica saved it meanwhile) instead of overwriting it. A
// session asked for by name is taken from the file when this replica holds none, or holds
// an unchanged copy of an older version (current()).
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "core/status.h"
#include "core/thread_annotations.h"
#include "model/config.h"
#include "model/state.h"
#include "serve/request.h"

namespace laplace {

struct Session {
  std::vector<int32_t> context;  // every token of the session, in order
  SnapshotPtr snap;              // the state after a prefix of `context`
  // The saved version this content descends from, or -1: new content that replaces
  // whatever is saved under its name (a session created, forked, or kept from a request
  // that did not continue it).
  int64_t base_version = -1;
  bool changed = true;           // since base_version was read or written
  uint64_t gen = 0;              // set by the store: which put of its name this is
  // Host bytes it holds (what the memory cap counts).
  int64_t bytes() const {
    return (snap ? snap->bytes() : 0) + static_cast<int64_t>(context.size() * sizeof(int32_t));
  }
};

struct SessionLimits {
  int64_t max_count = 1024;     // sessions in memory
  int64_t max_bytes = 0;        // their host bytes; 0 = no bound
  int64_t max_disk_bytes = 0;   // bytes of session files; 0 = no bound
  int64_t max_disk_files = 0;   // session files; 0 = no bound
};

class SessionStore {
 public:
  SessionStore(SessionLimits limits, std::string dir) : lim_(limits), dir_(std::move(dir)) {}

  // ---- memory ----
  // Puts (or replaces) a session. out_of_memory when the caps would be passed.
  Status put(const std::string& name, Session s);
  // Room for a session a running request will put at its end: counts against the caps
  // until commit() or release(). out_of_memory when there is none.
  Status reserve(const std::string& name, int64_t bytes, uint64_t* ticket);
  // Puts the session the reservation was for (never fails: the room is there).
  void commit(uint64_t ticket, Session s);
  void release(uint64_t ticket);
  std::optional<Session> get(const std::string& name) const;
  bool erase(const std::string& name);
  std::vector<std::pair<std::string, Session>> list() const;
  int64_t count() const;
  int64_t bytes() const;
  // Room held by reservations not yet committed or released (counted against the caps).
  int64_t reserved_count() const;
  int64_t reserved_bytes() const;
  const SessionLimits& limits() const { return lim_; }

  // ---- disk ----
  bool has_dir() const { return !dir_.empty(); }
  std::string path(const std::string& name) const;
  // Creates the directory, removes dead writers' temporaries, counts the files.
  // *removed: the number of temporaries removed.
  Status open_dir(int64_t* removed);
  // Saves the session `name` as this replica holds it (see current()) to NAME.session
  // through writer(path, session, version) (which writes it atomically, 0600, as that
  // version), as its only writer, in this process and in any other sharing the directory.
  // Nothing is written when this replica's copy is the saved version, unchanged.
  // *saved: the session saved; *version: the version it is now. Errors: current()'s;
  // conflict when the file is no longer the version the copy descends from (another
  // replica saved it meanwhile); out_of_memory when the disk caps would be passed;
  // io_error from the writer.
  Status save(const std::string& name, const std::function<Status(const std::string&, Session*)>& load,
              const std::function<Status(const std::string&, const Session&, int64_t)>& writer, Session* saved,
              int64_t* version);
  // After a save of the session `gen` of `name` as `version`: it now descends from that
  // version, unchanged (nothing happens when the name holds another session by now).
  void mark_saved(const std::string& name, uint64_t gen, int64_t version);
  // The session `name` as this replica should use it: the one in memory, or, with a
  // directory, the saved one when memory holds none, or holds an unchanged copy of another
  // version than the file's (which then replaces it in memory, under the caps).
  // load(path, out) reads a file. not_found when there is neither; conflict when memory
  // holds a changed copy and the file is another version (two replicas changed it);
  // out_of_memory (the caps) or load's error otherwise.
  Status current(const std::string& name, const std::function<Status(const std::string&, Session*)>& load,
                 Session* out);
  // Reading takes the same per-name turn, so a restore never sees a save half done
  // (the rename makes that so anyway; the turn keeps the order of requests).
  Status read(const std::string& name, const std::function<Status(const std::string&)>& reader);
  // Removes NAME.session in its turn (after any save of it in progress). *removed: whether
  // there was one. io_error when it cannot be removed.
  Status remove_file(const std::string& name, bool* removed);
  int64_t disk_bytes() const;
  int64_t disk_files() const;

 private:
  std::shared_ptr<std::mutex> turn(const std::string& name);
  void drop_turn(const std::string& name, const std::shared_ptr<std::mutex>& m);
  bool fits_locked(int64_t add_count, int64_t add_bytes) const REQUIRES(mu_);
  // current()'s choice, given the file's version (0 = none) and saver; load(out) reads it.
  Status resolve(const std::string& name, int64_t saved, const std::string& by,
                 const std::function<Status(Session*)>& load, Session* out);

  SessionLimits lim_;
  std::string dir_;
  mutable std::mutex mu_;
  std::map<std::string, Session> sessions_ GUARDED_BY(mu_);
  int64_t bytes_ GUARDED_BY(mu_) = 0;
  struct Reservation {
    std::string name;
    int64_t bytes = 0;
    bool counts = true;  // a new name (a replacement does not add to the count)
  };
  std::map<uint64_t, Reservation> reserved_ GUARDED_BY(mu_);
  uint64_t next_ticket_ GUARDED_BY(mu_) = 1;
  uint64_t next_gen_ GUARDED_BY(mu_) = 1;
  int64_t reserved_count_ GUARDED_BY(mu_) = 0, reserved_bytes_ GUARDED_BY(mu_) = 0;

  mutable std::mutex disk_mu_;
  std::map<std::string, std::shared_ptr<std::mutex>> turns_ GUARDED_BY(disk_mu_);
  std::map<std::string, int64_t> files_ GUARDED_BY(disk_mu_);  // name -> bytes on disk
  int64_t disk_bytes_ GUARDED_BY(disk_mu_) = 0, pending_disk_bytes_ GUARDED_BY(disk_mu_) = 0,
          pending_files_ GUARDED_BY(disk_mu_) = 0;
  std::chrono::steady_clock::time_point tidied_at_ GUARDED_BY(disk_mu_);  // dead writers' temporaries removed
};

// The session file: safetensors with tensors state, logits, snapshot_tokens, context and
// metadata laplace_session=1, config_fingerprint, model_hash, defer_writeback, pair_dtype,
// session_version and saved_by (the replica).
struct SessionFormat {
  const Config* config = nullptr;
  std::string fingerprint;     // of the model's config
  std::string model_hash;      // of the model's files ("" = not checked)
  std::string replica;         // who saves
  DType state_dtype = DType::kF32;
  PendingSpec pending;         // this server's slot layout (defer_writeback, pair dtype)
  const StatePool* pool = nullptr;
};
// The file's size in bytes, header included (an upper bound: the header is padded).
int64_t session_file_bytes(const Session& s);
// Writes the file atomically with permissions 0600, as `version`.
Status session_file_write(const std::string& path, const Session& s, const SessionFormat& f, int64_t version);
// The version of the file at `path` (0 when there is none; 1 for files from before
// versions were recorded) and the replica that saved it. corrupt when it is not a session
// file. Reads only the header.
Status session_file_version(const std::string& path, int64_t* version, std::string* saved_by = nullptr);
// Reads and checks a file: format, model, slot layout (another layout is converted to
// this server's), sizes, token ids, the state's tokens a prefix of the context, and every
// value of the state and the logits finite. not_found when there is no file; corrupt or
// invalid_argument otherwise.
Status session_file_read(const std::string& path, const SessionFormat& f, Session* out);

}  // namespace laplace
