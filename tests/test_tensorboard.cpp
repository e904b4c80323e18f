// TensorBoard event files (train/tensorboard.h): CRC32C against published vectors, the
// Event encoding byte for byte, and a reader of this test's own that checks every
// record's framing and both CRCs and decodes the Events back — for the writer alone,
// for a tiny Trainer (the scalars equal metrics.jsonl's) and for `laplace train --tensorboard`.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <regex>

#include <nlohmann/json.hpp>

#include "core/file_util.h"
#include "tests/test_util.h"
#include "text/shard.h"
#include "distributed/comm.h"
#include "train/tensorboard.h"
#include "train/trainer.h"

namespace laplace {
namespace {

namespace fs = std::filesystem;

// ---- the test's own reader (independent of the writer's code, CRC included) ----

// Bit by bit, straight from the definition (reflected Castagnoli polynomial).
uint32_t crc32c_bitwise(const std::string& s) {
  uint32_t c = 0xFFFFFFFFu;
  for (unsigned char b : s) {
    c ^= b;
    for (int k = 0; k < 8; ++k) c = (c >> 1) ^ (0x82F63B78u & (0u - (c & 1u)));
  }
  return ~c;
}

uint32_t unmask(uint32_t m) {
  const uint32_t r = m - 0xa282ead8u;
  return (r >> 17) | (r << 15);
}

uint64_t le(const std::string& b, size_t at, int n) {
  uint64_t v = 0;
  for (int i = 0; i < n; ++i) v |= uint64_t{static_cast<unsigned char>(b[at + i])} << (8 * i);
  return v;
}

// Splits a file into its records' data; an error names the offset and what is wrong.
Status read_records(const std::string& b, std::vector<std::string>* out) {
  out->clear();
  size_t at = 0;
  while (at < b.size()) {
    const std::string where = "record at offset " + std::to_string(at);
    if (b.size() - at < 12) return Status::corrupt(where + ": truncated header");
    const uint64_t len = le(b, at, 8);
    if (unmask(static_cast<uint32_t>(le(b, at + 8, 4))) != crc32c_bitwise(b.substr(at, 8)))
      return Status::corrupt(where + ": length CRC mismatch");
    if (len > b.size() - at - 12 || b.size() - at - 12 - len < 4) return Status::corrupt(where + ": truncated data");
    std::string data = b.substr(at + 12, len);
    if (unmask(static_cast<uint32_t>(le(b, at + 12 + len, 4))) != crc32c_bitwise(data))
      return Status::corrupt(where + ": data CRC mismatch");
    out->push_back(std::move(data));
    at += 12 + len + 4;
  }
  return Status::ok();
}

// A minimal protobuf reader: the fields of one message.
struct Field {
  uint32_t number = 0, wire = 0;
  uint64_t u = 0;     // varint, fixed32, fixed64
  std::string bytes;  // length-delimited
};

Status parse_message(const std::string& m, std::vector<Field>* out) {
  out->clear();
  size_t at = 0;
  auto varint = [&](uint64_t* v) {
    *v = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      if (at >= m.size()) return false;
      const unsigned char c = m[at++];
      *v |= uint64_t{c & 0x7Fu} << shift;
      if (!(c & 0x80)) return true;
    }
    return false;
  };
  while (at < m.size()) {
    uint64_t key;
    if (!varint(&key)) return Status::corrupt("bad field key");
    Field f;
    f.number = static_cast<uint32_t>(key >> 3);
    f.wire = static_cast<uint32_t>(key & 7);
    if (f.number == 0) return Status::corrupt("field number 0");
    if (f.wire == 0) {
      if (!varint(&f.u)) return Status::corrupt("bad varint");
    } else if (f.wire == 1 || f.wire == 5) {
      const int n = f.wire == 1 ? 8 : 4;
      if (m.size() - at < static_cast<size_t>(n)) return Status::corrupt("truncated fixed field");
      f.u = le(m, at, n);
      at += n;
    } else if (f.wire == 2) {
      uint64_t n;
      if (!varint(&n) || n > m.size() - at) return Status::corrupt("bad length");
      f.bytes = m.substr(at, n);
      at += n;
    } else {
      return Status::corrupt("wire type " + std::to_string(f.wire));
    }
    out->push_back(std::move(f));
  }
  return Status::ok();
}

struct Event {
  double wall_time = 0;
  int64_t step = 0;
  std::string file_version;
  bool has_summary = false;
  std::vector<std::pair<std::string, float>> values;  // Summary.value: (tag, simple_value)
  int64_t session_status = -1;                        // SessionLog.status (1 = START), -1: none
};

Status decode_event(const std::string& data, Event* e) {
  *e = Event{};
  std::vector<Field> fs;
  LAPLACE_RETURN_IF_ERROR(parse_message(data, &fs));
  for (const Field& f : fs) {
    if (f.number == 1 && f.wire == 1) std::memcpy(&e->wall_time, &f.u, 8);
    else if (f.number == 2 && f.wire == 0) e->step = static_cast<int64_t>(f.u);
    else if (f.number == 3 && f.wire == 2) e->file_version = f.bytes;
    else if (f.number == 5 && f.wire == 2) {
      e->has_summary = true;
      std::vector<Field> sv;
      LAPLACE_RETURN_IF_ERROR(parse_message(f.bytes, &sv));
      for (const Field& v : sv) {
        if (v.number != 1 || v.wire != 2) return Status::corrupt("Summary: unexpected field");
        std::vector<Field> vf;
        LAPLACE_RETURN_IF_ERROR(parse_message(v.bytes, &vf));
        std::string tag;
        float x = NAN;
        bool has_x = false;
        for (const Field& g : vf) {
          if (g.number == 1 && g.wire == 2) tag = g.bytes;
          else if (g.number == 2 && g.wire == 5) {
            const uint32_t bits = static_cast<uint32_t>(g.u);
            std::memcpy(&x, &bits, 4);
            has_x = true;
          } else return Status::corrupt("Value: unexpected field");
        }
        if (tag.empty() || !has_x) return Status::corrupt("Value without tag or simple_value");
        e->values.emplace_back(tag, x);
      }
    } else if (f.number == 7 && f.wire == 2) {
      std::vector<Field> lf;
      LAPLACE_RETURN_IF_ERROR(parse_message(f.bytes, &lf));
      e->session_status = 0;
      for (const Field& g : lf)
        if (g.number == 1 && g.wire == 0) e->session_status = static_cast<int64_t>(g.u);
    } else {
      return Status::corrupt("Event: unexpected field " + std::to_string(f.number));
    }
  }
  return Status::ok();
}

// A whole file: the file_version record first, then scalar Events.
Status read_event_file(const std::string& path, std::vector<Event>* events) {
  std::string bytes;
  LAPLACE_RETURN_IF_ERROR(read_file(path, &bytes));
  std::vector<std::string> recs;
  LAPLACE_RETURN_IF_ERROR(read_records(bytes, &recs).with_context(path));
  events->clear();
  for (const std::string& r : recs) {
    Event e;
    LAPLACE_RETURN_IF_ERROR(decode_event(r, &e).with_context(path));
    events->push_back(std::move(e));
  }
  if (events->empty() || events->front().file_version != "brain.Event:2")
    return Status::corrupt(path + ": first record is not file_version brain.Event:2");
  for (size_t i = 1; i < events->size(); ++i) {
    const Event& e = (*events)[i];
    if (e.has_summary == (e.session_status >= 0) || !e.file_version.empty())
      return Status::corrupt(path + ": record " + std::to_string(i) + " is neither a summary nor a session log");
  }
  return Status::ok();
}

// The event files of a directory in the order they were created (their file_version
// Event's wall time; TensorBoard goes by name, which the Unix seconds in it order the same
// way for files of different seconds).
std::vector<std::string> event_files(const std::string& dir) {
  std::vector<std::pair<double, std::string>> found;
  for (const auto& e : fs::directory_iterator(dir)) {
    if (e.path().filename().string().rfind("events.out.tfevents.", 0) != 0) continue;
    std::vector<Event> ev;
    Status st = read_event_file(e.path().string(), &ev);
    EXPECT_TRUE(st.is_ok()) << st.to_string();
    found.emplace_back(ev.empty() ? 0.0 : ev[0].wall_time, e.path().string());
  }
  std::sort(found.begin(), found.end());
  std::vector<std::string> out;
  for (auto& [t, p] : found) out.push_back(p);
  return out;
}

// (tag → step → value) over the given files as TensorBoard shows them: a SessionLog START
// at step s drops the points read so far at steps ≥ s. A (tag, step) repeated otherwise fails.
using Scalars = std::map<std::string, std::map<int64_t, float>>;
Scalars scalars_of(const std::vector<std::string>& files, int* starts = nullptr) {
  Scalars s;
  if (starts) *starts = 0;
  for (const std::string& f : files) {
    std::vector<Event> ev;
    Status st = read_event_file(f, &ev);
    EXPECT_TRUE(st.is_ok()) << st.to_string();
    for (size_t i = 1; i < ev.size(); ++i) {
      if (ev[i].session_status == 1) {
        if (starts) ++*starts;
        for (auto& [tag, points] : s) points.erase(points.lower_bound(ev[i].step), points.end());
      }
      for (const auto& [tag, x] : ev[i].values)
        EXPECT_TRUE(s[tag].emplace(ev[i].step, x).second) << tag << " twice at step " << ev[i].step;
    }
  }
  return s;
}

std::string bytes_of(const std::string& path) {
  std::string s;
  EXPECT_TRUE(read_file(path, &s).is_ok()) << path;
  return s;
}

// ---- CRC32C and the encoding ----

TEST(TensorBoardCrc32c, KnownVectors) {
  // "123456789" is the standard check value; the others are RFC 3720 (iSCSI) B.4's.
  EXPECT_EQ(crc32c("123456789", 9), 0xE3069283u);
  EXPECT_EQ(crc32c("", 0), 0u);
  std::string zeros(32, '\0'), ones(32, '\xff'), up(32, 0), down(32, 0);
  for (int i = 0; i < 32; ++i) up[i] = static_cast<char>(i), down[i] = static_cast<char>(31 - i);
  EXPECT_EQ(crc32c(zeros.data(), 32), 0x8A9136AAu);
  EXPECT_EQ(crc32c(ones.data(), 32), 0x62A8AB43u);
  EXPECT_EQ(crc32c(up.data(), 32), 0x46DD794Eu);
  EXPECT_EQ(crc32c(down.data(), 32), 0x113FDB5Cu);
}

TEST(TensorBoardCrc32c, TableMatchesBitwiseAndExtends) {
  std::mt19937 rng(7);
  for (int n : {1, 7, 8, 63, 1000}) {
    std::string s(n, '\0');
    for (char& c : s) c = static_cast<char>(rng());
    EXPECT_EQ(crc32c(s.data(), s.size()), crc32c_bitwise(s)) << n;
    for (int cut : {0, n / 3, n}) {
      const uint32_t head = crc32c(s.data(), cut);
      EXPECT_EQ(crc32c_extend(head, s.data() + cut, n - cut), crc32c(s.data(), n)) << n << " cut " << cut;
    }
  }
}

TEST(TensorBoardCrc32c, Mask) {
  EXPECT_EQ(crc32c_mask(0), 0xa282ead8u);
  EXPECT_EQ(crc32c_mask(0xE3069283u), 0xc78ab0e5u);  // ((c >> 15) | (c << 17)) + 0xa282ead8
  for (uint32_t c : {0u, 1u, 0xE3069283u, 0xFFFFFFFFu, 0x80000000u}) {
    EXPECT_EQ(crc32c_unmask(crc32c_mask(c)), c);
    EXPECT_EQ(unmask(crc32c_mask(c)), c);
  }
}

TEST(TensorBoardEncoding, ScalarEventBytes) {
  // wall_time 1.5 (field 1, fixed64), step 300 (field 2, varint AC 02), summary (field 5) =
  // Summary{ value (1) = Value{ tag (1) "a", simple_value (2) 2.0f } }.
  static const char kWant[] =
      "\x09\x00\x00\x00\x00\x00\x00\xf8\x3f"
      "\x10\xac\x02"
      "\x2a\x0a"
      "\x0a\x08"
      "\x0a\x01" "a"
      "\x15\x00\x00\x00\x40";
  const std::string want(kWant, sizeof kWant - 1);
  ASSERT_EQ(want.size(), 24u);
  EXPECT_EQ(encode_scalar_event(1.5, 300, {{"a", 2.0}}), want);
  const std::string fv = encode_file_version_event(0.0);
  static const char kVersion[] = "\x10\x00\x1a\x0d" "brain.Event:2";
  EXPECT_EQ(fv.substr(9), std::string(kVersion, sizeof kVersion - 1));
}

TEST(TensorBoardEncoding, SessionStartBytes) {
  // step 5, session_log (field 7) = SessionLog{ status (1) = START (1) }.
  static const char kWant[] = "\x10\x05\x3a\x02\x08\x01";
  const std::string e = encode_session_start_event(0.0, 5);
  EXPECT_EQ(e.substr(0, 9), std::string("\x09\0\0\0\0\0\0\0\0", 9));
  EXPECT_EQ(e.substr(9), std::string(kWant, sizeof kWant - 1));
}

TEST(TensorBoardEncoding, RecordFraming) {
  const std::string data = "123456789";
  const std::string rec = frame_record(data);
  ASSERT_EQ(rec.size(), 8u + 4 + 9 + 4);
  EXPECT_EQ(rec.substr(0, 8), std::string("\x09\0\0\0\0\0\0\0", 8));
  EXPECT_EQ(le(rec, 8, 4), crc32c_mask(crc32c(rec.data(), 8)));
  EXPECT_EQ(rec.substr(12, 9), data);
  EXPECT_EQ(le(rec, 21, 4), 0xc78ab0e5u);
}

// ---- the writer, read back ----

TEST(TensorBoardWriter, RoundTripsScalarsAndSteps) {
  const std::string dir = testing::make_temp_dir("tb") + "/sub/dir";  // parents are created
  // Bounds from the clock the writer reads (std::time reads a coarser one, which can still show
  // the last second for a moment after the writer's clock has passed into the next).
  const auto now = [] {
    return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  };
  const double t0 = std::floor(now());
  EventWriter w;
  ASSERT_TRUE(w.open(dir).is_ok());
  ASSERT_TRUE(w.write_scalars(0, {{"loss", 7.6483}, {"lr", 2e-3}}).is_ok());
  ASSERT_TRUE(w.write_scalars(1, {{"loss", 7.1}}).is_ok());
  ASSERT_TRUE(w.write_scalars(123456789012LL, {{"val_loss", 6.25}, {"mfu", 0.41}}).is_ok());
  const std::string path = w.path();
  ASSERT_TRUE(w.close().is_ok());
  const double t1 = now();

  EXPECT_EQ(event_files(dir), std::vector<std::string>{path});
  const std::string name = fs::path(path).filename().string();
  const std::regex pattern("events\\.out\\.tfevents\\.([0-9]+)\\.[A-Za-z0-9._-]+\\." + std::to_string(getpid()) +
                           "\\.[0-9]+");
  std::smatch m;
  ASSERT_TRUE(std::regex_match(name, m, pattern)) << name;
  EXPECT_GE(std::stod(m[1]), t0);
  EXPECT_LE(std::stod(m[1]), t1);

  std::vector<Event> ev;
  Status st = read_event_file(path, &ev);
  ASSERT_TRUE(st.is_ok()) << st.to_string();
  ASSERT_EQ(ev.size(), 4u);
  for (const Event& e : ev) {
    EXPECT_GE(e.wall_time, t0);
    EXPECT_LE(e.wall_time, t1);
  }
  EXPECT_EQ(ev[1].step, 0);
  EXPECT_EQ(ev[2].step, 1);
  EXPECT_EQ(ev[3].step, 123456789012LL);
  using V = std::vector<std::pair<std::string, float>>;
  EXPECT_EQ(ev[1].values, (V{{"loss", 7.6483f}, {"lr", 2e-3f}}));
  EXPECT_EQ(ev[2].values, (V{{"loss", 7.1f}}));
  EXPECT_EQ(ev[3].values, (V{{"val_loss", 6.25f}, {"mfu", 0.41f}}));
}

// Each step is flushed: what a killed process leaves is everything written so far.
TEST(TensorBoardWriter, EachStepIsOnDiskBeforeClose) {
  const std::string dir = testing::make_temp_dir("tb");
  EventWriter w;
  ASSERT_TRUE(w.open(dir).is_ok());
  for (int64_t s = 0; s < 5; ++s) {
    ASSERT_TRUE(w.write_scalars(s, {{"loss", 1.0 + s}}).is_ok());
    std::vector<Event> ev;
    Status st = read_event_file(w.path(), &ev);  // another reader, the writer still open
    ASSERT_TRUE(st.is_ok()) << st.to_string();
    ASSERT_EQ(ev.size(), static_cast<size_t>(s + 2));
    EXPECT_EQ(ev.back().step, s);
  }
}

TEST(TensorBoardWriter, TwoWritersNeverShareAFile) {
  const std::string dir = testing::make_temp_dir("tb");
  EventWriter a, b;
  ASSERT_TRUE(a.open(dir).is_ok());
  ASSERT_TRUE(b.open(dir).is_ok());
  EXPECT_NE(a.path(), b.path());
  ASSERT_TRUE(a.write_scalars(1, {{"loss", 1}}).is_ok());
  ASSERT_TRUE(b.write_scalars(2, {{"loss", 2}}).is_ok());
  ASSERT_TRUE(a.write_scalars(3, {{"loss", 3}}).is_ok());
  Scalars s = scalars_of({a.path()});
  EXPECT_EQ(s["loss"], (std::map<int64_t, float>{{1, 1.f}, {3, 3.f}}));
  s = scalars_of({b.path()});
  EXPECT_EQ(s["loss"], (std::map<int64_t, float>{{2, 2.f}}));
  EXPECT_EQ(event_files(dir).size(), 2u);
}

TEST(TensorBoardWriter, OpenFailsWhereNoDirectoryCanBe) {
  const std::string dir = testing::make_temp_dir("tb");
  std::ofstream(dir + "/file") << "x";
  EventWriter w;
  Status st = w.open(dir + "/file");
  EXPECT_FALSE(st.is_ok());
  EXPECT_FALSE(w.is_open());
  EXPECT_NE(st.message().find(dir + "/file"), std::string::npos) << st.to_string();
  EXPECT_FALSE(w.write_scalars(0, {{"loss", 1}}).is_ok());
}

// The reader is a real check: every single-bit flip anywhere in the file, and every cut
// that is not at a record boundary, is reported.
TEST(TensorBoardWriter, ReaderDetectsEveryFlippedBitAndTornTail) {
  const std::string dir = testing::make_temp_dir("tb");
  EventWriter w;
  ASSERT_TRUE(w.open(dir).is_ok());
  ASSERT_TRUE(w.write_scalars(0, {{"loss", 2.5}, {"lr", 0.01}}).is_ok());
  ASSERT_TRUE(w.write_scalars(1, {{"loss", 2.25}}).is_ok());
  ASSERT_TRUE(w.close().is_ok());
  const std::string good = bytes_of(w.path());
  std::vector<std::string> recs;
  ASSERT_TRUE(read_records(good, &recs).is_ok());
  ASSERT_EQ(recs.size(), 3u);

  for (size_t i = 0; i < good.size(); ++i)
    for (int bit = 0; bit < 8; ++bit) {
      std::string bad = good;
      bad[i] = static_cast<char>(bad[i] ^ (1 << bit));
      EXPECT_FALSE(read_records(bad, &recs).is_ok()) << "flip at byte " << i << " bit " << bit;
    }
  std::string one = good;
  one[good.size() - 6] ^= 0x20;  // in the last record's data
  Status st = read_records(one, &recs);
  EXPECT_NE(st.message().find("data CRC mismatch"), std::string::npos) << st.to_string();
  one = good;
  one[0] ^= 1;  // the first record's length
  st = read_records(one, &recs);
  EXPECT_NE(st.message().find("length CRC mismatch"), std::string::npos) << st.to_string();

  ASSERT_TRUE(read_records(good, &recs).is_ok());
  std::vector<size_t> bounds = {0};
  for (const std::string& r : recs) bounds.push_back(bounds.back() + r.size() + 16);
  ASSERT_EQ(bounds.back(), good.size());
  for (size_t cut = 0; cut < good.size(); ++cut) {
    const bool boundary = std::find(bounds.begin(), bounds.end(), cut) != bounds.end();
    EXPECT_EQ(read_records(good.substr(0, cut), &recs).is_ok(), boundary) << "cut at " << cut;
  }
}

// ---- the trainer ----

const char* kConfig = R"({"model_type": "laplace", "vocab_size": 97, "hidden_size": 32, "num_layers": 2,
  "num_heads": 2, "head_k_dim": 8, "head_v_dim": 16, "ffn_size": 64, "chunk_size": 16})";

