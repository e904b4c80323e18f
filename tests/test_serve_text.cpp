// Serving helpers without sockets: stop strings across token boundaries, the exact state
// cache, the OpenAI request parser and the chat template.
#include <gtest/gtest.h>

#include <random>

#include "core/file_util.h"
#include "serve/chat_template.h"
#include "serve/openai_api.h"
#include "serve/prefix_cache.h"
#include "serve/text_stream.h"
#include "tests/test_util.h"
#include "text/tokenizer.h"

namespace laplace {
namespace {

using nlohmann::json;

const Tokenizer& tokenizer() {
  static Tokenizer* t = [] {
    const std::string dir = testing::make_temp_dir("serve_text");
    std::string corpus;
    const char* words[] = {"hello", "world", "the", "end", "is", "near", "STOP", "here", "and", "there",
                           "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "fortune", "day"};
    std::mt19937 rng(3);
    for (int i = 0; i < 400; ++i) {
      for (int k = 0; k < 9; ++k) corpus += std::string(words[rng() % 19]) + (k % 4 == 3 ? ", " : " ");
      corpus += std::to_string(i) + ".\n";
    }
    EXPECT_TRUE(write_file_atomic(dir + "/c.txt", corpus.data(), corpus.size()).is_ok());
    TokenizerTrainOptions o;
    o.inputs = {dir + "/c.txt"};
    o.model_prefix = dir + "/tok";
    o.vocab_size = 350;
    Status st = tokenizer_train(o);
    EXPECT_TRUE(st.is_ok()) << st.to_string();
    auto* tok = new Tokenizer();
    EXPECT_TRUE(Tokenizer::load(dir + "/tok.model", tok).is_ok());
    return tok;
  }();
  return *t;
}

// Feeds the text's tokens one at a time; returns what the stream sent, chunk by chunk.
std::vector<std::string> stream_all(const std::string& text, std::vector<std::string> stops, bool* stopped,
                                    std::vector<int32_t>* ids_out = nullptr) {
  std::vector<int32_t> ids;
  EXPECT_TRUE(tokenizer().encode(text, &ids).is_ok());
  TextStream s(&tokenizer(), std::move(stops));
  std::vector<std::string> out;
  for (int32_t t : ids) out.push_back(s.push(t));
  out.push_back(s.finish());
  *stopped = s.stopped();
  if (ids_out) *ids_out = ids;
  return out;
}

std::string join(const std::vector<std::string>& v) {
  std::string s;
  for (const auto& x : v) s += x;
  return s;
}

TEST(TextStream, WithoutStopsSendsEverythingInOrder) {
  bool stopped;
  const std::string text = "hello world, the end is near.";
  EXPECT_EQ(join(stream_all(text, {}, &stopped)), text);
  EXPECT_FALSE(stopped);
}

TEST(TextStream, StopStringsSpanningTokensCutExactlyAndNeverLeak) {
  const std::string text = "hello world, the end is near. STOP here and there";
  for (const std::string stop : {"STOP", "d is n", "o w", "e", "there", ". S"}) {
    bool stopped;
    const auto chunks = stream_all(text, {stop, "never-there"}, &stopped);
    const size_t at = text.find(stop);
    EXPECT_TRUE(stopped) << stop;
    EXPECT_EQ(join(chunks), text.substr(0, at)) << stop;
    // Nothing of the stop string was ever sent, even transiently.
    std::string sent;
    for (const auto& c : chunks) {
      sent += c;
      EXPECT_EQ(sent.find(stop), std::string::npos) << stop;
    }
  }
}

TEST(TextStream, HeldBackPrefixIsReleasedWhenItDoesNotComplete) {
  bool stopped;
  const std::string text = "hello world, the end is near.";
  // "near!" starts matching at "near" but never completes: all text arrives at the end.
  EXPECT_EQ(join(stream_all(text, {"near!"}, &stopped)), text);
  EXPECT_FALSE(stopped);
  EXPECT_EQ(partial_stop_suffix("abcne", "near"), 2u);
  EXPECT_EQ(partial_stop_suffix("abc", "near"), 0u);
  EXPECT_EQ(partial_stop_suffix("nea", "near"), 3u);
  EXPECT_EQ(partial_stop_suffix("near", "near"), 0u) << "a whole match is not a partial one";
}

TEST(TextStream, SplitUtf8CharactersAreHeldUntilComplete) {
  // "é" and "€" are not in the corpus: byte-fallback pieces, one byte per token.
  bool stopped;
  const std::string text = "hello \xC3\xA9t\xC3\xA9 \xE2\x82\xAC";
  const auto chunks = stream_all(text, {}, &stopped);
  EXPECT_EQ(join(chunks), text);
  for (const auto& c : chunks) EXPECT_EQ(c.find("\xEF\xBF\xBD"), std::string::npos) << "no U+FFFD sent";
}

// What a random-weight model emits: any id, byte-fallback pieces (lone lead bytes, stray
// continuation bytes) among them. The stream decodes a few tokens per push, not all of them
// (a whole decode per token made long answers quadratic), and what it sends is still exactly
// the whole decode.
TEST(TextStream, AnySequenceOfIdsStreamsToItsWholeDecode) {
  const Tokenizer& tok = tokenizer();
  std::mt19937 rng(11);
  for (int trial = 0; trial < 200; ++trial) {
    std::vector<int32_t> ids(1 + rng() % 300);
    for (auto& t : ids) t = static_cast<int32_t>(rng() % tok.vocab_size());
    TextStream s(&tok, {});
    std::string sent;
    for (int32_t t : ids) sent += s.push(t);
    sent += s.finish();
    std::string whole;
    ASSERT_TRUE(tok.decode(ids, &whole).is_ok());
    ASSERT_EQ(sent, whole) << "trial " << trial;
    ASSERT_EQ(s.sent(), whole);
  }
}

TEST(PrefixCache, LongestPrefixAtAnyTokenBoundaryAndLruEviction) {
  auto snap = [](std::vector<int32_t> t) {
    auto s = std::make_shared<StateSnapshot>();
    s->tokens = std::move(t);
    s->state.assign(1000, 1);
    return SnapshotPtr(s);
  };
  PrefixCache c(3 * (1000 + 4 * 8));  // room for three small entries
  c.insert(snap({1, 2, 3}));
  c.insert(snap({1, 2, 3, 4, 5}));
  c.insert(snap({7}));
  EXPECT_EQ(c.lookup({1, 2, 3, 4, 5, 6})->tokens.size(), 5u);
  EXPECT_EQ(c.lookup({1, 2, 3, 4})->tokens.size(), 3u);
  EXPECT_EQ(c.lookup({1, 2, 3})->tokens.size(), 3u) << "a whole-prompt hit";
  EXPECT_EQ(c.lookup({1, 2}), nullptr);
  EXPECT_EQ(c.lookup({2, 1, 3}), nullptr);
  // {7} is now least recently used: a fourth entry evicts it.
  c.insert(snap({9, 9}));
  EXPECT_EQ(c.lookup({7, 1}), nullptr);
  EXPECT_NE(c.lookup({1, 2, 3, 0}), nullptr);
  const PrefixCacheStats s = c.stats();
  EXPECT_EQ(s.entries, 3);
  EXPECT_EQ(s.evictions, 1);
  EXPECT_LE(s.bytes, s.budget);
  EXPECT_EQ(s.hits, 4);
  // Too big for the budget: not kept.
  auto big = std::make_shared<StateSnapshot>();
  big->tokens = {5};
  big->state.assign(100000, 0);
  c.insert(big);
  EXPECT_EQ(c.lookup({5}), nullptr);
  // Hashes are per prefix and differ between different prefixes.
  auto h = PrefixCache::prefix_hashes({1, 2, 3});
  ASSERT_EQ(h.size(), 4u);
  EXPECT_NE(h[3], PrefixCache::prefix_hashes({1, 2, 4})[3]);
  EXPECT_EQ(h[2], PrefixCache::prefix_hashes({1, 2, 4})[2]);
}

// A list of prompts (strings, or lists of token ids: lm-evaluation-harness's batches) is
// one prompt each, in order; a list of ids stays one prompt.
TEST(OpenAiParse, ListsOfPromptsAreOnePromptEach) {
  ApiLimits lim;
  lim.max_prompts = 3;
  CompletionParams p;
  ASSERT_FALSE(parse_completion_params(json::parse(R"({"prompt": [[1, 2], [3], []]})"), false, lim, &p));
  ASSERT_EQ(p.prompts.size(), 3u);
  EXPECT_EQ(p.prompts[0].ids, (std::vector<int32_t>{1, 2}));
  EXPECT_EQ(p.prompts[1].ids, (std::vector<int32_t>{3}));
  EXPECT_TRUE(p.prompts[2].is_ids && p.prompts[2].ids.empty());
  ASSERT_FALSE(parse_completion_params(json::parse(R"({"prompt": ["a", "b"]})"), false, lim, &p));
  ASSERT_EQ(p.prompts.size(), 2u);
  EXPECT_EQ(p.prompts[1].text, "b");
  EXPECT_FALSE(p.prompts[1].is_ids);
  ASSERT_FALSE(parse_completion_params(json::parse(R"({"prompt": [7, 8]})"), false, lim, &p));
  ASSERT_EQ(p.prompts.size(), 1u);
  for (const char* bad : {R"({"prompt": ["a", [1]]})", R"({"prompt": [[1], "a"]})", R"({"prompt": [[1], [-1]]})",
                          R"({"prompt": ["a", "b", "c", "d"]})", R"({"prompt": []})",
                          R"({"prompt": ["a", "b"], "save_session": "s"})"}) {
    auto e = parse_completion_params(json::parse(bad), false, lim, &p);
    ASSERT_TRUE(e) << bad;
    EXPECT_EQ(e->http_status, 400) << bad;
  }
}

TEST(OpenAiParse, AcceptsTheFormsClientsSend) {
  ApiLimits lim;
  CompletionParams p;
  ASSERT_FALSE(parse_completion_params(json::parse(R"({"prompt": [1, 2, 3], "max_tokens": 7.0, "top_k": -1,
      "seed": 18446744073709551615, "stop": "x", "stream": true, "stream_options": {"include_usage": true},
      "logprobs": 2, "n": 3})"), false, lim, &p));
  ASSERT_EQ(p.prompts.size(), 1u);
  EXPECT_TRUE(p.prompts[0].is_ids);
  EXPECT_EQ(p.prompts[0].ids, (std::vector<int32_t>{1, 2, 3}));
  EXPECT_EQ(p.max_tokens, 7);
  EXPECT_EQ(p.sampling.top_k, 0);
  EXPECT_EQ(p.sampling.seed, UINT64_MAX);
  EXPECT_EQ(p.stop, (std::vector<std::string>{"x"}));
  EXPECT_TRUE(p.stream && p.include_usage);
  EXPECT_EQ(p.logprobs, 2);
  EXPECT_EQ(p.n, 3);
  CompletionParams c;
  ASSERT_FALSE(parse_completion_params(json::parse(R"({"messages": [{"role": "developer", "content": "be"},
      {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
      "max_completion_tokens": 5, "logprobs": true, "top_logprobs": 3, "frequency_penalty": -1.5})"), true, lim, &c));
  ASSERT_EQ(c.messages.size(), 2u);
  EXPECT_EQ(c.messages[1].content, "ab");
  EXPECT_EQ(c.max_tokens, 5);
  EXPECT_EQ(c.logprobs, 3);
  EXPECT_DOUBLE_EQ(c.sampling.frequency_penalty, -1.5);
  CompletionParams d;
  ASSERT_FALSE(parse_completion_params(json::parse(R"({"prompt": "x"})"), false, lim, &d));
  EXPECT_EQ(d.max_tokens, lim.default_max_tokens);
  EXPECT_EQ(d.logprobs, -1);
  const auto e = parse_completion_params(json::parse(R"({"prompt": "x", "max_tokens": 100000})"), false, lim, &d);
  ASSERT_TRUE(e);
  EXPECT_EQ(e->param, "max_tokens");
  EXPECT_EQ(e->to_json()["error"]["param"], "max_tokens");
  EXPECT_TRUE(e->to_json()["error"]["code"].is_null());
  EXPECT_TRUE(valid_session_name("chat-1.v2_x"));
  for (const char* bad : {"", ".hidden", "a/b", "..", "a b", "x\n"}) EXPECT_FALSE(valid_session_name(bad)) << bad;
}

TEST(ChatTemplate, RendersPerMessagePiecesAndRejectsBadFiles) {
  ChatTemplate t = ChatTemplate::default_template();
  std::vector<ChatTemplate::Piece> pieces;
  ASSERT_TRUE(t.render({{"system", "s"}, {"user", "u"}, {"assistant", "a"}}, &pieces).is_ok());
  std::string all;
  int assistant = 0;
  for (const auto& p : pieces) {
    all += p.text;
    assistant += p.assistant_content;
  }
  EXPECT_EQ(all, "### System:\ns\n\n### User:\nu\n\n### Assistant:\na\n\n### Assistant:\n");
  EXPECT_EQ(assistant, 1);
  EXPECT_FALSE(t.render({{"tool", "x"}}, &pieces).is_ok());
  ChatTemplate u;
  EXPECT_TRUE(ChatTemplate::parse(R"({"roles": {"system": {"prefix": "<s>"}, "user": {"prefix": "<u>"},
      "assistant": {"prefix": "<a>", "suffix": "</a>"}}, "generation_prompt": "<a>", "stop": ["</a>"]})", &u).is_ok());
  EXPECT_EQ(u.roles["assistant"].suffix, "</a>");
  EXPECT_EQ(u.stop, (std::vector<std::string>{"</a>"}));
  EXPECT_EQ(ChatTemplate::parse("{", &u).code(), Status::Code::kCorrupt);
  EXPECT_EQ(ChatTemplate::parse(R"({"roles": {"user": {}}})", &u).code(), Status::Code::kInvalidArgument);
  EXPECT_EQ(ChatTemplate::parse(R"({"roles": 5})", &u).code(), Status::Code::kCorrupt);
  EXPECT_EQ(ChatTemplate::parse(R"({"roles": {"system": {"prefix": 1}, "user": {}, "assistant": {}}})", &u).code(),
            Status::Code::kCorrupt);
}

}  // namespace
}  // namespace laplace
