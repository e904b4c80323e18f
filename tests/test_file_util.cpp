#include "core/file_util.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <unistd.h>

#include <sys/wait.h>

#include <algorithm>
#include <atomic>
#include <thread>
#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "tests/test_util.h"

namespace laplace {
namespace {

namespace fs = std::filesystem;

std::vector<std::string> list_dir(const std::string& dir) {
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir)) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

std::string slurp(const std::string& path) {
  std::string s;
  Status st = read_file(path, &s);
  EXPECT_TRUE(st.is_ok()) << st.to_string();
  return s;
}

bool contains(const std::string& hay, const std::string& needle) { return hay.find(needle) != std::string::npos; }

TEST(FileUtil, WriteThenReadRoundTrip) {
  std::string dir = testing::make_temp_dir("fu");
  std::string path = dir + "/blob.bin";
  std::string data;
  for (int i = 0; i < (1 << 20) + 777; ++i) data.push_back(static_cast<char>((i * 131) ^ (i >> 7)));  // has NULs
  ASSERT_TRUE(write_file_atomic(path, data.data(), data.size()).is_ok());
  EXPECT_EQ(slurp(path), data);
  EXPECT_EQ(list_dir(dir), std::vector<std::string>{"blob.bin"});  // no temp file left
  fs::remove_all(dir);
}

TEST(FileUtil, EmptyFile) {
  std::string dir = testing::make_temp_dir("fu");
  std::string path = dir + "/empty";
  ASSERT_TRUE(write_file_atomic(path, nullptr, 0).is_ok());
  std::string s = "stale";
  ASSERT_TRUE(read_file(path, &s).is_ok());
  EXPECT_TRUE(s.empty());
  fs::remove_all(dir);
}

TEST(FileUtil, ReadsFilesWithoutAKnownSize) {
  // /proc files report size 0; read_file must still read to EOF.
  std::string s;
  ASSERT_TRUE(read_file("/proc/self/status", &s).is_ok());
  EXPECT_TRUE(contains(s, "Name:"));
}

TEST(FileUtil, ReadMissingFile) {
  std::string dir = testing::make_temp_dir("fu");
  std::string path = dir + "/nope.txt";
  std::string s;
  Status st = read_file(path, &s);
  EXPECT_EQ(st.code(), Status::Code::kNotFound);
  EXPECT_TRUE(contains(st.message(), path)) << st.message();
  EXPECT_TRUE(contains(st.message(), "No such file")) << st.message();
  fs::remove_all(dir);
}

TEST(FileUtil, ReadDirectoryFails) {
  std::string dir = testing::make_temp_dir("fu");
  std::string s;
  Status st = read_file(dir, &s);
  EXPECT_FALSE(st.is_ok());
  EXPECT_TRUE(contains(st.message(), "directory")) << st.message();
  fs::remove_all(dir);
}

TEST(FileUtil, ReadPermissionDenied) {
  if (::geteuid() == 0) GTEST_SKIP() << "root ignores file permissions";
  std::string dir = testing::make_temp_dir("fu");
  std::string path = dir + "/secret";
  ASSERT_TRUE(write_file_atomic(path, "x", 1).is_ok());
  ASSERT_EQ(::chmod(path.c_str(), 0), 0);
  std::string s;
  Status st = read_file(path, &s);
  EXPECT_EQ(st.code(), Status::Code::kIoError);
  EXPECT_TRUE(contains(st.message(), "Permission denied")) << st.message();
  fs::remove_all(dir);
}

TEST(FileUtil, AtomicWriteReplacesOldFile) {
  std::string dir = testing::make_temp_dir("fu");
  std::string path = dir + "/f.txt";
  ASSERT_TRUE(write_file_atomic(path, "old contents", 12).is_ok());
  ASSERT_TRUE(write_file_atomic(path, "new", 3).is_ok());
  EXPECT_EQ(slurp(path), "new");
  EXPECT_EQ(list_dir(dir), std::vector<std::string>{"f.txt"});
  fs::remove_all(dir);
}

TEST(FileUtil, RelativePathInCurrentDirectory) {
  // parent_path() of "f.txt" is empty: the directory to fsync is ".".
  std::string dir = testing::make_temp_dir("fu");
  fs::path old = fs::current_path();
  fs::current_path(dir);
  Status st = write_file_atomic("rel.txt", "abc", 3);
  fs::current_path(old);
  ASSERT_TRUE(st.is_ok()) << st.to_string();
  EXPECT_EQ(slurp(dir + "/rel.txt"), "abc");
  fs::remove_all(dir);
}

TEST(FileUtil, FailingWriterLeavesOldFileAndNoTemp) {
  std::string dir = testing::make_temp_dir("fu");
  std::string path = dir + "/ckpt.bin";
  ASSERT_TRUE(write_file_atomic(path, "precious", 8).is_ok());
  Status st = write_file_atomic(path, [](std::FILE* f) {
    std::string junk(100000, 'j');
    Status s = write_all(f, junk.data(), junk.size());
    if (!s.is_ok()) return s;
    return Status::io_error("boom halfway");
  });
  EXPECT_FALSE(st.is_ok());
  EXPECT_TRUE(contains(st.message(), "boom halfway")) << st.message();
  EXPECT_TRUE(contains(st.message(), path)) << st.message();
  EXPECT_EQ(slurp(path), "precious");
  EXPECT_EQ(list_dir(dir), std::vector<std::string>{"ckpt.bin"});
  fs::remove_all(dir);
}

TEST(FileUtil, ThrowingWriterLeavesNoTemp) {
  std::string dir = testing::make_temp_dir("fu");
  std::string path = dir + "/ckpt.bin";
  ASSERT_TRUE(write_file_atomic(path, "precious", 8).is_ok());
  EXPECT_THROW(write_file_atomic(path,
                                 [](std::FILE* f) -> Status {
                                   // Its result is moot: the writer throws right after.
                                   (void)write_all(f, "partial", 7);
                                   throw std::runtime_error("writer threw");
                                 }),
               std::runtime_error);
  EXPECT_EQ(slurp(path), "precious");
  EXPECT_EQ(list_dir(dir), std::vector<std::string>{"ckpt.bin"});
  fs::remove_all(dir);
}

// Threads writing one path at once each write a temporary of their own: the file is always
// one writer's bytes whole (with the temporary shared by pid, as it was, writers truncated
// and interleaved each other's bytes).
TEST(FileUtil, ConcurrentAtomicWritesOfOnePathNeverMix) {
  std::string dir = testing::make_temp_dir("fu");
  std::string path = dir + "/shared.bin";
  std::vector<std::string> contents;
  for (int t = 0; t < 4; ++t) contents.push_back(std::string(200000 + 1000 * t, static_cast<char>('a' + t)));
  std::atomic<int> failures{0};
  for (int round = 0; round < 10; ++round) {
    std::vector<std::thread> th;
    for (int t = 0; t < 4; ++t)
      th.emplace_back([&, t] {
        if (!write_file_atomic(path, contents[t].data(), contents[t].size()).is_ok()) ++failures;
      });
    for (auto& x : th) x.join();
    const std::string got = slurp(path);
    EXPECT_TRUE(std::find(contents.begin(), contents.end(), got) != contents.end())
        << "round " << round << ": " << got.size() << " bytes, not one writer's whole file";
  }
  EXPECT_EQ(failures.load(), 0);
  EXPECT_EQ(list_dir(dir), std::vector<std::string>{"shared.bin"});
  fs::remove_all(dir);
}

// Temporaries whose writer process is gone (a crash, kill -9) are removed: by
// remove_stale_temporaries, and by the next atomic write of the same path. A live
// writer's temporary (this process's) stays.
TEST(FileUtil, StaleTemporariesOfDeadWritersAreRemoved) {
  std::string dir = testing::make_temp_dir("fu");
  const pid_t child = fork();
  if (child == 0) _exit(0);
  ASSERT_GT(child, 0);
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);  // reaped: its pid names no process now
  const std::string dead = std::to_string(child), live = std::to_string(getpid());
  for (const std::string& name : std::vector<std::string>{"checkpoint.safetensors.tmp." + dead, "checkpoint.safetensors.tmp." + dead + ".3",
                                  "a.session.tmp." + dead + ".0", "a.session.tmp." + live + ".0", "keep.tmp.notapid",
                                  "b.session"})
    ASSERT_TRUE(write_file_atomic(dir + "/" + name, "x", 1).is_ok());
  EXPECT_EQ(remove_stale_temporaries(dir, ".session"), 1);
  EXPECT_EQ(list_dir(dir), (std::vector<std::string>{"a.session.tmp." + live + ".0", "b.session",
                                                     "checkpoint.safetensors.tmp." + dead,
                                                     "checkpoint.safetensors.tmp." + dead + ".3", "keep.tmp.notapid"}));
  // The next save of the checkpoint takes its dead writers' temporaries with it.
  ASSERT_TRUE(write_file_atomic(dir + "/checkpoint.safetensors", "ckpt", 4).is_ok());
  EXPECT_EQ(list_dir(dir), (std::vector<std::string>{"a.session.tmp." + live + ".0", "b.session",
                                                     "checkpoint.safetensors", "keep.tmp.notapid"}));
  EXPECT_EQ(remove_stale_temporaries(dir), 0);
  // A writer that tidies its directory itself (tidy = false) leaves them for that.
  ASSERT_TRUE(write_file_atomic(dir + "/c.session.tmp." + dead + ".1", "x", 1).is_ok());
  ASSERT_TRUE(write_file_atomic(
                  dir + "/c.session", [](std::FILE* f) { return write_all(f, "s", 1); }, 0600, /*tidy=*/false)
                  .is_ok());
  EXPECT_TRUE(fs::exists(dir + "/c.session.tmp." + dead + ".1"));
  EXPECT_EQ(remove_stale_temporaries(dir, ".session"), 1);
  fs::remove_all(dir);
}