struct TinyRun {
  std::string dir, config, train, val;
  TinyRun() {
    dir = testing::make_temp_dir("tb_train");
    config = dir + "/config.json";
    std::ofstream(config) << kConfig;
    std::mt19937 rng(3);
    auto tokens = [&](size_t n) {
      std::vector<uint32_t> toks(n);
      uint32_t t = 0;
      for (auto& x : toks) x = t = (t * 7 + rng() % 5) % 97;
      return toks;
    };
    train = dir + "/train_000000.bin";
    val = dir + "/val_000000.bin";
    EXPECT_TRUE(shard_write(train, tokens(6000), 97).is_ok());
    EXPECT_TRUE(shard_write(val, tokens(1000), 97).is_ok());
  }
  TrainOptions options(const std::string& out) const {
    TrainOptions o;
    o.config_path = config;
    o.train_data = {train};
    o.val_data = {val};
    o.out_dir = out;
    o.tensorboard_dir = out + "/tb";
    o.batch = 3;
    o.seq = 40;
    o.steps = 6;
    o.schedule.lr = 0.02;
    o.schedule.warmup_steps = 2;
    o.eval_every = 2;
    o.eval_batches = 2;
    o.peak_flops = 1e12;
    o.quiet = true;
    return o;
  }
};

void train(const TrainOptions& o) {
  Trainer t(o);
  Status st = t.setup();
  ASSERT_TRUE(st.is_ok()) << st.to_string();
  st = t.run();
  ASSERT_TRUE(st.is_ok()) << st.to_string();
}

