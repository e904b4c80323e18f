#include "train/tensorboard.h"

#include <unistd.h>

#include <array>
#include <atomic>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <utility>

#include "core/file_util.h"

namespace laplace {

namespace {

constexpr std::array<uint32_t, 256> make_crc32c_table() {
  std::array<uint32_t, 256> t{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
    t[i] = c;
  }
  return t;
}
constexpr std::array<uint32_t, 256> kCrc32cTable = make_crc32c_table();

constexpr uint32_t kMaskDelta = 0xa282ead8u;

// Protobuf wire format: tag = field << 3 | wire type.
enum WireType : uint32_t { kVarint = 0, kFixed64 = 1, kLengthDelimited = 2, kFixed32 = 5 };

void put_varint(std::string* out, uint64_t v) {
  while (v >= 0x80) {
    out->push_back(static_cast<char>((v & 0x7F) | 0x80));
    v >>= 7;
  }
  out->push_back(static_cast<char>(v));
}
void put_tag(std::string* out, uint32_t field, WireType w) { put_varint(out, (uint64_t{field} << 3) | w); }
void put_le(std::string* out, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) out->push_back(static_cast<char>((v >> (8 * i)) & 0xFF));
}
void put_bytes(std::string* out, uint32_t field, std::string_view s) {
  put_tag(out, field, kLengthDelimited);
  put_varint(out, s.size());
  out->append(s);
}
void put_double(std::string* out, uint32_t field, double d) {
  uint64_t bits;
  std::memcpy(&bits, &d, 8);
  put_tag(out, field, kFixed64);
  put_le(out, bits, 8);
}
void put_float(std::string* out, uint32_t field, float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  put_tag(out, field, kFixed32);
  put_le(out, bits, 4);
}

// Event fields.
constexpr uint32_t kWallTime = 1, kStep = 2, kFileVersion = 3, kSummary = 5, kSessionLog = 7;
// SessionLog.status and its START value.
constexpr uint32_t kSessionStatus = 1;
constexpr uint64_t kSessionStart = 1;
// Summary.value, Value.tag, Value.simple_value.
constexpr uint32_t kSummaryValue = 1, kValueTag = 1, kValueSimple = 2;

void put_event_header(std::string* out, double wall_time, int64_t step) {
  put_double(out, kWallTime, wall_time);
  put_tag(out, kStep, kVarint);
  put_varint(out, static_cast<uint64_t>(step));  // int64: two's complement, as protobuf does
}

double wall_time_now() {
  using namespace std::chrono;
  return duration<double>(system_clock::now().time_since_epoch()).count();
}

// The host name with anything but [A-Za-z0-9._-] replaced, so it is safe in a file name.
std::string host_name() {
  char buf[256] = {};
  if (gethostname(buf, sizeof buf - 1) != 0 || buf[0] == '\0') return "localhost";
  std::string h = buf;
  for (char& c : h)
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '-' || c == '_')) c = '_';
  return h;
}

std::atomic<uint64_t> g_writer_count{0};

}  // namespace

uint32_t crc32c_extend(uint32_t crc, const void* data, size_t n) {
  const auto* p = static_cast<const uint8_t*>(data);
  uint32_t c = ~crc;
  for (size_t i = 0; i < n; ++i) c = kCrc32cTable[(c ^ p[i]) & 0xFF] ^ (c >> 8);
  return ~c;
}

uint32_t crc32c_mask(uint32_t crc) { return ((crc >> 15) | (crc << 17)) + kMaskDelta; }

uint32_t crc32c_unmask(uint32_t masked) {
  const uint32_t r = masked - kMaskDelta;
  return (r >> 17) | (r << 15);
}

