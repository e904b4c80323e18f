#include "core/safetensors.h"

#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "core/file_util.h"
#include "tests/test_util.h"

namespace laplace {
namespace {

using testing::OwnedTensor;

std::string le64(uint64_t n) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  return s;
}

// A safetensors file from a header string and data bytes (no padding added).
std::string st_bytes(const std::string& header, const std::string& data) { return le64(header.size()) + header + data; }

// One header entry, as the reference writer prints it.
std::string entry(const std::string& name, const std::string& dtype, const std::string& shape, uint64_t b,
                  uint64_t e) {
  return "\"" + name + "\":{\"dtype\":\"" + dtype + "\",\"shape\":" + shape + ",\"data_offsets\":[" +
         std::to_string(b) + "," + std::to_string(e) + "]}";
}

bool contains(const std::string& hay, const std::string& needle) { return hay.find(needle) != std::string::npos; }

class SafeTensorsTest : public ::testing::Test {
 protected:
  void SetUp() override { dir_ = testing::make_temp_dir("st"); }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  std::string path(const std::string& name) const { return dir_ + "/" + name; }

  // Plain write (no fsync): the loops below write thousands of files.
  void put(const std::string& p, const std::string& bytes) {
    std::ofstream f(p, std::ios::binary | std::ios::trunc);
    f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    ASSERT_TRUE(f.good());
  }
  std::string get(const std::string& p) {
    std::string s;
    Status st = read_file(p, &s);
    EXPECT_TRUE(st.is_ok()) << st.to_string();
    return s;
  }
  Status open_bytes(const std::string& bytes, SafeTensorsReader* r, const std::string& name = "t.safetensors") {
    put(path(name), bytes);
    return SafeTensorsReader::open(path(name), r);
  }

  // Reads every tensor of an opened file into fresh buffers (exercises all
  // offsets under ASan).
  void read_all(const SafeTensorsReader& r) {
    for (const SafeTensorInfo& t : r.tensors()) {
      std::vector<double> buf(static_cast<size_t>(t.nbytes() / 8 + 1));
      Tensor dst = Tensor::make(buf.data(), t.dtype, t.shape.data(), static_cast<int>(t.shape.size()));
      Status st = r.read_into(t.name, dst);
      EXPECT_TRUE(st.is_ok()) << st.to_string();
      Tensor v;
      if (r.view(t, &v).is_ok() && t.nbytes() > 0) {
        EXPECT_EQ(std::memcmp(v.data, buf.data(), t.nbytes()), 0);
      }
    }
  }