// metrics.jsonl as (key → step → value), a step's last record winning (a resume from an
// older checkpoint appends the redone steps again): the same shape as the event files' scalars.
Scalars metrics_of(const std::string& path) {
  Scalars s;
  std::ifstream f(path);
  std::string line;
  while (std::getline(f, line)) {
    const auto j = nlohmann::json::parse(line);
    const int64_t step = j.at("step").get<int64_t>();
    for (const char* k : {"loss", "val_loss", "lr", "grad_norm", "tokens_per_s", "mfu"}) {
      if (j.contains(k)) {
        s[k][step] = static_cast<float>(j.at(k).get<double>());
      }
    }
  }
  return s;
}

// The steps of a file's SessionLog START events, and where in the file they are.
std::vector<std::pair<size_t, int64_t>> starts_of(const std::string& file) {
  std::vector<Event> ev;
  Status st = read_event_file(file, &ev);
  EXPECT_TRUE(st.is_ok()) << st.to_string();
  std::vector<std::pair<size_t, int64_t>> out;
  for (size_t i = 0; i < ev.size(); ++i)
    if (ev[i].session_status == 1) out.emplace_back(i, ev[i].step);
  return out;
}
using Starts = std::vector<std::pair<size_t, int64_t>>;

TEST(TensorBoardTrain, ScalarsEqualMetricsJsonl) {
  TinyRun r;
  const std::string out = r.dir + "/run";
  ASSERT_NO_FATAL_FAILURE(train(r.options(out)));
  const auto files = event_files(out + "/tb");
  ASSERT_EQ(files.size(), 1u);
  const Scalars tb = scalars_of(files);
  const Scalars mj = metrics_of(out + "/metrics.jsonl");
  ASSERT_EQ(mj.at("loss").size(), 6u);
  ASSERT_EQ(mj.at("val_loss").size(), 3u);  // after steps 2, 4, 6 (0-based 1, 3, 5)
  EXPECT_EQ(tb, mj);                         // every tag, step and float value
  for (const char* k : {"loss", "val_loss", "lr", "grad_norm", "tokens_per_s", "mfu"})
    EXPECT_TRUE(tb.count(k)) << k;
  EXPECT_EQ(tb.at("val_loss").begin()->first, 1);
  EXPECT_LT(tb.at("loss").rbegin()->second, tb.at("loss").begin()->second);
  EXPECT_EQ(starts_of(files[0]), (Starts{{1, 0}}));  // right after file_version: the run starts at 0
}

