#include "serve/sessions.h"

#include <sys/stat.h>

#include <chrono>
#include <filesystem>

#include "core/file_util.h"
#include "core/safetensors.h"

namespace laplace {

namespace fs = std::filesystem;

bool SessionStore::fits_locked(int64_t add_count, int64_t add_bytes) const {
  const int64_t n = static_cast<int64_t>(sessions_.size()) + reserved_count_ + add_count;
  const int64_t b = bytes_ + reserved_bytes_ + add_bytes;
  return (add_count <= 0 || n <= lim_.max_count) && (lim_.max_bytes <= 0 || add_bytes <= 0 || b <= lim_.max_bytes);
}

Status SessionStore::put(const std::string& name, Session s) {
  std::lock_guard<std::mutex> lk(mu_);
  auto it = sessions_.find(name);
  const int64_t old = it == sessions_.end() ? 0 : it->second.bytes();
  const int64_t add = s.bytes() - old;
  if (!fits_locked(it == sessions_.end() ? 1 : 0, add))
    return Status::out_of_memory("too many sessions: " + std::to_string(sessions_.size()) + " of at most " +
                                 std::to_string(lim_.max_count) +
                                 (lim_.max_bytes > 0 ? ", " + std::to_string(bytes_) + " bytes of at most " +
                                                           std::to_string(lim_.max_bytes)
                                                     : std::string()) +
                                 " (delete some)");
  bytes_ += add;
  s.gen = next_gen_++;
  sessions_[name] = std::move(s);
  return Status::ok();
}

Status SessionStore::reserve(const std::string& name, int64_t bytes, uint64_t* ticket) {
  std::lock_guard<std::mutex> lk(mu_);
  bool counts = !sessions_.count(name);
  for (const auto& [t, r] : reserved_)
    if (r.name == name && r.counts) counts = false;  // one name, one session at the end
  if (!fits_locked(counts ? 1 : 0, bytes))
    return Status::out_of_memory("too many sessions: " + std::to_string(sessions_.size() + reserved_count_) +
                                 " of at most " + std::to_string(lim_.max_count) + " (delete some)");
  *ticket = next_ticket_++;
  reserved_[*ticket] = Reservation{name, bytes, counts};
  reserved_count_ += counts ? 1 : 0;
  reserved_bytes_ += bytes;
  return Status::ok();
}

void SessionStore::commit(uint64_t ticket, Session s) {
  std::lock_guard<std::mutex> lk(mu_);
  auto r = reserved_.find(ticket);
  if (r == reserved_.end()) return;
  reserved_count_ -= r->second.counts ? 1 : 0;
  reserved_bytes_ -= r->second.bytes;
  auto it = sessions_.find(r->second.name);
  bytes_ += s.bytes() - (it == sessions_.end() ? 0 : it->second.bytes());
  s.gen = next_gen_++;
  sessions_[r->second.name] = std::move(s);
  reserved_.erase(r);
}

void SessionStore::release(uint64_t ticket) {
  std::lock_guard<std::mutex> lk(mu_);
  auto r = reserved_.find(ticket);
  if (r == reserved_.end()) return;
  reserved_count_ -= r->second.counts ? 1 : 0;
  reserved_bytes_ -= r->second.bytes;
  reserved_.erase(r);
}

std::optional<Session> SessionStore::get(const std::string& name) const {
  std::lock_guard<std::mutex> lk(mu_);
  auto it = sessions_.find(name);
  if (it == sessions_.end()) return std::nullopt;
  return it->second;
}

bool SessionStore::erase(const std::string& name) {
  std::lock_guard<std::mutex> lk(mu_);
  auto it = sessions_.find(name);
  if (it == sessions_.end()) return false;
  bytes_ -= it->second.bytes();
  sessions_.erase(it);
  return true;
}

std::vector<std::pair<std::string, Session>> SessionStore::list() const {
  std::lock_guard<std::mutex> lk(mu_);
  return {sessions_.begin(), sessions_.end()};
}

int64_t SessionStore::count() const {
  std::lock_guard<std::mutex> lk(mu_);
  return static_cast<int64_t>(sessions_.size());
}

int64_t SessionStore::bytes() const {
  std::lock_guard<std::mutex> lk(mu_);
  return bytes_;
}

Status SessionStore::remove_file(const std::string& name, bool* removed) {
  *removed = false;
  if (dir_.empty()) return Status::ok();
  std::shared_ptr<std::mutex> m = turn(name);
  Status st;
  {
    std::lock_guard<std::mutex> one_writer(*m);
    FileLock across;  // after any save of it in progress in another process too
    st = across.lock(path(name) + ".lock");
    std::error_code ec;
    if (st.is_ok()) {
      *removed = fs::remove(path(name), ec);
      across.remove_and_unlock();
    }
    if (!st.is_ok()) {
      // the lock's error
    } else if (ec) {
      st = Status::io_error("cannot remove the session file of '" + name + "': " + ec.message());
    } else {
      std::lock_guard<std::mutex> lk(disk_mu_);
      auto it = files_.find(name);
      if (it != files_.end()) {
        disk_bytes_ -= it->second;
        files_.erase(it);
      }
    }
  }
  drop_turn(name, m);
  return st;
}

int64_t SessionStore::reserved_count() const {
  std::lock_guard<std::mutex> lk(mu_);
  return static_cast<int64_t>(reserved_.size());
}

int64_t SessionStore::reserved_bytes() const {
  std::lock_guard<std::mutex> lk(mu_);
  return reserved_bytes_;
}

std::string SessionStore::path(const std::string& name) const { return (fs::path(dir_) / (name + ".session")).string(); }

Status SessionStore::open_dir(int64_t* removed) {
  *removed = 0;
  if (dir_.empty()) return Status::ok();
  std::error_code ec;
  fs::create_directories(dir_, ec);
  if (ec) return Status::io_error("cannot create the session directory: " + ec.message());
  ::chmod(dir_.c_str(), 0700);  // sessions are their owner's (best effort: the directory may be shared on purpose)
  {
    // Found now rather than at the first save: a directory this process cannot write to
    // (permissions, a read-only mount, a full disk).
    FileLock probe;
    Status st = probe.lock((fs::path(dir_) / ".write-check.lock").string());
    if (st.is_ok()) probe.remove_and_unlock();
    if (!st.is_ok()) return Status::io_error("the session directory is not writable: " + st.message());
  }
  *removed = remove_stale_temporaries(dir_, ".session");
  {
    std::lock_guard<std::mutex> lk(disk_mu_);
    tidied_at_ = std::chrono::steady_clock::now();
  }
  std::lock_guard<std::mutex> lk(disk_mu_);
  files_.clear();
  disk_bytes_ = 0;
  for (fs::directory_iterator it(dir_, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string f = it->path().filename().string();
    const std::string suffix = ".session";
    if (f.size() <= suffix.size() || f.compare(f.size() - suffix.size(), suffix.size(), suffix) != 0) continue;
    std::error_code e2;
    const auto size = fs::file_size(it->path(), e2);
    if (e2) continue;
    files_[f.substr(0, f.size() - suffix.size())] = static_cast<int64_t>(size);
    disk_bytes_ += static_cast<int64_t>(size);
  }
  return Status::ok();
}

std::shared_ptr<std::mutex> SessionStore::turn(const std::string& name) {
  std::lock_guard<std::mutex> lk(disk_mu_);
  auto& m = turns_[name];
  if (!m) m = std::make_shared<std::mutex>();
  return m;
}

void SessionStore::drop_turn(const std::string& name, const std::shared_ptr<std::mutex>& m) {
  std::lock_guard<std::mutex> lk(disk_mu_);
  auto it = turns_.find(name);
  // Only this caller and the map hold it: nobody waits for this name's turn.
  if (it != turns_.end() && it->second == m && m.use_count() == 2) turns_.erase(it);
}

Status SessionStore::resolve(const std::string& name, int64_t saved, const std::string& by,
                             const std::function<Status(Session*)>& load, Session* out) {
  std::optional<Session> mem = get(name);
  // Memory is current when nothing is saved, when it descends from what is saved, or when
  // it is new content of this replica's (its save replaces the file).
  if (mem && (saved == 0 || mem->base_version == saved || mem->base_version < 0)) {
    *out = std::move(*mem);
    return Status::ok();
  }
  if (mem && mem->changed)
    return Status::conflict("session '" + name + "' was changed on this replica since version " +
                            std::to_string(mem->base_version) + ", and saved as version " + std::to_string(saved) +
                            (by.empty() ? std::string() : " by replica " + by) +
                            " since (restore it to continue from that save, or save under another name)");
  if (saved == 0) return Status::not_found("session '" + name + "' does not exist");
  Session s;
  Status st = load(&s);
  if (st.code() == Status::Code::kNotFound) return Status::not_found("session '" + name + "' does not exist");
  LAPLACE_RETURN_IF_ERROR(st);
  LAPLACE_RETURN_IF_ERROR(put(name, s));
  *out = std::move(s);
  return Status::ok();
}

Status SessionStore::current(const std::string& name, const std::function<Status(const std::string&, Session*)>& load,
                             Session* out) {
  if (dir_.empty()) {
    std::optional<Session> mem = get(name);
    if (!mem) return Status::not_found("session '" + name + "' does not exist");
    *out = std::move(*mem);
    return Status::ok();
  }
  int64_t saved = 0;
  std::string by;
  LAPLACE_RETURN_IF_ERROR(session_file_version(path(name), &saved, &by));
  return resolve(name, saved, by, [&](Session* s) { return read(name, [&](const std::string& p) { return load(p, s); }); },
                 out);
}

Status SessionStore::save(const std::string& name, const std::function<Status(const std::string&, Session*)>& load,
                          const std::function<Status(const std::string&, const Session&, int64_t)>& writer,
                          Session* saved_session, int64_t* version) {
  if (dir_.empty()) return Status::invalid_argument("no session directory");
  std::shared_ptr<std::mutex> m = turn(name);
  Status st;
  {
    std::lock_guard<std::mutex> one_writer(*m);
    // One writer across the processes sharing the directory: the version check and the
    // rename below are one step for them all. The session to save is looked up in the turn
    // too, so saves of one name by this replica follow each other's versions.
    FileLock across;
    st = across.lock(path(name) + ".lock");
    int64_t now = 0;
    std::string by;
    if (st.is_ok()) st = session_file_version(path(name), &now, &by);
    Session s;
    if (st.is_ok()) st = resolve(name, now, by, [&](Session* out) { return load(path(name), out); }, &s);
    if (st.is_ok() && s.base_version == now && !s.changed) {
      // What is saved already (this replica's copy is that version, unchanged).
      *version = now;
      *saved_session = std::move(s);
      drop_turn(name, m);
      return Status::ok();
    }
    if (st.is_ok() && s.base_version >= 0 && now != s.base_version)
      st = Status::conflict("session '" + name + "' was saved " +
                            (now == 0 ? std::string("and removed") : "as version " + std::to_string(now)) +
                            (by.empty() ? std::string() : " by replica " + by) + " since this replica took version " +
                            std::to_string(s.base_version) +
                            " (restore it to continue from that save, or save under another name)");
    if (!st.is_ok()) {
      drop_turn(name, m);
      return st;
    }
    // Dead writers' temporaries: at start (open_dir) and then at most every ten minutes, not
    // at every save (which would list a directory of tens of thousands of sessions each time).
    bool tidy = false;
    {
      const auto now_t = std::chrono::steady_clock::now();
      std::lock_guard<std::mutex> lk(disk_mu_);
      if (now_t - tidied_at_ > std::chrono::minutes(10)) {
        tidied_at_ = now_t;
        tidy = true;
      }
    }
    if (tidy) remove_stale_temporaries(dir_, ".session");
    const int64_t size = session_file_bytes(s);
    int64_t old = 0;
    bool is_new = false;
    {
      std::lock_guard<std::mutex> lk(disk_mu_);
      auto it = files_.find(name);
      is_new = it == files_.end();
      old = is_new ? 0 : it->second;
      const int64_t files = static_cast<int64_t>(files_.size()) + pending_files_ + (is_new ? 1 : 0);
      const int64_t bytes = disk_bytes_ + pending_disk_bytes_ + size - old;
      if (lim_.max_disk_files > 0 && files > lim_.max_disk_files)
        st = Status::out_of_memory("the session directory holds its maximum of " +
                                   std::to_string(lim_.max_disk_files) + " files");
      else if (lim_.max_disk_bytes > 0 && size - old > 0 && bytes > lim_.max_disk_bytes)
        st = Status::out_of_memory("saving would take the session directory to " + std::to_string(bytes) +
                                   " bytes, over its maximum of " + std::to_string(lim_.max_disk_bytes));
      if (st.is_ok()) {
        pending_files_ += is_new ? 1 : 0;
        pending_disk_bytes_ += size;
      }
    }
    if (st.is_ok()) {
      st = writer(path(name), s, now + 1);
      if (st.is_ok()) {
        *version = now + 1;
        mark_saved(name, s.gen, now + 1);
        s.base_version = now + 1;
        s.changed = false;
        *saved_session = s;
      }
      std::error_code ec;
      const auto real = fs::file_size(path(name), ec);
      std::lock_guard<std::mutex> lk(disk_mu_);
      pending_files_ -= is_new ? 1 : 0;
      pending_disk_bytes_ -= size;
      if (!ec) {
        auto it = files_.find(name);
        if (it != files_.end()) disk_bytes_ -= it->second;
        files_[name] = static_cast<int64_t>(real);
        disk_bytes_ += static_cast<int64_t>(real);
      }
    }
  }
  drop_turn(name, m);
  return st;
}

void SessionStore::mark_saved(const std::string& name, uint64_t gen, int64_t version) {
  std::lock_guard<std::mutex> lk(mu_);
  auto it = sessions_.find(name);
  if (it == sessions_.end() || it->second.gen != gen) return;
  it->second.base_version = version;
  it->second.changed = false;
}

Status SessionStore::read(const std::string& name, const std::function<Status(const std::string&)>& reader) {
  std::shared_ptr<std::mutex> m = turn(name);
  Status st;
  {
    std::lock_guard<std::mutex> one(*m);
    st = reader(path(name));
  }
  drop_turn(name, m);
  return st;
}

int64_t SessionStore::disk_bytes() const {
  std::lock_guard<std::mutex> lk(disk_mu_);
  return disk_bytes_;
}

int64_t SessionStore::disk_files() const {
  std::lock_guard<std::mutex> lk(disk_mu_);
  return static_cast<int64_t>(files_.size());
}

}  // namespace laplace

// ---- the session file ---------------------------------------------------------------------

#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/safetensors.h"

namespace laplace {

int64_t session_file_bytes(const Session& s) {
  const StateSnapshot& sn = *s.snap;
  return 8 + 1024 + static_cast<int64_t>(sn.state.size() + sn.logits.size() * 4 + sn.tokens.size() * 4 +
                                         s.context.size() * 4);
}

Status session_file_write(const std::string& path, const Session& s, const SessionFormat& f, int64_t version) {
  const StateSnapshot& sn = *s.snap;
  const int64_t esz = static_cast<int64_t>(dtype_size(sn.state_dtype));
  // Tensor views of the immutable snapshot (the writer only reads them).
  auto* state = const_cast<uint8_t*>(sn.state.data());
  auto* logits = const_cast<float*>(sn.logits.data());
  auto* snap_tokens = const_cast<int32_t*>(sn.tokens.data());
  auto* context = const_cast<int32_t*>(s.context.data());
  std::vector<NamedTensor> t = {
      {"state", Tensor(state, sn.state_dtype, {static_cast<int64_t>(sn.state.size()) / esz})},
      {"logits", Tensor(logits, DType::kF32, {static_cast<int64_t>(sn.logits.size())})},
      {"snapshot_tokens", Tensor(snap_tokens, DType::kI32, {static_cast<int64_t>(sn.tokens.size())})},
      {"context", Tensor(context, DType::kI32, {static_cast<int64_t>(s.context.size())})}};
  return safetensors_write(path, t,
                           {{"laplace_session", "1"},
                            {"config_fingerprint", f.fingerprint},
                            {"model_hash", f.model_hash},
                            {"session_version", std::to_string(version)},
                            {"saved_by", f.replica},
                            {"defer_writeback", std::to_string(f.pending.steps)},
                            {"pair_dtype", dtype_name(f.pending.pair_dtype)}},
                           0600, /*tidy=*/false);  // the store tidies its directory (SessionStore::save)
}

namespace {

// The version a session file's metadata records (1 when none: files from before versions).
Status version_of(const std::map<std::string, std::string>& md, int64_t* version, std::string* saved_by) {
  auto it = md.find("laplace_session");
  if (it == md.end() || it->second != "1") return Status::corrupt("not a Laplace session file (or an unknown version)");
  *version = 1;
  if ((it = md.find("session_version")) != md.end()) {
    const std::string& v = it->second;
    if (v.empty() || v.size() > 18 || !std::all_of(v.begin(), v.end(), [](char c) { return c >= '0' && c <= '9'; }) ||
        std::stoll(v) < 1)
      return Status::corrupt("session file: session_version '" + v + "' is not a positive integer");
    *version = std::stoll(v);
  }
  if (saved_by && (it = md.find("saved_by")) != md.end()) *saved_by = it->second;
  return Status::ok();
}

}  // namespace

Status session_file_version(const std::string& path, int64_t* version, std::string* saved_by) {
  *version = 0;
  if (saved_by) saved_by->clear();
  SafeTensorsReader r;
  Status st = SafeTensorsReader::open(path, &r);  // maps the file and reads its header only
  if (st.code() == Status::Code::kNotFound) return Status::ok();
  LAPLACE_RETURN_IF_ERROR(st);
  return version_of(r.metadata(), version, saved_by);
}

namespace {

bool all_finite(const std::vector<uint8_t>& bytes, DType dt) {
  const size_t n = bytes.size() / dtype_size(dt);
  if (dt == DType::kF32) {
    const float* p = reinterpret_cast<const float*>(bytes.data());
    for (size_t i = 0; i < n; ++i)
      if (!std::isfinite(p[i])) return false;
  } else if (dt == DType::kF64) {
    const double* p = reinterpret_cast<const double*>(bytes.data());
    for (size_t i = 0; i < n; ++i)
      if (!std::isfinite(p[i])) return false;
  } else if (dt == DType::kBF16) {
    const uint16_t* p = reinterpret_cast<const uint16_t*>(bytes.data());
    for (size_t i = 0; i < n; ++i)
      if ((p[i] & 0x7f80) == 0x7f80) return false;  // exponent all ones: inf or NaN
  }
  return true;
}

}  // namespace

Status session_file_read(const std::string& path, const SessionFormat& f, Session* out) {
  SafeTensorsReader r;
  LAPLACE_RETURN_IF_ERROR(SafeTensorsReader::open(path, &r));
  auto md = r.metadata();
  if (md["laplace_session"] != "1") return Status::corrupt("not a Laplace session file (or an unknown version)");
  if (md["config_fingerprint"] != f.fingerprint) return Status::invalid_argument("the session was saved by a different model");
  if (!f.model_hash.empty() && md.count("model_hash") && !md["model_hash"].empty() && md["model_hash"] != f.model_hash)
    return Status::invalid_argument("the session was saved by a different model (same configuration, other weights)");
  LAPLACE_RETURN_IF_ERROR(version_of(md, &out->base_version, nullptr));
  out->changed = false;
  auto get = [&](const char* name, DType dt, const SafeTensorInfo** info) -> Status {
    *info = r.find(name);
    if (!*info || (*info)->dtype != dt || (*info)->shape.size() != 1)
      return Status::corrupt(std::string("session file: '") + name + "' missing or malformed");
    return Status::ok();
  };
  const SafeTensorInfo* st = r.find("state");
  if (!st || st->shape.size() != 1 ||
      (st->dtype != DType::kF32 && st->dtype != DType::kBF16 && st->dtype != DType::kF64))
    return Status::corrupt("session file: 'state' missing or malformed");
  const SafeTensorInfo *lg, *sk, *cx;
  LAPLACE_RETURN_IF_ERROR(get("logits", DType::kF32, &lg));
  LAPLACE_RETURN_IF_ERROR(get("snapshot_tokens", DType::kI32, &sk));
  LAPLACE_RETURN_IF_ERROR(get("context", DType::kI32, &cx));
  // The saving server's slot layout: its state dtype, deferred write-back and pair dtype, from
  // the metadata (files written before it was recorded: the R whose slot size fits, pairs in
  // this model's dtype).
  const Config& c = *f.config;
  DType pair_dtype = f.pending.pair_dtype;  // the pairs are in the saving model's activation dtype
  if (md.count("pair_dtype") && (!dtype_from_name(md["pair_dtype"], &pair_dtype) ||
                                 (pair_dtype != DType::kF32 && pair_dtype != DType::kBF16 && pair_dtype != DType::kF64)))
    return Status::corrupt("session file: pair_dtype '" + md["pair_dtype"] + "' is not F32, BF16 or F64");
  int64_t saved_r = 0;
  if (md.count("defer_writeback")) {
    const std::string& v = md["defer_writeback"];
    if (v != "0" && v != "4" && v != "8" && v != "16")
      return Status::corrupt("session file: defer_writeback '" + v + "' is not 0, 4, 8 or 16");
    saved_r = std::stoll(v);
  } else {
    for (int64_t rr : {4, 8, 16})
      if (static_cast<int64_t>(st->nbytes()) == StatePool::slot_bytes_for(c, st->dtype, {rr, pair_dtype})) saved_r = rr;
  }
  const PendingSpec saved{saved_r, pair_dtype};
  const int64_t saved_bytes = StatePool::slot_bytes_for(c, st->dtype, saved);
  if (static_cast<int64_t>(st->nbytes()) != saved_bytes)
    return Status::corrupt("session file: a state of " + std::to_string(st->nbytes()) + " bytes; " +
                           dtype_name(st->dtype) + " states with defer_writeback " + std::to_string(saved_r) +
                           " take " + std::to_string(saved_bytes));
  if (lg->numel() != c.vocab_size) return Status::corrupt("session file: logits of the wrong size for this model");
  auto snap = std::make_shared<StateSnapshot>();
  snap->state_dtype = f.state_dtype;
  // Another layout (--state-dtype, --defer-writeback) is converted: pairs folded in, values
  // rounded to this server's dtype. The same layout is taken byte for byte.
  const PendingSpec& mine = f.pending;
  if (st->dtype == snap->state_dtype && saved_r == mine.steps && (saved_r == 0 || pair_dtype == mine.pair_dtype))
    snap->state.assign(r.bytes(*st), r.bytes(*st) + st->nbytes());
  else
    LAPLACE_RETURN_IF_ERROR(
        StatePool::convert_slot(c, st->dtype, saved, r.bytes(*st), snap->state_dtype, mine, &snap->state));
  // Every value finite: a state with a NaN or an infinity would answer with garbage, and
  // keep doing so for every continuation. The check covers pending pairs too (folded in).
  {
    std::vector<uint8_t> plain;
    if (mine.steps == 0) {
      if (!all_finite(snap->state, snap->state_dtype))
        return Status::corrupt("session file: the state holds values that are not finite");
    } else {
      if (f.pool) LAPLACE_RETURN_IF_ERROR(f.pool->check_slot_bytes(snap->state.data()).with_context("session file"));
      LAPLACE_RETURN_IF_ERROR(StatePool::convert_slot(c, snap->state_dtype, mine, snap->state.data(), DType::kF32,
                                                      PendingSpec{0, mine.pair_dtype}, &plain)
                                  .with_context("session file"));
      if (!all_finite(plain, DType::kF32))
        return Status::corrupt("session file: the state holds values that are not finite");
    }
  }
  snap->logits.resize(static_cast<size_t>(lg->numel()));
  std::memcpy(snap->logits.data(), r.bytes(*lg), lg->nbytes());
  for (float x : snap->logits)
    if (!std::isfinite(x)) return Status::corrupt("session file: the logits hold values that are not finite");
  snap->tokens.resize(static_cast<size_t>(sk->numel()));
  std::memcpy(snap->tokens.data(), r.bytes(*sk), sk->nbytes());
  out->context.resize(static_cast<size_t>(cx->numel()));
  std::memcpy(out->context.data(), r.bytes(*cx), cx->nbytes());
  const int64_t V = c.vocab_size;
  for (int32_t t : out->context)
    if (t < 0 || t >= V) return Status::corrupt("session file: a token id outside the vocabulary");
  if (snap->tokens.empty() || snap->tokens.size() > out->context.size() ||
      !std::equal(snap->tokens.begin(), snap->tokens.end(), out->context.begin()))
    return Status::corrupt("session file: the state's tokens are not a prefix of the context");
  out->snap = std::move(snap);
  return Status::ok();
}

}  // namespace laplace
