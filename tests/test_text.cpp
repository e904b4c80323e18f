// Tests for text/: tokenizer, token shards, data loader, data preparation.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "core/file_util.h"
#include "tests/test_util.h"
#include "text/data_loader.h"
#include "text/prepare.h"
#include "text/shard.h"
#include "text/tokenizer.h"

namespace laplace {
namespace {

namespace fs = std::filesystem;

// Removes a temp dir at scope exit.
struct TempDir {
  std::string path;
  explicit TempDir(const std::string& tag) : path(testing::make_temp_dir(tag)) {}
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
  std::string file(const std::string& name) const { return (fs::path(path) / name).string(); }
};

void write_text(const std::string& path, const std::string& text) {
  std::ofstream f(path, std::ios::binary);
  f << text;
}

std::string slurp(const std::string& path) {
  std::string s;
  Status st = read_file(path, &s);
  EXPECT_TRUE(st.is_ok()) << st.to_string();
  return s;
}

// A deterministic toy corpus: a few hundred lines of English-like words.
std::string make_corpus(uint32_t seed, int lines) {
  static const char* kWords[] = {"the",   "quick", "brown", "fox",  "jumps", "over",   "lazy",  "dog",
                                 "and",   "a",     "cat",   "runs", "away",  "from",   "home",  "into",
                                 "green", "woods", "while", "some", "birds", "sing",   "very",  "loudly",
                                 "at",    "dawn",  "then",  "it",   "rains", "softly", "on",    "roofs"};
  std::mt19937 rng(seed);
  std::string out;
  for (int i = 0; i < lines; ++i) {
    const int n = 4 + static_cast<int>(rng() % 12);
    for (int j = 0; j < n; ++j) {
      out += kWords[rng() % (sizeof(kWords) / sizeof(kWords[0]))];
      out += j + 1 < n ? (rng() % 9 == 0 ? ", " : " ") : ".\n";
    }
  }
  return out;
}

// One tokenizer (vocab 300) trained once and shared by the tests.
const std::string& shared_model() {
  static TempDir dir("tok_shared");  // removed at exit
  static std::string model = [] {
    write_text(dir.file("corpus.txt"), make_corpus(7, 400));
    TokenizerTrainOptions o;
    o.inputs = {dir.file("corpus.txt")};
    o.model_prefix = dir.file("tok");
    o.vocab_size = 300;
    Status st = tokenizer_train(o);
    EXPECT_TRUE(st.is_ok()) << st.to_string();
    return dir.file("tok.model");
  }();
  return model;
}

Tokenizer load_shared() {
  Tokenizer t;
  Status st = Tokenizer::load(shared_model(), &t);
  EXPECT_TRUE(st.is_ok()) << st.to_string();
  return t;
}

bool contains(const Status& st, const std::string& needle) {
  return st.message().find(needle) != std::string::npos;
}

// ------------------------------------------------------------------ Tokenizer

TEST(Tokenizer, TrainLoadAndSpecialIds) {
  Tokenizer t = load_shared();
  EXPECT_EQ(t.vocab_size(), 300);
  EXPECT_EQ(t.unk_id(), 0);
  EXPECT_EQ(t.bos_id(), 1);
  EXPECT_EQ(t.eos_id(), 2);
  EXPECT_EQ(t.pad_id(), 3);
  EXPECT_EQ(t.piece(2), "</s>");
  EXPECT_EQ(t.piece(4), "<0x00>");
  EXPECT_EQ(t.piece(259), "<0xFF>");
  EXPECT_EQ(t.piece(-1), "");
  EXPECT_EQ(t.piece(300), "");
  EXPECT_EQ(t.piece_to_id("</s>"), 2);
  EXPECT_TRUE(fs::exists(shared_model().substr(0, shared_model().size() - 6) + ".vocab"));
  // Frequent words are compressed below one token per byte.
  std::vector<int32_t> ids;
  ASSERT_TRUE(t.encode("the quick brown fox jumps over the lazy dog", &ids).is_ok());
  EXPECT_LT(ids.size(), 43u);
}

TEST(Tokenizer, RoundTripAsciiAndUtf8) {
  Tokenizer t = load_shared();
  const std::vector<std::string> texts = {
      "the quick brown fox jumps over the lazy dog.",
      "",
      "  leading and trailing spaces  ",
      "tabs\tand\nnew\n\nlines\r\n and   runs of   spaces",
      "Digits 0123456789 and PUNCT!? {}[]<>~`@#$%^&*()_+=|\\/",
      "héllo wörld, naïve café — 日本語のテキスト, 한국어, Ελληνικά, emoji 🙂🚀",
      "</s> <s> <unk> look like specials but are text",
  };
  for (const std::string& s : texts) {
    std::vector<int32_t> ids;
    ASSERT_TRUE(t.encode(s, &ids).is_ok());
    for (int32_t id : ids) {
      ASSERT_GE(id, 0);
      ASSERT_LT(id, 300);
      ASSERT_NE(id, t.unk_id()) << "byte fallback should avoid <unk>";
      ASSERT_NE(id, t.eos_id());
    }
    std::string back;
    ASSERT_TRUE(t.decode(ids, &back).is_ok());
    EXPECT_EQ(back, s);
  }
}

// Byte fallback end to end: any byte string, broken UTF-8, NULs and a literal U+2581
// included, comes back byte for byte through decode_bytes.
TEST(Tokenizer, AnyByteStringRoundTripsThroughDecodeBytes) {
  Tokenizer t = load_shared();
  std::vector<std::string> texts = {
      std::string("nul\0inside", 10),
      "\xff\xfe invalid lead bytes \x80\xbf",
      "truncated \xe6\x97",                  // a 3-byte sequence cut short at the end
      "\xed\xa0\x80 surrogate, \xc0\xaf overlong, \xf4\x90\x80\x80 past U+10FFFF",
      "literal \xe2\x96\x81 marker \xe2\x96\x81\xe2\x96\x81 twice",
      "plain text stays one SentencePiece call",
  };
  uint64_t s = 42;
  for (int n : {1, 2, 7, 64, 1000}) {  // random bytes of several lengths
    std::string r(n, '\0');
    for (char& c : r) {
      s = s * 6364136223846793005ULL + 1442695040888963407ULL;
      c = static_cast<char>(s >> 56);
    }
    texts.push_back(r);
  }
  for (const std::string& text : texts) {
    std::vector<int32_t> ids;
    ASSERT_TRUE(t.encode(text, &ids).is_ok());
    for (int32_t id : ids) ASSERT_NE(id, t.unk_id());
    std::string back;
    ASSERT_TRUE(t.decode_bytes(ids, &back).is_ok());
    EXPECT_EQ(back, text);
    // The text decoder still gives well-formed UTF-8 (U+FFFD for broken sequences).
    std::string shown;
    ASSERT_TRUE(t.decode(ids, &shown).is_ok());
    std::vector<int32_t> again;
    ASSERT_TRUE(t.encode(shown, &again).is_ok());
    std::string shown_back;
    ASSERT_TRUE(t.decode_bytes(again, &shown_back).is_ok());
    EXPECT_EQ(shown_back, shown);
  }
  // A literal U+2581 now survives the text decoder too (it used to come back as a space).
  std::vector<int32_t> ids;
  ASSERT_TRUE(t.encode("a\xe2\x96\x81" "b", &ids).is_ok());
  std::string back;
  ASSERT_TRUE(t.decode(ids, &back).is_ok());
  EXPECT_EQ(back, "a\xe2\x96\x81" "b");
  // Out-of-range ids are refused by decode_bytes as by decode.
  EXPECT_FALSE(t.decode_bytes({0, 1 << 20}, &back).is_ok());
}

TEST(Tokenizer, DecodeOutOfRangeIsAnError) {
  Tokenizer t = load_shared();
  std::string out;
  Status st = t.decode({5, 6, 300}, &out);
  EXPECT_FALSE(st.is_ok());
  EXPECT_TRUE(contains(st, "out of range")) << st.to_string();
  EXPECT_TRUE(contains(st, "position 2")) << st.to_string();
  EXPECT_FALSE(t.decode({-1}, &out).is_ok());
  Tokenizer empty;
  EXPECT_FALSE(empty.decode({1}, &out).is_ok());
  std::vector<int32_t> ids;
  EXPECT_FALSE(empty.encode("x", &ids).is_ok());
}

TEST(Tokenizer, TrainingIsDeterministic) {
  TempDir d("tok_det");
  write_text(d.file("a.txt"), make_corpus(11, 300));
  fs::create_directories(d.file("one"));
  fs::create_directories(d.file("two"));
  TokenizerTrainOptions o;
  o.inputs = {d.file("a.txt")};
  o.vocab_size = 300;
  o.model_prefix = d.file("one/m");
  ASSERT_TRUE(tokenizer_train(o).is_ok());
  o.model_prefix = d.file("two/other_name");
  ASSERT_TRUE(tokenizer_train(o).is_ok());
  EXPECT_EQ(slurp(d.file("one/m.model")), slurp(d.file("two/other_name.model")));
  EXPECT_EQ(slurp(d.file("one/m.vocab")), slurp(d.file("two/other_name.vocab")));
}

TEST(Tokenizer, UserDefinedSymbolsAndJsonlInput) {
  TempDir d("tok_uds");
  std::string jsonl;
  const std::string corpus = make_corpus(5, 200);
  size_t pos = 0;
  while (pos < corpus.size()) {  // two lines per JSON object
    size_t e = corpus.find('\n', corpus.find('\n', pos) + 1);
    if (e == std::string::npos) e = corpus.size();
    std::string text = corpus.substr(pos, e - pos);
    jsonl += "{\"text\": \"";
    for (char c : text) jsonl += c == '\n' ? std::string("\\n") : std::string(1, c);
    jsonl += "\", \"id\": 1}\n";
    pos = e + 1;
  }
  write_text(d.file("c.jsonl"), jsonl);
  TokenizerTrainOptions o;
  o.inputs = {d.file("c.jsonl")};
  o.vocab_size = 300;
  o.model_prefix = d.file("u");
  o.user_defined_symbols = {"<|user|>", "<|assistant|>"};
  Status st = tokenizer_train(o);
  ASSERT_TRUE(st.is_ok()) << st.to_string();
  Tokenizer t;
  ASSERT_TRUE(Tokenizer::load(d.file("u.model"), &t).is_ok());
  EXPECT_EQ(t.piece_to_id("<|user|>"), 4);
  EXPECT_EQ(t.piece_to_id("<|assistant|>"), 5);
  EXPECT_EQ(t.piece(6), "<0x00>");
  std::vector<int32_t> ids;
  ASSERT_TRUE(t.encode("<|user|>the dog<|assistant|>", &ids).is_ok());
  ASSERT_GE(ids.size(), 3u);
  EXPECT_EQ(ids.front(), 4);
  EXPECT_EQ(ids.back(), 5);
  std::string back;
  ASSERT_TRUE(t.decode(ids, &back).is_ok());
  EXPECT_EQ(back, "<|user|>the dog<|assistant|>");

  // A broken JSONL line names file:line.
  write_text(d.file("bad.jsonl"), "{\"text\": \"a b c\"}\n{\"text\": 5}\n");
  o.inputs = {d.file("bad.jsonl")};
  o.model_prefix = d.file("bad");
  st = tokenizer_train(o);
  EXPECT_FALSE(st.is_ok());
  EXPECT_TRUE(contains(st, "bad.jsonl:2")) << st.to_string();
}

TEST(Tokenizer, TrainErrors) {
  TempDir d("tok_err");
  TokenizerTrainOptions o;
  o.inputs = {d.file("missing.txt")};
  o.model_prefix = d.file("m");
  o.vocab_size = 300;
  Status st = tokenizer_train(o);
  EXPECT_EQ(st.code(), Status::Code::kNotFound) << st.to_string();
  write_text(d.file("a.txt"), make_corpus(1, 50));
  o.inputs = {d.file("a.txt")};
  o.vocab_size = 100;
  st = tokenizer_train(o);
  EXPECT_EQ(st.code(), Status::Code::kInvalidArgument) << st.to_string();
  EXPECT_TRUE(contains(st, "too small")) << st.to_string();
  EXPECT_FALSE(fs::exists(d.file("m.model")));
}

TEST(Tokenizer, BadModelFilesAreErrors) {
  TempDir d("tok_bad");
  Tokenizer t;
  Status st = Tokenizer::load(d.file("missing.model"), &t);
  EXPECT_EQ(st.code(), Status::Code::kNotFound) << st.to_string();
  EXPECT_TRUE(contains(st, "missing.model")) << st.to_string();

  write_text(d.file("empty.model"), "");
  st = Tokenizer::load(d.file("empty.model"), &t);
  EXPECT_EQ(st.code(), Status::Code::kCorrupt) << st.to_string();
  EXPECT_TRUE(contains(st, "empty")) << st.to_string();

  std::mt19937 rng(42);
  for (size_t n : {1u, 7u, 100u, 4096u}) {
    std::string junk(n, '\0');
    for (char& c : junk) c = static_cast<char>(rng());
    write_text(d.file("random.model"), junk);
    st = Tokenizer::load(d.file("random.model"), &t);
    EXPECT_EQ(st.code(), Status::Code::kCorrupt) << n << ": " << st.to_string();
    EXPECT_TRUE(contains(st, "not a valid SentencePiece model")) << st.to_string();
  }

  const std::string good = slurp(shared_model());
  for (size_t cut : {size_t{1}, size_t{10}, good.size() / 3, good.size() / 2, good.size() - 1}) {
    write_text(d.file("trunc.model"), good.substr(0, cut));
    st = Tokenizer::load(d.file("trunc.model"), &t);
    EXPECT_EQ(st.code(), Status::Code::kCorrupt) << cut << ": " << st.to_string();
  }
  EXPECT_FALSE(t.is_loaded());  // never replaced on failure
}

// ------------------------------------------------------------------ Shard

std::vector<uint32_t> random_tokens(int64_t n, uint32_t bound, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<uint32_t> v(static_cast<size_t>(n));
  for (auto& x : v) x = rng() % bound;
  return v;
}

void check_round_trip(const std::string& path, const std::vector<uint32_t>& toks, int64_t vocab, int32_t version) {
  ASSERT_TRUE(shard_write(path, toks, vocab).is_ok());
  const int64_t bytes = version == 1 ? 2 : 4;
  EXPECT_EQ(static_cast<int64_t>(fs::file_size(path)), 1024 + bytes * static_cast<int64_t>(toks.size()));
  ShardReader r;
  Status st = ShardReader::open(path, vocab, &r);
  ASSERT_TRUE(st.is_ok()) << st.to_string();
  EXPECT_EQ(r.version(), version);
  ASSERT_EQ(r.size(), static_cast<int64_t>(toks.size()));
  for (size_t i = 0; i < toks.size(); ++i) ASSERT_EQ(r.token(static_cast<int64_t>(i)), toks[i]);
  if (toks.size() >= 20) {
    std::vector<int32_t> buf(13);
    r.read(5, 13, buf.data());
    for (int i = 0; i < 13; ++i) EXPECT_EQ(static_cast<uint32_t>(buf[i]), toks[5 + i]);
  }
}

TEST(Shard, RoundTripV1) {
  TempDir d("shard_v1");
  check_round_trip(d.file("a.bin"), random_tokens(5000, 1000, 1), 1000, 1);
  check_round_trip(d.file("b.bin"), random_tokens(100, 65536, 2), 65536, 1);  // 65535 still fits uint16
  check_round_trip(d.file("empty.bin"), {}, 300, 1);
}

TEST(Shard, RoundTripV2) {
  TempDir d("shard_v2");
  std::vector<uint32_t> toks = random_tokens(3000, 100000, 3);
  toks[17] = 99999;
  toks[18] = 65536;
  check_round_trip(d.file("a.bin"), toks, 100000, 2);
  EXPECT_EQ(shard_version_for_vocab(65536), 1);
  EXPECT_EQ(shard_version_for_vocab(65537), 2);
}

// A shard byte-for-byte as llm.c's write_datafile makes it (GPT-2, vocab 50257).
TEST(Shard, ReadsLlmcGpt2Shards) {
  TempDir d("shard_llmc");
  std::vector<int32_t> header(256, 0);
  header[0] = 20240520;
  header[1] = 1;
  std::vector<uint16_t> toks = {50256, 15496, 11, 995, 0, 50256, 40, 716};
  header[2] = static_cast<int32_t>(toks.size());
  std::string bytes(reinterpret_cast<const char*>(header.data()), 1024);
  bytes.append(reinterpret_cast<const char*>(toks.data()), toks.size() * 2);
  write_text(d.file("fineweb_val_000000.bin"), bytes);
  ShardReader r;
  Status st = ShardReader::open(d.file("fineweb_val_000000.bin"), 50257, &r);
  ASSERT_TRUE(st.is_ok()) << st.to_string();
  ASSERT_EQ(r.size(), 8);
  EXPECT_EQ(r.token(0), 50256u);
  EXPECT_EQ(r.token(7), 716u);
  // GPT-2 shards are rejected against a smaller vocabulary, naming the token.
  st = ShardReader::open(d.file("fineweb_val_000000.bin"), 50000, &r);
  EXPECT_FALSE(st.is_ok());
  EXPECT_TRUE(contains(st, "token 50256 at position 0")) << st.to_string();

  // llm.c's Llama-3 shards: magic 20240801, version 7, uint32 tokens.
  header[0] = 20240801;
  header[1] = 7;
  std::vector<uint32_t> big = {128000, 9906, 1917, 128001};
  header[2] = static_cast<int32_t>(big.size());
  std::string b3(reinterpret_cast<const char*>(header.data()), 1024);
  b3.append(reinterpret_cast<const char*>(big.data()), big.size() * 4);
  write_text(d.file("llama3.bin"), b3);
  st = ShardReader::open(d.file("llama3.bin"), 128256, &r);
  ASSERT_TRUE(st.is_ok()) << st.to_string();
  EXPECT_EQ(r.version(), 7);
  EXPECT_EQ(r.token(0), 128000u);
  EXPECT_EQ(r.token(3), 128001u);
}

TEST(Shard, CorruptShardsAreErrors) {
  TempDir d("shard_bad");
  const std::string good_path = d.file("good.bin");
  ASSERT_TRUE(shard_write(good_path, random_tokens(100, 500, 4), 500).is_ok());
  const std::string good = slurp(good_path);
  auto open_bytes = [&](const std::string& bytes, int64_t vocab = 500) {
    write_text(d.file("x.bin"), bytes);
    ShardReader r;
    return ShardReader::open(d.file("x.bin"), vocab, &r);
  };
  auto set_int = [](std::string s, int idx, int32_t v) {
    std::memcpy(&s[static_cast<size_t>(idx) * 4], &v, 4);
    return s;
  };

  Status st = open_bytes(set_int(good, 0, 12345));
  EXPECT_EQ(st.code(), Status::Code::kCorrupt);
  EXPECT_TRUE(contains(st, "magic")) << st.to_string();

  st = open_bytes(set_int(good, 1, 3));
  EXPECT_TRUE(contains(st, "version 3")) << st.to_string();

  st = open_bytes(good.substr(0, good.size() - 2));
  EXPECT_TRUE(contains(st, "truncated")) << st.to_string();
  EXPECT_TRUE(contains(st, std::to_string(good.size() - 2))) << st.to_string();
  EXPECT_TRUE(contains(st, std::to_string(good.size()))) << st.to_string();

  st = open_bytes(good + "xx");
  EXPECT_TRUE(contains(st, "too long")) << st.to_string();
  EXPECT_TRUE(contains(st, std::to_string(good.size() + 2))) << st.to_string();

  st = open_bytes(good.substr(0, 100));
  EXPECT_TRUE(contains(st, "header")) << st.to_string();

  st = open_bytes(set_int(good, 9, 1));
  EXPECT_TRUE(contains(st, "header int 9")) << st.to_string();

  // The high count word: header[3] = 1 means 2^32 more tokens.
  st = open_bytes(set_int(good, 3, 1));
  EXPECT_TRUE(contains(st, std::to_string(1024 + 2 * ((int64_t{1} << 32) + 100)))) << st.to_string();

  std::string bad_tok = good;
  const uint16_t v = 500;
  std::memcpy(&bad_tok[1024 + 2 * 37], &v, 2);
  st = open_bytes(bad_tok);
  EXPECT_EQ(st.code(), Status::Code::kCorrupt);
  EXPECT_TRUE(contains(st, "token 500 at position 37")) << st.to_string();
  EXPECT_TRUE(contains(st, "vocab_size 500")) << st.to_string();
  EXPECT_TRUE(open_bytes(bad_tok, 0).is_ok());  // no vocab bound: not checked
  EXPECT_TRUE(open_bytes(bad_tok, 501).is_ok());

  ShardReader r;
  st = ShardReader::open(d.file("nope.bin"), 0, &r);
  EXPECT_EQ(st.code(), Status::Code::kNotFound) << st.to_string();

  // Writing refuses out-of-vocab tokens and leaves no file.
  st = shard_write(d.file("w.bin"), {1, 2, 700}, 500);
  EXPECT_TRUE(contains(st, "700 at position 2")) << st.to_string();
  EXPECT_FALSE(fs::exists(d.file("w.bin")));
}

// ------------------------------------------------------------------ DataLoader

// Shard i holds tokens base_i, base_i + 1, ... so every token names its place.
struct ShardSet {
  TempDir dir{"loader"};
  std::vector<std::string> paths;
  std::vector<std::vector<uint32_t>> tokens;
  ShardSet(const std::vector<int64_t>& sizes) {
    for (size_t s = 0; s < sizes.size(); ++s) {
      std::vector<uint32_t> t(static_cast<size_t>(sizes[s]));
      for (int64_t i = 0; i < sizes[s]; ++i) t[i] = static_cast<uint32_t>(1000 * (s + 1) + i);
      char name[32];
      std::snprintf(name, sizeof(name), "train_%06zu.bin", s);
      paths.push_back(dir.file(name));
      EXPECT_TRUE(shard_write(paths.back(), t, 10000).is_ok());
      tokens.push_back(std::move(t));
    }
  }
};

DataLoader open_loader(const std::vector<std::string>& shards, int64_t B, int64_t T, bool shuffle, uint64_t seed,
                       int rank = 0, int world = 1) {
  DataLoaderOptions o;
  o.shards = shards;
  o.batch_size = B;
  o.seq_len = T;
  o.shuffle = shuffle;
  o.seed = seed;
  o.rank = rank;
  o.world = world;
  o.vocab_size = 10000;
  DataLoader dl;
  Status st = DataLoader::open(o, &dl);
  EXPECT_TRUE(st.is_ok()) << st.to_string();
  return dl;
}

struct Batch {
  std::vector<int32_t> x, y;
  bool operator==(const Batch&) const = default;
};

std::vector<Batch> take(DataLoader& dl, int n) {
  std::vector<Batch> out(static_cast<size_t>(n));
  for (auto& b : out) dl.next(&b.x, &b.y);
  return out;
}

// train_gpt2.py's DistributedDataLoader with one process, transcribed literally.
// (With several processes train_gpt2.py tests the shard end against each
// rank's own offset, so ranks can switch shards at different steps; we follow
// llm.c's C loader instead, where all ranks share one global position.)
struct ReferenceLoader {
  const std::vector<std::vector<uint32_t>>& shards;
  int64_t B, T;
  int64_t shard = 0, pos = 0;
  ReferenceLoader(const std::vector<std::vector<uint32_t>>& s, int64_t b, int64_t t) : shards(s), B(b), T(t) {}
  Batch next() {
    const auto& tok = shards[shard];
    Batch out;
    for (int64_t i = 0; i < B * T; ++i) {
      out.x.push_back(static_cast<int32_t>(tok.at(pos + i)));
      out.y.push_back(static_cast<int32_t>(tok.at(pos + i + 1)));
    }
    pos += B * T;
    if (pos + (B * T + 1) > static_cast<int64_t>(tok.size())) {
      shard = (shard + 1) % static_cast<int64_t>(shards.size());
      pos = 0;
    }
    return out;
  }
};

TEST(DataLoader, SequentialExactWindowsWithWrap) {
  ShardSet set({30, 20});  // B*T = 8: shard 0 gives p = 0, 8, 16; shard 1 gives p = 0, 8
  DataLoader dl = open_loader(set.paths, 2, 4, false, 0);
  std::vector<std::pair<int, int>> expect = {{0, 0}, {0, 8}, {0, 16}, {1, 0}, {1, 8}, {0, 0}, {0, 8}};
  for (size_t k = 0; k < expect.size(); ++k) {
    Batch b;
    dl.next(&b.x, &b.y);
    const int32_t base = 1000 * (expect[k].first + 1) + expect[k].second;
    for (int i = 0; i < 8; ++i) {
      ASSERT_EQ(b.x[i], base + i) << "batch " << k;
      ASSERT_EQ(b.y[i], base + i + 1) << "batch " << k;
    }
  }
  EXPECT_EQ(dl.position().epoch, 1);
  EXPECT_EQ(dl.position().shard, 0);
  EXPECT_EQ(dl.position().window, 2);
  EXPECT_EQ(dl.batches_per_epoch(), 5);

  // Same as the PyTorch reference over several epochs. With 3 ranks of B = 2,
  // rank r's batch is rows r*B .. r*B + B - 1 of the reference's batch with B = 6.
  for (int world : {1, 3}) {
    ShardSet s2({61, 47, 100});
    for (int rank = 0; rank < world; ++rank) {
      DataLoader l = open_loader(s2.paths, 2, 3, false, 0, rank, world);
      ReferenceLoader ref(s2.tokens, 2 * world, 3);
      for (int k = 0; k < 40; ++k) {
        Batch b;
        l.next(&b.x, &b.y);
        Batch g = ref.next();
        const auto lo = static_cast<ptrdiff_t>(rank * 6), hi = lo + 6;
        ASSERT_EQ(b.x, std::vector<int32_t>(g.x.begin() + lo, g.x.begin() + hi))
            << "world " << world << " rank " << rank << " batch " << k;
        ASSERT_EQ(b.y, std::vector<int32_t>(g.y.begin() + lo, g.y.begin() + hi));
      }
    }
  }
}

TEST(DataLoader, ShuffledIsDeterministicAndCoversEveryWindow) {
  ShardSet set({53, 41, 5, 77});  // shard 2 has no full window of T+1 = 9 tokens
  const int64_t T = 8;
  DataLoader a = open_loader(set.paths, 3, T, true, 17);
  DataLoader b = open_loader(set.paths, 3, T, true, 17);
  DataLoader c = open_loader(set.paths, 3, T, true, 18);
  auto ba = take(a, 25), bb = take(b, 25), bc = take(c, 25);
  EXPECT_EQ(ba, bb);
  EXPECT_NE(ba, bc);

  // One epoch with B = 1 visits every window (start k*T, no shard crossing) exactly once.
  const int64_t windows = (52 / 8) + (40 / 8) + 0 + (76 / 8);
  DataLoader one = open_loader(set.paths, 1, T, true, 5);
  std::set<int32_t> starts;
  for (int64_t k = 0; k < windows; ++k) {
    EXPECT_EQ(one.position().epoch, 0);
    Batch bt;
    one.next(&bt.x, &bt.y);
    const int32_t s0 = bt.x[0];
    const int shard = s0 / 1000 - 1;
    const int32_t off = s0 % 1000;
    EXPECT_EQ(off % T, 0);
    EXPECT_LE(off + T + 1, static_cast<int32_t>(set.tokens[shard].size()));
    for (int t = 0; t < T; ++t) {
      EXPECT_EQ(bt.x[t], s0 + t);
      EXPECT_EQ(bt.y[t], s0 + t + 1);
    }
    starts.insert(s0);
  }
  EXPECT_EQ(static_cast<int64_t>(starts.size()), windows);
  EXPECT_EQ(one.position().epoch, 1);
  // The next epoch is a different order of the same windows.
  std::vector<int32_t> e1;
  for (int64_t k = 0; k < windows; ++k) {
    Batch bt;
    one.next(&bt.x, &bt.y);
    e1.push_back(bt.x[0]);
  }
  EXPECT_EQ(std::set<int32_t>(e1.begin(), e1.end()), starts);
}

TEST(DataLoader, RankSplitMatchesOneBigRank) {
  ShardSet set({97, 64, 130});
  const int P = 3;
  const int64_t B = 2, T = 5;
  for (bool shuffle : {false, true}) {
    DataLoader big = open_loader(set.paths, P * B, T, shuffle, 9);
    std::vector<DataLoader> ranks;
    for (int r = 0; r < P; ++r) ranks.push_back(open_loader(set.paths, B, T, shuffle, 9, r, P));
    for (int step = 0; step < 30; ++step) {
      Batch g;
      big.next(&g.x, &g.y);
      for (int r = 0; r < P; ++r) {
        Batch b;
        ranks[r].next(&b.x, &b.y);
        const auto lo = static_cast<ptrdiff_t>(r * B * T), hi = static_cast<ptrdiff_t>((r + 1) * B * T);
        ASSERT_EQ(b.x, std::vector<int32_t>(g.x.begin() + lo, g.x.begin() + hi))
            << (shuffle ? "shuffled" : "sequential") << " step " << step << " rank " << r;
        ASSERT_EQ(b.y, std::vector<int32_t>(g.y.begin() + lo, g.y.begin() + hi));
        EXPECT_EQ(ranks[r].position(), big.position());
      }
    }
  }
}

TEST(DataLoader, SeekResumesExactly) {
  ShardSet set({97, 64, 130});
  for (bool shuffle : {false, true}) {
    for (int rank : {0, 1}) {
      DataLoader a = open_loader(set.paths, 2, 4, shuffle, 123, rank, 2);
      take(a, 13);
      const std::string saved = a.position().to_json();
      auto expect = take(a, 40);

      LoaderPosition pos;
      Status st = LoaderPosition::from_json(saved, &pos);
      ASSERT_TRUE(st.is_ok()) << st.to_string();
      EXPECT_EQ(pos.to_json(), saved);
      DataLoader b = open_loader(set.paths, 2, 4, shuffle, 123, rank, 2);
      ASSERT_TRUE(b.seek(pos).is_ok());
      EXPECT_EQ(take(b, 40), expect) << (shuffle ? "shuffled" : "sequential") << " rank " << rank;
      b.reset();
      DataLoader fresh = open_loader(set.paths, 2, 4, shuffle, 123, rank, 2);
      EXPECT_EQ(take(b, 5), take(fresh, 5));
    }
  }
  // Mismatches are refused with a reason.
  DataLoader s = open_loader(set.paths, 2, 4, true, 1);
  LoaderPosition p = s.position();
  DataLoader other_seed = open_loader(set.paths, 2, 4, true, 2);
  Status st = other_seed.seek(p);
  EXPECT_TRUE(contains(st, "seed")) << st.to_string();
  DataLoader seq = open_loader(set.paths, 2, 4, false, 1);
  st = seq.seek(p);
  EXPECT_TRUE(contains(st, "shuffled")) << st.to_string();
  DataLoader other_T = open_loader(set.paths, 2, 5, true, 1);
  st = other_T.seek(p);
  EXPECT_TRUE(contains(st, "seq_len")) << st.to_string();
  p.window = 1000000;
  st = s.seek(p);
  EXPECT_FALSE(st.is_ok());
  EXPECT_FALSE(LoaderPosition::from_json("{\"epoch\": 1}", &p).is_ok());
  EXPECT_FALSE(LoaderPosition::from_json("not json", &p).is_ok());
}

TEST(DataLoader, OpenErrorsAndGlobs) {
  ShardSet set({40, 12});
  DataLoaderOptions o;
  o.shards = {(fs::path(set.dir.path) / "train_*.bin").string()};
  o.batch_size = 2;
  o.seq_len = 4;
  DataLoader dl;
  Status st = DataLoader::open(o, &dl);
  EXPECT_TRUE(st.is_ok()) << st.to_string();  // both shards hold >= B*T + 1 = 9 tokens
  o.batch_size = 3;                            // B*T + 1 = 13 > 12
  st = DataLoader::open(o, &dl);
  EXPECT_EQ(st.code(), Status::Code::kInvalidArgument);
  EXPECT_TRUE(contains(st, "train_000001.bin")) << st.to_string();
  EXPECT_TRUE(contains(st, "at least")) << st.to_string();
  o.shuffle = true;  // shuffled mode only needs one window somewhere
  st = DataLoader::open(o, &dl);
  ASSERT_TRUE(st.is_ok()) << st.to_string();
  EXPECT_EQ(dl.shard_paths(), set.paths);
  EXPECT_EQ(dl.total_tokens(), 52);

  o.shards = {(fs::path(set.dir.path) / "val_*.bin").string()};
  st = DataLoader::open(o, &dl);
  EXPECT_EQ(st.code(), Status::Code::kNotFound) << st.to_string();
  o.shards = set.paths;
  o.vocab_size = 1500;  // shard 1 holds tokens 2000..
  st = DataLoader::open(o, &dl);
  EXPECT_TRUE(contains(st, "token 2000 at position 0")) << st.to_string();
  o.vocab_size = 0;
  o.rank = 2;
  o.world = 2;
  EXPECT_FALSE(DataLoader::open(o, &dl).is_ok());
}

// ------------------------------------------------------------------ Prepare

// Splits a token stream at the separator into documents (dropping the leading one).
std::vector<std::vector<int32_t>> split_docs(const std::vector<int32_t>& toks, int32_t sep) {
  std::vector<std::vector<int32_t>> docs;
  for (int32_t t : toks) {
    if (t == sep) docs.emplace_back();
    else docs.back().push_back(t);
  }
  return docs;
}

std::vector<int32_t> read_all(const std::vector<std::string>& files, int64_t vocab) {
  std::vector<int32_t> all;
  for (const auto& f : files) {
    ShardReader r;
    Status st = ShardReader::open(f, vocab, &r);
    EXPECT_TRUE(st.is_ok()) << st.to_string();
    std::vector<int32_t> buf(static_cast<size_t>(r.size()));
    r.read(0, r.size(), buf.data());
    all.insert(all.end(), buf.begin(), buf.end());
  }
  return all;
}

TEST(Prepare, TextAndJsonlToShards) {
  TempDir d("prepare");
  std::vector<std::string> expect_docs;
  // Whole-file documents.
  for (int i = 0; i < 3; ++i) {
    std::string doc = make_corpus(100 + i, 6);
    write_text(d.file("doc" + std::to_string(i) + ".txt"), doc + "\n");
    doc.pop_back();  // trailing newlines are trimmed
    expect_docs.push_back(doc);
  }
  // JSONL, one document per object (text kept verbatim, including UTF-8 and newlines).
  std::string jsonl;
  for (int i = 0; i < 40; ++i) {
    std::string text = "story " + std::to_string(i) + ": " + make_corpus(200 + i, 2);
    text.pop_back();
    if (i % 7 == 0) text += " café 日本";
    std::string esc;
    for (char c : text) esc += c == '\n' ? std::string("\\n") : std::string(1, c);
    jsonl += "{\"id\": " + std::to_string(i) + ", \"text\": \"" + esc + "\"}\n";
    if (i == 5) jsonl += "\n";  // blank lines are ignored
    expect_docs.push_back(text);
  }
  write_text(d.file("c.jsonl"), jsonl);

  PrepareOptions o;
  o.inputs = {d.file("doc0.txt"), d.file("doc1.txt"), d.file("doc2.txt"), d.file("c.jsonl")};
  o.tokenizer = shared_model();
  o.output_dir = d.file("out");
  o.shard_tokens = 300;
  o.val_fraction = 0.2;
  o.seed = 7;
  o.quiet = true;
  PrepareStats st;
  Status s = data_prepare(o, &st);
  ASSERT_TRUE(s.is_ok()) << s.to_string();
  EXPECT_EQ(st.documents, 43);
  EXPECT_EQ(st.train_documents + st.val_documents, 43);
  EXPECT_GT(st.val_documents, 0);
  EXPECT_GT(st.train_files.size(), 1u);
  EXPECT_EQ(st.separator_id, 2);
  EXPECT_TRUE(fs::exists(d.file("out/prepare.json")));
  EXPECT_EQ(st.train_files.front(), d.file("out/train_000000.bin"));
  EXPECT_EQ(st.val_files.front(), d.file("out/val_000000.bin"));

  Tokenizer tok = load_shared();
  // Every train shard but the last is exactly shard_tokens long.
  for (size_t i = 0; i + 1 < st.train_files.size(); ++i) {
    ShardReader r;
    ASSERT_TRUE(ShardReader::open(st.train_files[i], 300, &r).is_ok());
    EXPECT_EQ(r.size(), 300);
  }
  const auto train = read_all(st.train_files, 300);
  const auto val = read_all(st.val_files, 300);
  EXPECT_EQ(static_cast<int64_t>(train.size()), st.train_tokens);
  EXPECT_EQ(static_cast<int64_t>(val.size()), st.val_tokens);
  ASSERT_FALSE(train.empty());
  EXPECT_EQ(train.front(), 2);  // separator BEFORE each document
  EXPECT_EQ(val.front(), 2);
  auto decode_all = [&](const std::vector<int32_t>& toks) {
    std::vector<std::string> out;
    for (const auto& ids : split_docs(toks, 2)) {
      std::string s;
      EXPECT_TRUE(tok.decode(ids, &s).is_ok());
      out.push_back(s);
    }
    return out;
  };
  const auto train_docs = decode_all(train), val_docs = decode_all(val);
  EXPECT_EQ(static_cast<int64_t>(train_docs.size()), st.train_documents);
  EXPECT_EQ(static_cast<int64_t>(val_docs.size()), st.val_documents);
  // Merging the two streams in input order gives back every document.
  size_t ti = 0, vi = 0;
  for (const std::string& doc : expect_docs) {
    if (ti < train_docs.size() && train_docs[ti] == doc) ++ti;
    else if (vi < val_docs.size() && val_docs[vi] == doc) ++vi;
    else ADD_FAILURE() << "document missing or out of order: " << doc.substr(0, 40);
  }
  EXPECT_EQ(ti, train_docs.size());
  EXPECT_EQ(vi, val_docs.size());

  // Deterministic: a rerun gives identical shards; another seed another split.
  const std::string first = slurp(st.train_files.front());
  o.output_dir = d.file("out2");
  PrepareStats st2;
  ASSERT_TRUE(data_prepare(o, &st2).is_ok());
  EXPECT_EQ(slurp(st2.train_files.front()), first);
  EXPECT_EQ(st2.val_tokens, st.val_tokens);
  o.seed = 8;
  o.output_dir = d.file("out3");
  PrepareStats st3;
  ASSERT_TRUE(data_prepare(o, &st3).is_ok());
  EXPECT_NE(read_all(st3.val_files, 300), val);

  // The shards feed the loader directly.
  DataLoaderOptions lo;
  lo.shards = {d.file("out/train_*.bin")};
  lo.batch_size = 2;
  lo.seq_len = 16;
  lo.shuffle = true;
  lo.vocab_size = 300;
  DataLoader dl;
  ASSERT_TRUE(DataLoader::open(lo, &dl).is_ok());

  // Existing shards are not silently mixed with new ones.
  o.output_dir = d.file("out");
  s = data_prepare(o, nullptr);
  EXPECT_TRUE(contains(s, "already holds shards")) << s.to_string();
  o.overwrite = true;
  s = data_prepare(o, nullptr);
  EXPECT_TRUE(s.is_ok()) << s.to_string();
}

TEST(Prepare, BlankLineAndFortuneSplitting) {
  TempDir d("prepare_split");
  write_text(d.file("paras.txt"), "\n\nfirst para\nstill first\n\n\n  \nsecond para\n\nthird\n");
  write_text(d.file("fortunes"), "the dog runs.\n%\nthe cat\nsings.\n%\n%\nbirds at dawn\n%\n");
  Tokenizer tok = load_shared();
  auto docs_of = [&](const std::string& input, TextSplit split) {
    PrepareOptions o;
    o.inputs = {input};
    o.tokenizer = shared_model();
    o.output_dir = d.file("out");
    o.overwrite = true;
    o.text_split = split;
    o.val_fraction = 0.0;
    o.quiet = true;
    PrepareStats st;
    Status s = data_prepare(o, &st);
    EXPECT_TRUE(s.is_ok()) << s.to_string();
    EXPECT_TRUE(st.val_files.empty());
    std::vector<std::string> out;
    for (const auto& ids : split_docs(read_all(st.train_files, 300), 2)) {
      std::string text;
      EXPECT_TRUE(tok.decode(ids, &text).is_ok());
      out.push_back(text);
    }
    return out;
  };
  EXPECT_EQ(docs_of(d.file("paras.txt"), TextSplit::kBlankLines),
            (std::vector<std::string>{"first para\nstill first", "second para", "third"}));
  EXPECT_EQ(docs_of(d.file("fortunes"), TextSplit::kFortune),
            (std::vector<std::string>{"the dog runs.", "the cat\nsings.", "birds at dawn"}));
  EXPECT_EQ(docs_of(d.file("fortunes"), TextSplit::kFile).size(), 1u);
}

TEST(Prepare, BadInputsAreErrors) {
  TempDir d("prepare_bad");
  write_text(d.file("bad.jsonl"), "{\"text\": \"the dog\"}\n{\"text\": \"a cat\"}\n{\"text\": \"unterminated}\n");
  PrepareOptions o;
  o.inputs = {d.file("bad.jsonl")};
  o.tokenizer = shared_model();
  o.output_dir = d.file("out");
  o.quiet = true;
  Status s = data_prepare(o);
  EXPECT_EQ(s.code(), Status::Code::kCorrupt);
  EXPECT_TRUE(contains(s, "bad.jsonl:3")) << s.to_string();

  write_text(d.file("nofield.jsonl"), "{\"text\": \"the dog\"}\n{\"body\": \"x\"}\n");
  o.inputs = {d.file("nofield.jsonl")};
  o.overwrite = true;
  s = data_prepare(o);
  EXPECT_TRUE(contains(s, "nofield.jsonl:2")) << s.to_string();
  EXPECT_TRUE(contains(s, "\"text\"")) << s.to_string();

  o.inputs = {d.file("missing.txt")};
  EXPECT_EQ(data_prepare(o).code(), Status::Code::kNotFound);
  o.inputs = {d.file("bad.jsonl")};
  o.tokenizer = d.file("missing.model");
  EXPECT_EQ(data_prepare(o).code(), Status::Code::kNotFound);
}

}  // namespace
}  // namespace laplace