// Without --peak-tflops there is no mfu; without --tensorboard no event file.
TEST(TensorBoardTrain, MfuOnlyWithPeakAndNothingWithoutTheFlag) {
  TinyRun r;
  TrainOptions o = r.options(r.dir + "/a");
  o.peak_flops = 0;
  o.eval_every = 0;
  ASSERT_NO_FATAL_FAILURE(train(o));
  const Scalars tb = scalars_of(event_files(o.tensorboard_dir));
  EXPECT_EQ(tb.count("mfu"), 0u);
  EXPECT_EQ(tb.count("val_loss"), 0u);
  EXPECT_EQ(tb.at("loss").size(), 6u);

  o = r.options(r.dir + "/b");
  o.tensorboard_dir.clear();
  ASSERT_NO_FATAL_FAILURE(train(o));
  EXPECT_FALSE(fs::exists(r.dir + "/b/tb"));
}

// A resumed run appends a new file; together the files hold every step once, equal to
// the (appended) metrics.jsonl.
TEST(TensorBoardTrain, ResumeAddsAFile) {
  TinyRun r;
  const std::string out = r.dir + "/run";
  TrainOptions first = r.options(out);
  first.stop_after = 3;
  ASSERT_NO_FATAL_FAILURE(train(first));
  ASSERT_EQ(event_files(out + "/tb").size(), 1u);
  TrainOptions second = r.options(out);
  second.resume = "auto";
  ASSERT_NO_FATAL_FAILURE(train(second));
  const auto files = event_files(out + "/tb");
  ASSERT_EQ(files.size(), 2u);
  EXPECT_EQ(starts_of(files[1]), (Starts{{1, 3}}));
  const Scalars tb = scalars_of(files);
  EXPECT_EQ(tb.at("loss").size(), 6u);
  EXPECT_EQ(tb, metrics_of(out + "/metrics.jsonl"));
}

