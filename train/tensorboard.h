// TensorBoard event files: `laplace train --tensorboard DIR` writes its scalars (loss,
// val_loss, lr, grad_norm, tokens_per_s, mfu) where TensorBoard's own reader loads them,
// with no protobuf or TensorFlow dependency.
//
// The format (TensorFlow's event files, as TensorBoard reads them):
//   file    = record*
//   record  = u64 length (little-endian) · u32 masked_crc32c(the 8 length bytes)
//             · data[length] · u32 masked_crc32c(data)
//   masked  = ((crc >> 15) | (crc << 17)) + 0xa282ead8   (mod 2^32)
//   data    = a serialized tensorflow.Event (protobuf wire format, encoded here by hand):
//     Event   { double wall_time = 1; int64 step = 2; string file_version = 3; Summary summary = 5; }
//     Summary { repeated Value value = 1; }
//     Value   { string tag = 1; float simple_value = 2; }
//     Event   { ...; SessionLog session_log = 7; }   SessionLog { SessionStatus status = 1; }  START = 1
// The first record is an Event with file_version "brain.Event:2"; each later one carries
// the scalars of one step, or a SessionLog START: TensorBoard then drops the points it read
// before (earlier files) at steps ≥ that event's step, the steps a restarted run redoes. CRC32C is CRC-32 with the Castagnoli polynomial (reflected
// 0x82F63B78), initial value and final xor 0xFFFFFFFF.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <string>
#include <string_view>
#include <vector>

#include "core/status.h"

namespace laplace {

// CRC32C of n bytes; crc32c_extend(crc32c(a), b) == crc32c(a·b).
uint32_t crc32c_extend(uint32_t crc, const void* data, size_t n);
inline uint32_t crc32c(const void* data, size_t n) { return crc32c_extend(0, data, n); }
// The TFRecord mask (a CRC stored beside data that holds CRCs is masked).
uint32_t crc32c_mask(uint32_t crc);
uint32_t crc32c_unmask(uint32_t masked);

struct ScalarValue {
  std::string tag;
  double value = 0;  // stored as a float (simple_value)
};

// The serialized Event of one step's scalars (exposed for tests).
std::string encode_scalar_event(double wall_time, int64_t step, const std::vector<ScalarValue>& values);
std::string encode_file_version_event(double wall_time);
std::string encode_session_start_event(double wall_time, int64_t step);
// One TFRecord: length, masked CRCs, data.
std::string frame_record(std::string_view data);

// Appends Events to a new file in a directory. Not thread-safe; one writer per file.
class EventWriter {
 public:
  EventWriter() = default;
  ~EventWriter();
  EventWriter(const EventWriter&) = delete;
  EventWriter& operator=(const EventWriter&) = delete;
  EventWriter(EventWriter&& o) noexcept;
  EventWriter& operator=(EventWriter&& o) noexcept;

  // Creates `dir` (and its parents) and a new file in it,
  // events.out.tfevents.<unix seconds>.<hostname>.<pid>.<n> (n counts this process's
  // writers; the file is created exclusively, so two writers never share a name), and
  // writes the file_version record. On error the writer stays closed.
  Status open(const std::string& dir);
  // One Event with these scalars at `step` (wall time: now), flushed to the OS so that a
  // killed process leaves a readable file. An error leaves the records written so far intact.
  Status write_scalars(int64_t step, const std::vector<ScalarValue>& values);
  // A SessionLog START at `step`: the run (re)starts there, so TensorBoard discards the
  // points of earlier files at steps ≥ step (a resume from an older checkpoint redoes them).
  Status write_session_start(int64_t step);
  Status close();

  bool is_open() const { return f_ != nullptr; }
  const std::string& path() const { return path_; }

 private:
  Status write_record(std::string_view data);

  std::FILE* f_ = nullptr;
  std::string path_;
};

}  // namespace laplace