std::string encode_scalar_event(double wall_time, int64_t step, const std::vector<ScalarValue>& values) {
  std::string summary;
  for (const ScalarValue& v : values) {
    std::string value;
    put_bytes(&value, kValueTag, v.tag);
    put_float(&value, kValueSimple, static_cast<float>(v.value));
    put_bytes(&summary, kSummaryValue, value);
  }
  std::string event;
  put_event_header(&event, wall_time, step);
  put_bytes(&event, kSummary, summary);
  return event;
}

std::string encode_file_version_event(double wall_time) {
  std::string event;
  put_event_header(&event, wall_time, 0);
  put_bytes(&event, kFileVersion, "brain.Event:2");
  return event;
}

std::string encode_session_start_event(double wall_time, int64_t step) {
  std::string log;
  put_tag(&log, kSessionStatus, kVarint);
  put_varint(&log, kSessionStart);
  std::string event;
  put_event_header(&event, wall_time, step);
  put_bytes(&event, kSessionLog, log);
  return event;
}

std::string frame_record(std::string_view data) {
  std::string rec;
  rec.reserve(data.size() + 16);
  put_le(&rec, data.size(), 8);
  put_le(&rec, crc32c_mask(crc32c(rec.data(), 8)), 4);
  rec.append(data);
  put_le(&rec, crc32c_mask(crc32c(data.data(), data.size())), 4);
  return rec;
}

EventWriter::~EventWriter() { (void)close(); }  // best effort: a destructor cannot report

EventWriter::EventWriter(EventWriter&& o) noexcept
    : f_(std::exchange(o.f_, nullptr)), path_(std::move(o.path_)) {}

EventWriter& EventWriter::operator=(EventWriter&& o) noexcept {
  if (this != &o) {
    (void)close();  // best effort, as in the destructor: the file being replaced is let go
    f_ = std::exchange(o.f_, nullptr);
    path_ = std::move(o.path_);
  }
  return *this;
}

Status EventWriter::open(const std::string& dir) {
  LAPLACE_RETURN_IF_ERROR(close());
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return Status::io_error("tensorboard: cannot create " + dir + ": " + ec.message());
  const std::string stem = dir + "/events.out.tfevents." +
                           std::to_string(static_cast<long long>(wall_time_now())) + "." + host_name() + "." +
                           std::to_string(static_cast<long long>(getpid())) + ".";
  // "x": O_EXCL, so a name already taken (another process with the same pid, a clock
  // gone back) is skipped rather than appended to.
  for (int attempt = 0; attempt < 1000 && !f_; ++attempt) {
    const std::string p = stem + std::to_string(g_writer_count.fetch_add(1));
    f_ = std::fopen(p.c_str(), "wbx");
    if (f_) path_ = p;
    else if (errno != EEXIST) return Status::io_error("tensorboard: cannot create " + p + ": " + std::strerror(errno));
  }
  if (!f_) return Status::io_error("tensorboard: no free event file name in " + dir);
  Status st = write_record(encode_file_version_event(wall_time_now()));
  if (!st.is_ok()) {
    std::fclose(f_);
    f_ = nullptr;
  }
  return st;
}

Status EventWriter::write_record(std::string_view data) {
  if (!f_) return Status::invalid_argument("tensorboard: event writer is not open");
  const std::string rec = frame_record(data);
  LAPLACE_RETURN_IF_ERROR(write_all(f_, rec.data(), rec.size()).with_context(path_));
  if (std::fflush(f_) != 0) return Status::io_error(path_ + ": flush: " + std::strerror(errno));
  return Status::ok();
}

Status EventWriter::write_scalars(int64_t step, const std::vector<ScalarValue>& values) {
  return write_record(encode_scalar_event(wall_time_now(), step, values));
}

Status EventWriter::write_session_start(int64_t step) {
  return write_record(encode_session_start_event(wall_time_now(), step));
}

Status EventWriter::close() {
  if (!f_) return Status::ok();
  const int rc = std::fclose(f_);
  f_ = nullptr;
  if (rc != 0) return Status::io_error(path_ + ": close: " + std::strerror(errno));
  return Status::ok();
}

}  // namespace laplace