// A crash after the last checkpoint: the resumed run redoes steps the old file already
// has. Its START drops them, so each step shows once, with the redone values (which are
// bitwise the same here: resume is exact).
TEST(TensorBoardTrain, ResumeFromAnOlderCheckpointDropsTheRedoneSteps) {
  TinyRun r;
  const std::string out = r.dir + "/run";
  TrainOptions first = r.options(out);
  first.stop_after = 2;
  ASSERT_NO_FATAL_FAILURE(train(first));
  fs::copy_file(out + "/checkpoint.safetensors", r.dir + "/step2.safetensors");
  TrainOptions rest = r.options(out);
  rest.resume = "auto";
  ASSERT_NO_FATAL_FAILURE(train(rest));  // steps 2..5
  // "Crash": only step 2's checkpoint survived; steps 2..5 run again.
  fs::copy_file(r.dir + "/step2.safetensors", out + "/checkpoint.safetensors", fs::copy_options::overwrite_existing);
  ASSERT_NO_FATAL_FAILURE(train(rest));
  const auto files = event_files(out + "/tb");
  ASSERT_EQ(files.size(), 3u);
  EXPECT_EQ(starts_of(files[2]), (Starts{{1, 2}}));
  int starts = 0;
  const Scalars tb = scalars_of(files, &starts);  // fails on a (tag, step) seen twice without a START between
  EXPECT_EQ(starts, 3);
  EXPECT_EQ(tb.at("loss").size(), 6u);
  EXPECT_EQ(tb.at("val_loss").size(), 3u);
  EXPECT_EQ(tb, metrics_of(out + "/metrics.jsonl"));
}