  std::string dir_;
};

// ---------------------------------------------------------------- round trip

TEST_F(SafeTensorsTest, RoundTripAllDtypesAndShapes) {
  OwnedTensor f64(DType::kF64, {2, 3, 5});
  OwnedTensor f32(DType::kF32, {3, 4});
  OwnedTensor f32_4d(DType::kF32, {2, 3, 2, 2});
  OwnedTensor scalar(DType::kF32, {});
  OwnedTensor empty(DType::kF32, {0, 5});
  OwnedTensor i32(DType::kI32, {5});
  OwnedTensor bf16(DType::kBF16, {7});  // 14 bytes: last, so nothing after it is misaligned
  testing::fill_uniform(f64, 1);
  testing::fill_uniform(f32, 2);
  testing::fill_uniform(f32_4d, 3);
  testing::fill_uniform(scalar, 4);
  testing::fill_uniform(bf16, 5);
  for (int i = 0; i < 5; ++i) i32.ptr<int32_t>()[i] = i * 1000003 - 7;

  std::vector<NamedTensor> ts = {{"model.f64", f64},   {"model.layers.0.w", f32}, {"four_d", f32_4d},
                                 {"scalar", scalar},   {"empty", empty},          {"ints", i32},
                                 {"model.bf16", bf16}};
  std::map<std::string, std::string> meta = {{"step", "42"}, {"note", "h\u00e9llo \"quoted\"\n"}};
  const std::string p = path("rt.safetensors");
  ASSERT_TRUE(safetensors_write(p, ts, meta).is_ok());

  SafeTensorsReader r;
  Status st = SafeTensorsReader::open(p, &r);
  ASSERT_TRUE(st.is_ok()) << st.to_string();
  EXPECT_EQ(r.path(), p);
  EXPECT_EQ(r.metadata().at("step"), "42");
  EXPECT_EQ(r.metadata().at("note"), "h\u00e9llo \"quoted\"\n");
  EXPECT_EQ(r.metadata().at("format"), "pt");
  EXPECT_EQ(r.metadata().size(), 3u);
  ASSERT_EQ(r.tensors().size(), ts.size());

  // Layout follows the given order, and tensors() is sorted by offset.
  for (size_t i = 0; i < ts.size(); ++i) {
    const SafeTensorInfo& info = r.tensors()[i];
    const Tensor& src = ts[i].tensor;
    EXPECT_EQ(info.name, ts[i].name);
    EXPECT_EQ(info.dtype, src.dtype);
    ASSERT_EQ(static_cast<int>(info.shape.size()), src.ndim);
    for (int d = 0; d < src.ndim; ++d) EXPECT_EQ(info.shape[d], src.shape[d]);
    EXPECT_EQ(info.nbytes(), src.nbytes());
    if (i > 0) {
      EXPECT_EQ(info.begin, r.tensors()[i - 1].end);
    }
    ASSERT_EQ(r.find(ts[i].name), &info);

    std::vector<double> buf(src.nbytes() / 8 + 1, -1.0);
    Tensor dst = Tensor::make(buf.data(), src.dtype, src.shape.data(), src.ndim);
    st = r.read_into(ts[i].name, dst);
    ASSERT_TRUE(st.is_ok()) << st.to_string();
    EXPECT_EQ(std::memcmp(buf.data(), src.data, src.nbytes()), 0) << ts[i].name;

    Tensor v;
    st = r.view(info, &v);
    ASSERT_TRUE(st.is_ok()) << st.to_string();
    EXPECT_TRUE(same_shape(v, src));
    EXPECT_EQ(v.dtype, src.dtype);
    EXPECT_EQ(std::memcmp(v.data, src.data, src.nbytes()), 0) << ts[i].name;
  }
  EXPECT_EQ(r.find("model.f64")->shape_str(), "[2, 3, 5] F64");
  EXPECT_EQ(r.find("scalar")->numel(), 1);
  EXPECT_EQ(r.find("empty")->numel(), 0);
  EXPECT_EQ(r.find("absent"), nullptr);

  // A moved reader keeps working (the mapping moves with it).
  SafeTensorsReader r2 = std::move(r);
  float x;
  ASSERT_TRUE(r2.read_into("scalar", Tensor(&x, DType::kF32, {})).is_ok());
  EXPECT_EQ(x, scalar.ptr<float>()[0]);
}

TEST_F(SafeTensorsTest, EmptyTensorSetRoundTrips) {
  const std::string p = path("none.safetensors");
  ASSERT_TRUE(safetensors_write(p, {}, {}).is_ok());
  SafeTensorsReader r;
  ASSERT_TRUE(SafeTensorsReader::open(p, &r).is_ok());
  EXPECT_TRUE(r.tensors().empty());
  EXPECT_EQ(r.metadata().at("format"), "pt");
}

TEST_F(SafeTensorsTest, WrittenHeaderFormat) {
  OwnedTensor a(DType::kF32, {3});
  const std::string p = path("h.safetensors");
  ASSERT_TRUE(safetensors_write(p, {{"a", a}}, {{"format", "np"}, {"k", "v"}}).is_ok());
  std::string bytes = get(p);
  ASSERT_GE(bytes.size(), 8u);
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= static_cast<uint64_t>(static_cast<uint8_t>(bytes[i])) << (8 * i);
  EXPECT_EQ(n % 8, 0u);
  EXPECT_EQ(bytes.size(), 8 + n + 12);
  std::string header = bytes.substr(8, n);
  EXPECT_EQ(header[0], '{');
  EXPECT_TRUE(contains(header, "\"format\":\"pt\"")) << header;  // caller's "np" replaced
  EXPECT_FALSE(contains(header, "np")) << header;
  EXPECT_EQ(header.rfind("{\"__metadata__\":{\"format\":\"pt\",\"k\":\"v\"},", 0), 0u) << header;
  EXPECT_EQ(header.find_last_not_of(' '), header.rfind('}'));  // only spaces after the object
}

// The reference (Python) writer's output for
//   save_file({"a": tensor([[1, 2], [3, -4.5]]), "b": tensor([1, -2, 3], int32),
//              "c": tensor([1, -2], bfloat16)}, path, metadata={"format": "pt"})
// written out by hand, byte for byte. It sorts tensors by dtype size (F32, I32,
// BF16), which is also the order given to safetensors_write below.
const char kPyHeader[] =
    "{\"__metadata__\":{\"format\":\"pt\"},"
    "\"a\":{\"dtype\":\"F32\",\"shape\":[2,2],\"data_offsets\":[0,16]},"
    "\"b\":{\"dtype\":\"I32\",\"shape\":[3],\"data_offsets\":[16,28]},"
    "\"c\":{\"dtype\":\"BF16\",\"shape\":[2],\"data_offsets\":[28,32]}} ";  // 199 bytes + 1 pad = 200
const unsigned char kPyPrefix[8] = {0xc8, 0, 0, 0, 0, 0, 0, 0};          // 200, little-endian
const unsigned char kPyData[32] = {
    0x00, 0x00, 0x80, 0x3f, 0x00, 0x00, 0x00, 0x40, 0x00, 0x00, 0x40, 0x40, 0x00, 0x00, 0x90, 0xc0,  // a
    0x01, 0x00, 0x00, 0x00, 0xfe, 0xff, 0xff, 0xff, 0x03, 0x00, 0x00, 0x00,                          // b
    0x80, 0x3f, 0x00, 0xc0};                                                                          // c

std::string python_file() {
  return std::string(reinterpret_cast<const char*>(kPyPrefix), 8) + std::string(kPyHeader, sizeof(kPyHeader) - 1) +
         std::string(reinterpret_cast<const char*>(kPyData), sizeof(kPyData));
}

TEST_F(SafeTensorsTest, WriterMatchesPythonByteForByte) {
  ASSERT_EQ(sizeof(kPyHeader) - 1, 200u);
  OwnedTensor a(DType::kF32, {2, 2});
  OwnedTensor b(DType::kI32, {3});
  OwnedTensor c(DType::kBF16, {2});
  float av[] = {1, 2, 3, -4.5f};
  int32_t bv[] = {1, -2, 3};
  std::memcpy(a.ptr<float>(), av, sizeof(av));
  std::memcpy(b.ptr<int32_t>(), bv, sizeof(bv));
  static_cast<uint16_t*>(c.t.data)[0] = float_to_bf16(1.0f);
  static_cast<uint16_t*>(c.t.data)[1] = float_to_bf16(-2.0f);
  const std::string p = path("ours.safetensors");
  ASSERT_TRUE(safetensors_write(p, {{"a", a}, {"b", b}, {"c", c}}, {}).is_ok());
  EXPECT_EQ(get(p), python_file());
}

TEST_F(SafeTensorsTest, ReadsPythonFile) {
  SafeTensorsReader r;
  Status st = open_bytes(python_file(), &r);
  ASSERT_TRUE(st.is_ok()) << st.to_string();
  EXPECT_EQ(r.metadata().at("format"), "pt");
  ASSERT_EQ(r.tensors().size(), 3u);
  float a[4];
  ASSERT_TRUE(r.read_into("a", Tensor(a, DType::kF32, {2, 2})).is_ok());
  EXPECT_EQ(a[0], 1.0f);
  EXPECT_EQ(a[3], -4.5f);
  int32_t b[3];
  ASSERT_TRUE(r.read_into("b", Tensor(b, DType::kI32, {3})).is_ok());
  EXPECT_EQ(b[1], -2);
  float c[2];  // BF16 -> F32
  ASSERT_TRUE(r.read_into("c", Tensor(c, DType::kF32, {2})).is_ok());
  EXPECT_EQ(c[0], 1.0f);
  EXPECT_EQ(c[1], -2.0f);
}

TEST_F(SafeTensorsTest, ReadsUnpaddedHeaderWithoutMetadata) {
  // Older writers neither pad the header nor always write __metadata__; the
  // data section then starts unaligned: view() refuses, read_into works.
  std::string header = "{" + entry("x", "F32", "[2]", 0, 8) + "}";
  ASSERT_NE((8 + header.size()) % 4, 0u);
  float xs[2] = {0.5f, -7.25f};
  SafeTensorsReader r;
  ASSERT_TRUE(open_bytes(st_bytes(header, std::string(reinterpret_cast<char*>(xs), 8)), &r).is_ok());
  EXPECT_TRUE(r.metadata().empty());
  float out[2];
  ASSERT_TRUE(r.read_into("x", Tensor(out, DType::kF32, {2})).is_ok());
  EXPECT_EQ(out[0], 0.5f);
  EXPECT_EQ(out[1], -7.25f);
  Tensor v;
  Status st = r.view(*r.find("x"), &v);
  EXPECT_FALSE(st.is_ok());
  EXPECT_TRUE(contains(st.message(), "aligned")) << st.message();
  // A copied info is accepted just like the original.
  SafeTensorInfo copy = *r.find("x");
  EXPECT_EQ(r.bytes(copy), r.bytes(*r.find("x")));
}

// ---------------------------------------------------------------- read_into

TEST_F(SafeTensorsTest, ReadIntoMismatchErrors) {
  OwnedTensor w(DType::kF32, {3, 5});
  testing::fill_uniform(w, 9);
  const std::string p = path("m.safetensors");
  ASSERT_TRUE(safetensors_write(p, {{"model.layers.0.wqkvg.weight", w}}, {}).is_ok());
  SafeTensorsReader r;
  ASSERT_TRUE(SafeTensorsReader::open(p, &r).is_ok());

  OwnedTensor wrong(DType::kF32, {3, 4});
  Status st = r.read_into("model.layers.0.wqkvg.weight", wrong);
  EXPECT_EQ(st.code(), Status::Code::kInvalidArgument);
  EXPECT_EQ(st.message(), p + ": model.layers.0.wqkvg.weight: expected shape [3, 4] F32, file has [3, 5] F32");

  OwnedTensor flat(DType::kF32, {15});  // same numel, different rank
  st = r.read_into("model.layers.0.wqkvg.weight", flat);
  EXPECT_FALSE(st.is_ok());
  EXPECT_TRUE(contains(st.message(), "expected shape [15] F32, file has [3, 5] F32")) << st.message();

  OwnedTensor ints(DType::kI32, {3, 5});
  st = r.read_into("model.layers.0.wqkvg.weight", ints);
  EXPECT_EQ(st.code(), Status::Code::kUnsupported);
  EXPECT_TRUE(contains(st.message(), "no conversion from F32 to I32")) << st.message();

  st = r.read_into("model.layers.1.wqkvg.weight", wrong);
  EXPECT_EQ(st.code(), Status::Code::kNotFound);
  EXPECT_TRUE(contains(st.message(), "no tensor named 'model.layers.1.wqkvg.weight'")) << st.message();
}

TEST_F(SafeTensorsTest, ReadIntoConversions) {
  OwnedTensor f32(DType::kF32, {4, 3});
  OwnedTensor f64(DType::kF64, {5});
  OwnedTensor bf(DType::kBF16, {6});
  testing::fill_uniform(f32, 11, -100, 100);
  testing::fill_uniform(f64, 12, -100, 100);
  testing::fill_uniform(bf, 13, -100, 100);
  const std::string p = path("c.safetensors");
  ASSERT_TRUE(safetensors_write(p, {{"f64", f64}, {"f32", f32}, {"bf", bf}}, {}).is_ok());
  SafeTensorsReader r;
  ASSERT_TRUE(SafeTensorsReader::open(p, &r).is_ok());

  OwnedTensor bf_as_f32(DType::kF32, {6});  // exact
  ASSERT_TRUE(r.read_into("bf", bf_as_f32).is_ok());
  const auto* bf_bits = static_cast<const uint16_t*>(bf.t.data);
  for (int i = 0; i < 6; ++i) EXPECT_EQ(bf_as_f32.ptr<float>()[i], bf16_to_float(bf_bits[i]));

  OwnedTensor f32_as_f64(DType::kF64, {4, 3});  // exact
  ASSERT_TRUE(r.read_into("f32", f32_as_f64).is_ok());
  for (int i = 0; i < 12; ++i) EXPECT_EQ(f32_as_f64.ptr<double>()[i], static_cast<double>(f32.ptr<float>()[i]));

  OwnedTensor f64_as_f32(DType::kF32, {5});  // rounded
  ASSERT_TRUE(r.read_into("f64", f64_as_f32).is_ok());
  for (int i = 0; i < 5; ++i) EXPECT_EQ(f64_as_f32.ptr<float>()[i], static_cast<float>(f64.ptr<double>()[i]));

  OwnedTensor f32_as_bf(DType::kBF16, {4, 3});  // rounded to nearest even
  ASSERT_TRUE(r.read_into("f32", f32_as_bf).is_ok());
  const auto* got = static_cast<const uint16_t*>(f32_as_bf.t.data);
  for (int i = 0; i < 12; ++i) EXPECT_EQ(got[i], float_to_bf16(f32.ptr<float>()[i]));

  OwnedTensor bf_as_f64(DType::kF64, {6});
  EXPECT_EQ(r.read_into("bf", bf_as_f64).code(), Status::Code::kUnsupported);
}

// ---------------------------------------------------------------- writer errors

TEST_F(SafeTensorsTest, WriterRejectsBadInput) {
  OwnedTensor a(DType::kF32, {2, 4});
  const std::string p = path("w.safetensors");
  ASSERT_TRUE(write_file_atomic(p, "old", 3).is_ok());
  struct Case {
    std::vector<NamedTensor> ts;
    std::string word;
  };
  std::vector<Case> cases = {
      {{{"a", a}, {"a", a}}, "duplicate"},
      {{{"__metadata__", a}}, "reserved"},
      {{{"", a}}, "empty tensor name"},
      {{{"bad\xff\xfeutf8", a}}, "UTF-8"},
      {{{"strided", a.t.slice(1, 0, 2)}}, "contiguous"},
      {{{"nodata", Tensor(nullptr, DType::kF32, {3})}}, "no data"},
  };
  Tensor cuda_t = a.t;
  cuda_t.device = Device::kCUDA;
  cases.push_back({{{"gpu", cuda_t}}, "CPU"});
  for (const Case& c : cases) {
    Status st = safetensors_write(p, c.ts, {});
    EXPECT_EQ(st.code(), Status::Code::kInvalidArgument) << c.word;
    EXPECT_TRUE(contains(st.message(), c.word)) << st.message();
  }
  Status st = safetensors_write(p, {{"a", a}}, {{"k", "bad\xc3"}});
  EXPECT_TRUE(contains(st.message(), "UTF-8")) << st.message();
  EXPECT_EQ(get(p), "old");  // nothing was written
  EXPECT_EQ(std::distance(std::filesystem::directory_iterator(dir_), {}), 1);
}

TEST_F(SafeTensorsTest, WriteIntoMissingDirectoryFails) {
  OwnedTensor a(DType::kF32, {2});
  const std::string p = path("missing/dir/x.safetensors");
  Status st = safetensors_write(p, {{"a", a}}, {});
  EXPECT_FALSE(st.is_ok());
  EXPECT_TRUE(contains(st.message(), p)) << st.message();
  EXPECT_EQ(std::distance(std::filesystem::directory_iterator(dir_), {}), 0);
}

TEST_F(SafeTensorsTest, OpenMissingFile) {
  SafeTensorsReader r;
  Status st = SafeTensorsReader::open(path("absent.safetensors"), &r);
  EXPECT_EQ(st.code(), Status::Code::kNotFound);
  EXPECT_TRUE(contains(st.message(), "absent.safetensors")) << st.message();
}

// ---------------------------------------------------------------- corruption

struct BadFile {
  std::string label;
  std::string bytes;
  std::string word;  // expected in the error message
};

std::vector<BadFile> bad_files() {
  const std::string d8(8, '\x11'), d12(12, '\x22'), d16(16, '\x33');
  auto one = [](const std::string& body) { return "{\"a\":" + body + "}"; };
  std::vector<BadFile> v = {
      {"empty file", "", "shorter than the 8-byte"},
      {"7 bytes", std::string(7, '\0'), "shorter than the 8-byte"},
      {"zero header length", le64(0) + d8, "header length is 0"},
      {"header over 100 MB", le64(100'000'001) + "{}", "exceeds the limit"},
      {"header length 2^64-1", le64(~0ull) + "{}", "exceeds the limit"},
      {"header past end", le64(1000) + "{}" + d8, "runs past the end of the file"},
      {"header past end by one", le64(3) + "{}", "runs past the end of the file"},
      {"not json", st_bytes("{abc", ""), "not valid JSON"},
      {"truncated json", st_bytes("{\"a\":{\"dtype\":\"F3", ""), "not valid JSON"},
      {"trailing garbage", st_bytes("{} x", ""), "not valid JSON"},
      {"invalid utf-8", st_bytes("{\"\xff\":1}", ""), "not valid JSON"},
      {"control byte", st_bytes("{\"a\x1b[31m\":1}", ""), "control character"},
      {"long garbage key", st_bytes("{\"" + std::string(5000, 'k') + "\":1}", ""), "(5000 bytes)"},
      {"escaped newline in name", st_bytes("{\"a\\nb\":1}", ""), "'a\\x0ab'"},
      {"nul in header", st_bytes(std::string("{}\0", 3), ""), "not valid JSON"},
      {"huge number", st_bytes(one("{\"dtype\":\"F32\",\"shape\":[1e999],\"data_offsets\":[0,4]}"), ""),
       "not valid JSON"},
      {"array header", st_bytes("[1,2]   ", ""), "not a JSON object"},
      {"string header", st_bytes("\"abc\"", ""), "not a JSON object"},
      {"number header", st_bytes("12345678", ""), "not a JSON object"},
      {"null header", st_bytes("null", ""), "not a JSON object"},
      {"entry not object", st_bytes(one("[1]"), ""), "entry must be an object"},
      {"missing dtype", st_bytes(one("{\"shape\":[1],\"data_offsets\":[0,4]}"), std::string(4, 'x')),
       "missing \"dtype\""},
      {"missing shape", st_bytes(one("{\"dtype\":\"F32\",\"data_offsets\":[0,4]}"), std::string(4, 'x')),
       "missing \"shape\""},
      {"missing data_offsets", st_bytes(one("{\"dtype\":\"F32\",\"shape\":[1]}"), std::string(4, 'x')),
       "missing \"data_offsets\""},
      {"dtype not string", st_bytes(one("{\"dtype\":4,\"shape\":[1],\"data_offsets\":[0,4]}"), std::string(4, 'x')),
       "\"dtype\" must be a string"},
      {"unknown dtype", st_bytes("{" + entry("a", "F128", "[1]", 0, 16) + "}", d16), "unknown dtype 'F128'"},
      {"lowercase dtype", st_bytes("{" + entry("a", "f32", "[1]", 0, 4) + "}", std::string(4, 'x')),
       "unknown dtype"},
      {"shape not array", st_bytes("{" + entry("a", "F32", "\"2\"", 0, 8) + "}", d8), "\"shape\" must be an array"},
      {"shape of floats", st_bytes("{" + entry("a", "F32", "[2.0]", 0, 8) + "}", d8), "must hold integers"},
      {"shape of strings", st_bytes("{" + entry("a", "F32", "[\"2\"]", 0, 8) + "}", d8), "must hold integers"},
      {"shape of null", st_bytes("{" + entry("a", "F32", "[null]", 0, 8) + "}", d8), "must hold integers"},
      {"negative dim", st_bytes("{" + entry("a", "F32", "[-2]", 0, 8) + "}", d8), "negative dimension"},
      {"dim over int64", st_bytes("{" + entry("a", "U8", "[18446744073709551615]", 0, 8) + "}", d8),
       "overflows int64"},
      {"numel overflow", st_bytes("{" + entry("a", "F32", "[4294967296,4294967296]", 0, 8) + "}", d8),
       "element count of \"shape\" overflows"},
      {"numel wraps to small", st_bytes("{" + entry("a", "U8", "[4611686018427387904,4,1]", 0, 8) + "}", d8),
       "overflows"},
      {"overflow beside a zero", st_bytes("{" + entry("a", "F32", "[0,4611686018427387904,4]", 0, 0) + "}", ""),
       "overflows"},
      {"bytes overflow", st_bytes("{" + entry("a", "F32", "[2305843009213693952,2]", 0, 8) + "}", d8),
       "byte size of \"shape\" overflows"},
      {"offsets not array", st_bytes(one("{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":8}"), d8),
       "two non-negative integers"},
      {"one offset", st_bytes(one("{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[8]}"), d8),
       "two non-negative integers"},
      {"three offsets", st_bytes(one("{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8,8]}"), d8),
       "two non-negative integers"},
      {"negative offset", st_bytes(one("{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[-8,0]}"), d8),
       "two non-negative integers"},
      {"float offsets", st_bytes(one("{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0.0,8]}"), d8),
       "two non-negative integers"},
      {"string offsets", st_bytes(one("{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[\"0\",\"8\"]}"), d8),
       "two non-negative integers"},
      {"decreasing offsets", st_bytes("{" + entry("a", "F32", "[0]", 8, 0) + "}", d8), "decreasing"},
      {"size mismatch", st_bytes("{" + entry("a", "F32", "[2]", 0, 12) + "}", d12), "needs 8"},
      {"size mismatch empty", st_bytes("{" + entry("a", "F32", "[0,3]", 0, 4) + "}", std::string(4, 'x')),
       "needs 0"},
      {"offsets past data", st_bytes("{" + entry("a", "F32", "[4]", 0, 16) + "}", d8),
       "past the end of the data section"},
      {"offsets far past data", st_bytes("{" + entry("a", "U8", "[8]", 1ull << 62, (1ull << 62) + 8) + "}", d8),
       "past the end of the data section"},
      {"overlap", st_bytes("{" + entry("a", "F32", "[2]", 0, 8) + "," + entry("b", "F32", "[2]", 4, 12) + "}", d12),
       "overlaps tensor 'a'"},
      {"same range twice",
       st_bytes("{" + entry("a", "F32", "[2]", 0, 8) + "," + entry("b", "F32", "[2]", 0, 8) + "}", d8), "overlaps"},
      {"empty tensor inside another",
       st_bytes("{" + entry("a", "F32", "[2]", 0, 8) + "," + entry("z", "F32", "[0]", 4, 4) + "}", d8), "overlaps"},
      {"gap", st_bytes("{" + entry("a", "F32", "[1]", 0, 4) + "," + entry("b", "F32", "[1]", 8, 12) + "}", d12),
       "gap before tensor 'b'"},
      {"leading gap", st_bytes("{" + entry("a", "F32", "[1]", 4, 8) + "}", d8), "belong to no tensor"},
      {"trailing bytes", st_bytes("{" + entry("a", "F32", "[1]", 0, 4) + "}", d8), "belong to no tensor"},
      {"data without tensors", st_bytes("{}", d8), "belong to no tensor"},
      {"duplicate name",
       st_bytes("{" + entry("a", "F32", "[1]", 0, 4) + "," + entry("a", "F32", "[1]", 4, 8) + "}", d8),
       "duplicate key 'a'"},
      {"duplicate field", st_bytes(one("{\"dtype\":\"F32\",\"dtype\":\"I32\",\"shape\":[1],\"data_offsets\":[0,4]}"),
                                   std::string(4, 'x')),
       "duplicate key 'dtype'"},
      {"duplicate metadata key", st_bytes("{\"__metadata__\":{\"k\":\"1\",\"k\":\"2\"}}", ""), "duplicate key 'k'"},
      {"metadata not object", st_bytes("{\"__metadata__\":[\"a\"]}", ""), "__metadata__ must be an object"},
      {"metadata string", st_bytes("{\"__metadata__\":\"pt\"}", ""), "__metadata__ must be an object"},
      {"metadata value number", st_bytes("{\"__metadata__\":{\"step\":42}}", ""), "must be a string"},
      {"metadata value nested", st_bytes("{\"__metadata__\":{\"a\":{\"b\":\"c\"}}}", ""), "must be a string"},
      {"nested shape", st_bytes("{" + entry("a", "F32", "[[1]]", 0, 4) + "}", std::string(4, 'x')),
       "nested deeper"},
      {"deep nesting", st_bytes(std::string(100000, '['), ""), "nested deeper"},
      {"deep nesting objects", st_bytes([] {
                                          std::string s;
                                          for (int i = 0; i < 50000; ++i) s += "{\"a\":";
                                          return s;
                                        }(),
                                        ""),
       "nested deeper"},
      {"five dims", st_bytes("{" + entry("a", "U8", "[1,1,1,1,2]", 0, 2) + "}", "xy"), "5 dimensions"},
  };
  return v;
}

TEST_F(SafeTensorsTest, CorruptFilesGiveClearErrors) {
  for (const BadFile& b : bad_files()) {
    SCOPED_TRACE(b.label);
    SafeTensorsReader r;
    Status st = open_bytes(b.bytes, &r);
    ASSERT_FALSE(st.is_ok());
    EXPECT_TRUE(st.code() == Status::Code::kCorrupt || st.code() == Status::Code::kUnsupported) << st.to_string();
    EXPECT_TRUE(contains(st.message(), b.word)) << "want '" << b.word << "' in: " << st.message();
    EXPECT_TRUE(contains(st.message(), path("t.safetensors"))) << st.message();
    EXPECT_LT(st.message().size(), 1000u);  // bounded, even for huge garbage
    for (char c : st.message()) EXPECT_GE(static_cast<unsigned char>(c), 0x20) << st.message();
  }
}

TEST_F(SafeTensorsTest, EdgeCasesThatAreValid) {
  SafeTensorsReader r;
  // Empty object, padded; unknown extra fields ignored; empty tensors at the
  // boundaries; 0-d scalar.
  std::vector<std::string> ok = {
      st_bytes("{}", ""),
      st_bytes("{}      ", ""),
      st_bytes("  {\"__metadata__\":{}}  ", ""),
      st_bytes("{\"a\":{\"dtype\":\"F32\",\"shape\":[],\"data_offsets\":[0,4],\"extra\":[1,2]}}", "abcd"),
      st_bytes("{" + entry("z", "F32", "[0]", 0, 0) + "," + entry("a", "I64", "[1]", 0, 8) + "," +
                   entry("y", "BF16", "[0,7]", 8, 8) + "}",
               std::string(8, 'q')),
      st_bytes("{" + entry("big0", "F64", "[0,9223372036854775807]", 0, 0) + "}", ""),
  };
  for (size_t i = 0; i < ok.size(); ++i) {
    Status st = open_bytes(ok[i], &r);
    EXPECT_TRUE(st.is_ok()) << i << ": " << st.to_string();
    read_all(r);
  }
  ASSERT_TRUE(open_bytes(ok[4], &r).is_ok());
  ASSERT_EQ(r.tensors().size(), 3u);
  EXPECT_EQ(r.tensors()[0].name, "z");  // sorted by (begin, end)
  EXPECT_EQ(r.tensors()[1].name, "a");
  EXPECT_EQ(r.tensors()[2].name, "y");
}

// A small valid file with every layout feature: metadata, several dtypes, an
// empty tensor, a 4-D tensor.
std::string small_valid_file(const std::string& p) {
  OwnedTensor a(DType::kF64, {2});
  OwnedTensor b(DType::kF32, {1, 2, 1, 2});
  OwnedTensor e(DType::kF32, {0});
  OwnedTensor c(DType::kBF16, {3});
  testing::fill_uniform(a, 21);
  testing::fill_uniform(b, 22);
  testing::fill_uniform(c, 23);
  Status st = safetensors_write(p, {{"a", a}, {"b", b}, {"e", e}, {"c", c}}, {{"k", "v"}});
  EXPECT_TRUE(st.is_ok()) << st.to_string();
  std::string s;
  EXPECT_TRUE(read_file(p, &s).is_ok());
  return s;
}

TEST_F(SafeTensorsTest, TruncationAtEveryByteFails) {
  const std::string full = small_valid_file(path("full.safetensors"));
  ASSERT_GT(full.size(), 100u);
  SafeTensorsReader r;
  ASSERT_TRUE(open_bytes(full, &r).is_ok());
  for (size_t len = 0; len < full.size(); ++len) {
    Status st = open_bytes(full.substr(0, len), &r);
    EXPECT_FALSE(st.is_ok()) << "prefix of " << len << " bytes opened";
    EXPECT_EQ(st.code(), Status::Code::kCorrupt) << st.to_string();
  }
  // Extra bytes at the end are rejected too.
  EXPECT_FALSE(open_bytes(full + "x", &r).is_ok());
}

TEST_F(SafeTensorsTest, RandomHeaderCorruptionNeverCrashes) {
  const std::string full = small_valid_file(path("full.safetensors"));
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= static_cast<uint64_t>(static_cast<uint8_t>(full[i])) << (8 * i);
  std::mt19937_64 rng(12345);
  const std::string interesting = "{}[]\",:0123456789-.eE \\u\xff";
  int opened = 0;
  for (int iter = 0; iter < 600; ++iter) {
    std::string bytes = full;
    int flips = 1 + static_cast<int>(rng() % 4);
    for (int k = 0; k < flips; ++k) {
      // Mostly the JSON, sometimes the length field; bytes that matter to JSON
      // half of the time, random bytes otherwise.
      size_t pos = (rng() % 10 == 0) ? rng() % 8 : 8 + rng() % n;
      bytes[pos] = (rng() % 2) ? interesting[rng() % interesting.size()] : static_cast<char>(rng());
    }
    SafeTensorsReader r;
    Status st = open_bytes(bytes, &r);
    if (st.is_ok()) {
      ++opened;
      read_all(r);
    } else {
      EXPECT_FALSE(st.message().empty());
    }
  }
  // Most flips must be caught (a few land harmlessly, e.g. in metadata text).
  EXPECT_LT(opened, 300);
}

TEST_F(SafeTensorsTest, RandomBytesNeverCrash) {
  std::mt19937_64 rng(777);
  for (int iter = 0; iter < 300; ++iter) {
    size_t len = rng() % 64;
    std::string bytes(len, '\0');
    for (char& c : bytes) c = static_cast<char>(rng());
    if (len >= 8 && rng() % 2) {  // a plausible length field, to reach the parser
      uint64_t n = rng() % (len - 7);
      std::string l = le64(n);
      bytes.replace(0, 8, l);
    }
    SafeTensorsReader r;
    Status st = open_bytes(bytes, &r);
    if (st.is_ok()) read_all(r);
  }
}

}  // namespace
}  // namespace laplace
