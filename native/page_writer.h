// The page file's writer: records streamed in slot order into blocks, each block's CRC32C kept for the index.
#pragma once
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "crc32c.h"
#include "pagefile.h"

namespace fusionrag {

inline void pwrite_full(const std::string& path, int fd, const uint8_t* src, size_t len, uint64_t off,
                        size_t block_bytes) {
  while (len) {
    ssize_t r = pwrite(fd, src, len, static_cast<off_t>(off));
    if (r < 0) {
      if (errno == EINTR) continue;
      int err = errno;
      throw OsError(err, path + ": writing block " + std::to_string(off / block_bytes) + " failed: " + errno_text(err));
    }
    src += r, len -= static_cast<size_t>(r), off += static_cast<uint64_t>(r);
  }
}

// Streams records in slot order to the page file; only a chunk of blocks is held
// in memory, so a build never needs the whole file in RAM.
class PageWriter {
 public:
  PageWriter(std::string path, PageLayout layout)
      : path_(std::move(path)),
        layout_(layout),
        chunk_blocks_(std::max<size_t>(1, (size_t(1) << 20) / layout.block_bytes())),
        chunk_(chunk_blocks_ * layout.block_bytes(), 0) {
    fd_ = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd_ < 0) {
      int err = errno;
      throw OsError(err, path_ + ": cannot create page file: " + errno_text(err));
    }
  }
  ~PageWriter() {
    if (fd_ >= 0) ::close(fd_);
  }
  size_t record_bytes() const { return layout_.record_bytes; }

  void write(const uint32_t* slots, size_t n, const uint8_t* records) {
    std::lock_guard<std::mutex> lk(mutex_);
    check_usable();
    if (fd_ < 0) throw std::invalid_argument(path_ + ": write to a closed PageWriter");
    for (size_t i = 0; i < n; ++i) {
      int64_t before = i ? int64_t(slots[i - 1]) : last_slot_;
      if (int64_t(slots[i]) <= before)
        throw std::invalid_argument("slots must be strictly ascending: slot " + std::to_string(slots[i]) +
                                    " comes after slot " + std::to_string(before));
    }
    or_fail([&] {
      const size_t rb = layout_.record_bytes, bb = layout_.block_bytes();
      for (size_t i = 0; i < n; ++i) {
        uint64_t block = layout_.block_of(slots[i]);
        while (block >= first_ + chunk_blocks_) flush(chunk_blocks_);
        std::memcpy(&chunk_[(block - first_) * bb + layout_.offset_in_block(slots[i])], records + i * rb, rb);
        end_ = block + 1;
      }
    });
    if (n) last_slot_ = slots[n - 1];
  }

  std::vector<uint32_t> close() {
    std::lock_guard<std::mutex> lk(mutex_);
    check_usable();
    if (fd_ < 0) return crc_;
    or_fail([&] {
      if (end_ > first_) flush(end_ - first_);
      if (fsync(fd_) != 0) {
        int err = errno;
        throw OsError(err, path_ + ": fsync failed: " + errno_text(err));
      }
    });
    int rc = ::close(fd_), err = errno;
    fd_ = -1;
    if (rc != 0) {
      failed_ = true;
      throw OsError(err, path_ + ": close failed: " + errno_text(err));
    }
    return crc_;
  }

 private:
  // Writes the first `blocks` blocks of the chunk (gaps stay zero) and moves on.
  void flush(size_t blocks) {
    const size_t bb = layout_.block_bytes();
    for (size_t b = 0; b < blocks; ++b) crc_.push_back(crc32c(&chunk_[b * bb], bb));
    pwrite_full(path_, fd_, chunk_.data(), blocks * bb, first_ * bb, bb);
    std::fill(chunk_.begin(), chunk_.begin() + blocks * bb, 0);
    first_ += blocks;
  }

  void check_usable() const {
    if (failed_) throw std::runtime_error(path_ + ": an earlier write failed; the page file is incomplete");
  }
  // A failed write leaves an incomplete file: close it and refuse further use.
  template <class F>
  void or_fail(F&& work) {
    try {
      work();
    } catch (...) {
      ::close(fd_);
      fd_ = -1;
      failed_ = true;
      throw;
    }
  }

  std::string path_;
  PageLayout layout_;
  size_t chunk_blocks_;
  std::vector<uint8_t> chunk_;  // blocks [first_, first_ + chunk_blocks_)
  uint64_t first_ = 0, end_ = 0;
  int64_t last_slot_ = -1;
  std::vector<uint32_t> crc_;
  int fd_ = -1;
  bool failed_ = false;
  std::mutex mutex_;
};

}  // namespace fusionrag