TEST(TensorBoardTrain, CommandLineFlag) {
  TinyRun r;
  const std::string out = r.dir + "/cli", tbdir = r.dir + "/tb events";  // a space in the path
  const std::string cmd = std::string(LAPLACE_BINARY) + " train --config " + r.config + " --data " + r.train +
                          " --val-data " + r.val + " --out " + out + " --tensorboard '" + tbdir +
                          "' --batch 3 --seq 40 --steps 4 --lr 0.02 --eval-every 2 --eval-batches 1 "
                          "--peak-tflops 1 --quiet >/dev/null 2>&1";
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  const auto files = event_files(tbdir);
  ASSERT_EQ(files.size(), 1u);
  const Scalars tb = scalars_of(files);
  EXPECT_EQ(tb, metrics_of(out + "/metrics.jsonl"));
  EXPECT_EQ(tb.at("loss").size(), 4u);
  EXPECT_EQ(tb.at("val_loss").size(), 2u);
  EXPECT_EQ(tb.at("mfu").size(), 4u);
}

// A distributed run records like a single-process one: rank 0 writes the one event file, and
// its scalars equal metrics.jsonl's (MPI over the CPU: two ranks).
TEST(TensorBoardTrain, DistributedRunWritesOneFileFromRankZero) {
  if (!mpi_available()) GTEST_SKIP() << "built without MPI (install libopenmpi-dev)";
  if (std::system("command -v mpirun >/dev/null 2>&1") != 0) GTEST_SKIP() << "no mpirun";
  TinyRun r;
  const std::string out = r.dir + "/dist", tbdir = r.dir + "/tb";
  const std::string cmd = "OMP_NUM_THREADS=1 mpirun --allow-run-as-root --oversubscribe -x OMP_NUM_THREADS=1 -np 2 " +
                          std::string(LAPLACE_BINARY) + " train --config " + r.config + " --data " + r.train +
                          " --val-data " + r.val + " --out " + out + " --tensorboard " + tbdir +
                          " --batch 2 --seq 40 --steps 4 --lr 0.02 --eval-every 2 --eval-batches 1 "
                          "--peak-tflops 1 --quiet >/dev/null 2>&1";
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  const auto files = event_files(tbdir);
  ASSERT_EQ(files.size(), 1u);
  const Scalars tb = scalars_of(files);
  EXPECT_EQ(tb, metrics_of(out + "/metrics.jsonl"));
  EXPECT_EQ(tb.at("loss").size(), 4u);
  EXPECT_EQ(tb.at("val_loss").size(), 2u);
}

}  // namespace
}  // namespace laplace
