// core/doc_starts.h: document starts from a separator and from offsets, and the checks that
// refuse malformed boundaries with a message naming the value.
#include "core/doc_starts.h"

#include <gtest/gtest.h>

#include <vector>

namespace laplace {
namespace {

TEST(DocStarts, FromTheSeparator) {
  // Row 0 starts with a separator; row 1 continues a document up to its first one.
  const std::vector<int32_t> tokens = {2, 5, 6, 2, 2, 7, 9, 8, 2, 4, 5, 2};
  std::vector<int32_t> doc(tokens.size());
  doc_starts_from_separator(tokens.data(), 2, 6, 2, doc.data());
  EXPECT_EQ(doc, (std::vector<int32_t>{0, 0, 0, 3, 4, 4, -1, -1, 2, 2, 2, 5}));
  EXPECT_TRUE(validate_doc_starts(doc.data(), 2, 6).is_ok());
  EXPECT_TRUE(doc_starts_split(doc.data(), 2, 6));
  const std::vector<int32_t> none(6, -1);
  EXPECT_FALSE(doc_starts_split(none.data(), 1, 6));
}

TEST(DocStarts, FromOffsets) {
  std::vector<int32_t> doc;
  ASSERT_TRUE(doc_starts_from_offsets(std::vector<int64_t>{0, 3, 4, 7}, 7, &doc).is_ok());
  EXPECT_EQ(doc, (std::vector<int32_t>{0, 0, 0, 3, 4, 4, 4}));
  ASSERT_TRUE(doc_starts_from_offsets(std::vector<int64_t>{0, 1}, 1, &doc).is_ok());
  EXPECT_EQ(doc, (std::vector<int32_t>{0}));
}

TEST(DocStarts, BadOffsetsAreRefusedNamingTheValue) {
  std::vector<int32_t> doc;
  struct Case {
    std::vector<int64_t> offsets;
    int64_t T;
    const char* says;
  };
  const Case cases[] = {
      {{0}, 4, "at least two offsets"},
      {{1, 4}, 4, "first offset must be 0, got 1"},
      {{0, 3, 2, 4}, 4, "offset 2 = 2 is before offset 1 = 3"},
      {{0, 2, 2, 4}, 4, "document 1 is empty"},
      {{0, 9}, 4, "offset 1 = 9 is past the row's 4 tokens"},
      {{0, 3}, 4, "last offset must be the row length 4, got 3"},
  };
  for (const Case& c : cases) {
    const Status st = doc_starts_from_offsets(c.offsets, c.T, &doc);
    EXPECT_EQ(st.code(), Status::Code::kInvalidArgument);
    EXPECT_NE(st.message().find(c.says), std::string::npos) << st.message();
  }
}

TEST(DocStarts, MalformedRowsAreRefused) {
  const std::vector<std::vector<int32_t>> bad = {{1, 1, 1}, {0, 0, 1}, {0, 2, 2}, {-1, 0, 0}, {0, -1, -1}};
  for (const auto& d : bad) {
    const Status st = validate_doc_starts(d.data(), 1, 3);
    EXPECT_EQ(st.code(), Status::Code::kInvalidArgument);
    EXPECT_NE(st.message().find("row 0, position"), std::string::npos) << st.message();
  }
}

}  // namespace
}  // namespace laplace