// A directory shared by several machines (sessions on NFS): another machine's pids mean
// nothing here, so its temporaries go only once they have not been written to for an hour,
// while this machine's tag with a dead pid goes at once.
TEST(FileUtil, TemporariesOfAnotherMachineGoOnlyWhenOld) {
  std::string dir = testing::make_temp_dir("fu");
  const pid_t child = fork();
  if (child == 0) _exit(0);
  ASSERT_GT(child, 0);
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  const std::string dead = std::to_string(child), mine = temporary_host_tag();
  ASSERT_EQ(mine.size(), 8u);
  const std::string other = mine == "00000000" ? "00000001" : "00000000";
  const std::vector<std::string> names = {"a.session.tmp." + dead + ".0.h" + mine,    // this machine, dead: goes
                                          "b.session.tmp." + dead + ".0.h" + other,   // another machine, young: stays
                                          "c.session.tmp." + dead + ".0.h" + other};  // another machine, old: goes
  for (const std::string& name : names) ASSERT_TRUE(write_file_atomic(dir + "/" + name, "x", 1).is_ok());
  struct timeval old[2] = {{::time(nullptr) - 7200, 0}, {::time(nullptr) - 7200, 0}};
  ASSERT_EQ(::utimes((dir + "/" + names[2]).c_str(), old), 0);
  EXPECT_EQ(remove_stale_temporaries(dir, ".session"), 2);
  EXPECT_EQ(list_dir(dir), (std::vector<std::string>{names[1]}));
  // What this machine writes carries its tag.
  std::string seen;
  ASSERT_TRUE(write_file_atomic(dir + "/d.session", [&](std::FILE*) {
                for (const auto& e : fs::directory_iterator(dir))
                  if (e.path().filename().string().rfind("d.session.tmp.", 0) == 0) seen = e.path().filename().string();
                return Status::ok();
              }).is_ok());
  ASSERT_GE(seen.size(), 10u);
  EXPECT_EQ(seen.substr(seen.size() - 10), ".h" + mine);
  fs::remove_all(dir);
}

TEST(FileUtil, AtomicWriteTakesTheModeItIsGiven) {
  std::string dir = testing::make_temp_dir("fu");
  ASSERT_TRUE(write_file_atomic(dir + "/secret", "x", 1, 0600).is_ok());
  struct stat st {};
  ASSERT_EQ(::stat((dir + "/secret").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  fs::remove_all(dir);
}

TEST(FileUtil, WriteIntoMissingDirectoryFails) {
  std::string dir = testing::make_temp_dir("fu");
  std::string path = dir + "/no/such/dir/f.bin";
  Status st = write_file_atomic(path, "x", 1);
  EXPECT_FALSE(st.is_ok());
  EXPECT_TRUE(contains(st.message(), path)) << st.message();
  EXPECT_TRUE(contains(st.message(), "No such file")) << st.message();
  EXPECT_TRUE(list_dir(dir).empty());
  fs::remove_all(dir);
}

TEST(FileUtil, RenameOverDirectoryFailsAndCleansUp) {
  std::string dir = testing::make_temp_dir("fu");
  std::string path = dir + "/target";
  fs::create_directory(path);
  fs::create_directory(path + "/inner");  // non-empty: rename(2) cannot replace it
  Status st = write_file_atomic(path, "x", 1);
  EXPECT_FALSE(st.is_ok());
  EXPECT_TRUE(contains(st.message(), "rename")) << st.message();
  EXPECT_EQ(list_dir(dir), std::vector<std::string>{"target"});
  fs::remove_all(dir);
}

TEST(FileUtil, WriteAllReportsOsError) {
  std::FILE* f = std::fopen("/dev/full", "wb");
  if (f == nullptr) GTEST_SKIP() << "no /dev/full";
  std::setvbuf(f, nullptr, _IONBF, 0);  // unbuffered: the error shows at fwrite
  Status st = write_all(f, "abcdef", 6);
  std::fclose(f);
  EXPECT_EQ(st.code(), Status::Code::kIoError);
  EXPECT_TRUE(contains(st.message(), "No space left")) << st.message();
}

TEST(FileUtil, MappedFileReadsWholeFile) {
  std::string dir = testing::make_temp_dir("fu");
  std::string path = dir + "/m.bin";
  std::string data(100003, '\0');
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<char>(i * 7);
  ASSERT_TRUE(write_file_atomic(path, data.data(), data.size()).is_ok());
  MappedFile m;
  ASSERT_TRUE(MappedFile::open(path, &m).is_ok());
  EXPECT_TRUE(m.is_open());
  ASSERT_EQ(m.size(), data.size());
  EXPECT_EQ(std::string(reinterpret_cast<const char*>(m.data()), m.size()), data);
  EXPECT_EQ(m.path(), path);

  // Moves transfer the mapping; the moved-from object is empty.
  const uint8_t* p = m.data();
  MappedFile m2(std::move(m));
  EXPECT_EQ(m2.data(), p);
  EXPECT_EQ(m.data(), nullptr);  // NOLINT(bugprone-use-after-move)
  EXPECT_FALSE(m.is_open());
  MappedFile m3;
  m3 = std::move(m2);
  EXPECT_EQ(m3.data(), p);
  EXPECT_EQ(m3.size(), data.size());
  EXPECT_EQ(m3.data()[12345], static_cast<uint8_t>(data[12345]));
  // Reassigning over an open mapping unmaps it (ASan/leak-free).
  ASSERT_TRUE(MappedFile::open(path, &m3).is_ok());
  EXPECT_EQ(m3.size(), data.size());
  fs::remove_all(dir);
}

TEST(FileUtil, MappedFileEmptyAndErrors) {
  std::string dir = testing::make_temp_dir("fu");
  std::string path = dir + "/empty";
  ASSERT_TRUE(write_file_atomic(path, nullptr, 0).is_ok());
  MappedFile m;
  ASSERT_TRUE(MappedFile::open(path, &m).is_ok());
  EXPECT_TRUE(m.is_open());
  EXPECT_EQ(m.size(), 0u);
  EXPECT_EQ(m.data(), nullptr);

  Status st = MappedFile::open(dir + "/missing", &m);
  EXPECT_EQ(st.code(), Status::Code::kNotFound);
  EXPECT_TRUE(contains(st.message(), dir + "/missing")) << st.message();
  EXPECT_TRUE(m.is_open());  // unchanged on failure

  st = MappedFile::open(dir, &m);
  EXPECT_FALSE(st.is_ok());
  EXPECT_TRUE(contains(st.message(), "not a regular file")) << st.message();
  fs::remove_all(dir);
}

}  // namespace
}  // namespace laplace
