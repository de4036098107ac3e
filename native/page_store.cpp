// The page store: a page file read through the DRAM page buffer (or the record cache, or whichever of the two an
// adaptive layout's miniature favours now), its misses read by a BlockReader and checked against their CRC32C.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "crc32c.h"
#include "pagefile.h"

namespace fusionrag {

PageLayout::PageLayout(size_t record_bytes, size_t records_per_block, size_t pages_per_block)
    : record_bytes(record_bytes), records_per_block(records_per_block), pages_per_block(pages_per_block) {
  if (record_bytes == 0 || records_per_block == 0 || pages_per_block == 0)
    throw std::invalid_argument("record_bytes, records_per_block and pages_per_block must be positive");
  if (records_per_block * record_bytes > block_bytes())
    throw std::invalid_argument(std::to_string(records_per_block) + " records of " + std::to_string(record_bytes) +
                                " bytes do not fit a block of " + std::to_string(pages_per_block) + " pages");
}

// Whether a record cached alone, with its metadata, costs less than its share of a block (index.py's
// records_cache_denser): an adaptive layout starts with records then, with blocks otherwise.
bool records_denser(const PageLayout& layout) {
  return double(layout.record_bytes + kRecordCacheOverhead) <
         double(layout.block_bytes()) / double(layout.records_per_block);
}

struct LayoutMiniature {
  // A switch needs the other layout ahead by this share of the current one's score (hits, halved every period),
  // and by kLayoutMinHits: near ties stay put, since the new layout has to warm up.
  static constexpr double kLayoutMargin = 0.1, kLayoutMinHits = 32;
  std::mutex mutex;
  PageBuffer shadow[2];  // [0] blocks, [1] records: metadata only, Lfu
  size_t rate;
  uint64_t seen = 0, period, hits[2] = {0, 0};
  double score[2] = {0, 0};

  LayoutMiniature(size_t blocks, size_t records, size_t rate, size_t period)
      : shadow{PageBuffer(std::max<size_t>(1, blocks / rate), 0, BufferPolicy::Lfu),
               PageBuffer(std::max<size_t>(1, records / rate), 0, BufferPolicy::Lfu)},
        rate(rate),
        period(period) {}

  bool sampled(uint32_t block) const { return ((uint64_t(block) + 1) * 0xD6E8FEB86659FD93ull >> 40) % rate == 0; }
};

bool PageStore::layout_sampled(uint32_t block) const { return layout_mini_ && layout_mini_->sampled(block); }

void PageStore::observe(uint32_t block, const uint32_t* slots, size_t n) {
  if (!layout_mini_ || !n || !layout_mini_->sampled(block)) return;
  LayoutMiniature& m = *layout_mini_;
  bool to_records;
  {
    std::lock_guard<std::mutex> lk(m.mutex);
    if (m.shadow[0].lookup(block, nullptr)) ++m.hits[0];
    else m.shadow[0].insert(block, nullptr);
    bool all = true;
    for (size_t i = 0; i < n; ++i)
      if (!m.shadow[1].lookup(slots[i], nullptr)) all = false, m.shadow[1].insert(slots[i], nullptr);
    m.hits[1] += all;
    if (++m.seen < m.period) return;
    m.seen = 0;
    // No verdict while a shadow is still filling: blocks fill a frame a read, records a record at a time, so an
    // empty shadow's first periods would favour blocks for a stream whose records win once both are full.
    if (!m.shadow[0].evictions() || !m.shadow[1].evictions()) {
      m.hits[0] = m.hits[1] = 0;
      return;
    }
    for (int i = 0; i < 2; ++i) m.score[i] = m.score[i] / 2 + double(m.hits[i]), m.hits[i] = 0;
    const bool now = records_on();
    const double here = m.score[now], there = m.score[!now];
    if (layout_held_.load(std::memory_order_relaxed)) return;
    if (there <= here * (1 + LayoutMiniature::kLayoutMargin) || there - here < LayoutMiniature::kLayoutMinHits) return;
    to_records = !now;
  }
  // Moving records takes a while on a big buffer (~250 ms for 78 MiB of blocks here): not on this query's call.
  if (switching_.exchange(true)) return;  // one under way already
  std::lock_guard<std::mutex> lk(switcher_mutex_);
  if (switcher_.joinable()) switcher_.join();  // finished: switching_ was false
  switcher_ = std::thread([this, to_records] {
    try {
      set_layout(to_records);
    } catch (...) {  // set_layout left the layout as it was
    }
    switching_.store(false);
  });
}

void PageStore::wait_layout() {
  std::lock_guard<std::mutex> lk(switcher_mutex_);
  if (switcher_.joinable()) switcher_.join();
}

void PageStore::set_layout(bool records, bool hold) {
  if (!adaptive())
    throw std::invalid_argument("set_layout needs an adaptive layout (a page buffer and a record cache)");
  std::lock_guard<std::mutex> lk(layout_mutex_);
  if (hold) layout_held_.store(true);
  if (records_on() == records) return;
  PageBuffer& to = records ? records_ : buffer_;
  PageBuffer& from = records ? buffer_ : records_;
  to.set_active(true);  // empty: the bytes it will hold are those the other gives back now
  try {
    if (records) seed_records();
  } catch (...) {  // (an allocation failed) the layout stays as it was, less the blocks moved so far
    to.set_active(false);
    throw;
  }
  from.set_active(false);
  layout_switches_.fetch_add(1, std::memory_order_relaxed);
}

// Blocks to records, warm: the records of the most used blocks held move to the record cache, as many blocks as
// it holds whole, and the rest are evicted first, so that the bytes held never pass what one layout holds: each
// block's frame is given back as its records go in. Records to blocks starts cold (a block is whole only once
// read).
void PageStore::seed_records() {
  std::vector<std::pair<uint32_t, uint32_t>> held = buffer_.held_blocks();
  std::sort(held.begin(), held.end(), [](auto a, auto b) { return a.first != b.first ? a.first > b.first : a.second < b.second; });
  const size_t rpb = layout_.records_per_block, rb = layout_.record_bytes;
  const size_t whole = std::min(held.size(), records_.capacity() / rpb);
  for (size_t i = whole; i < held.size(); ++i) buffer_.evict(held[i].second);
  for (size_t i = 0; i < whole; ++i) {
    const uint32_t block = held[i].second, uses = std::max<uint32_t>(1, held[i].first);
    buffer_.evict(block, [&](const uint8_t* data) {
      for (size_t r = 0; r < rpb; ++r) records_.insert(uint32_t(block * rpb + r), data + r * rb, uses);
    });
  }
}

PageStore::PageStore(const std::string& path, PageLayout layout, std::vector<uint32_t> block_crc,
                     size_t buffer_blocks, const std::string& io_backend, const std::string& direct_io,
                     int io_threads, BufferPolicy policy, size_t record_cache_records, bool adaptive_layout,
                     double compress_gain)
    : path_(path),
      layout_(layout),
      crc_(std::move(block_crc)),
      buffer_(buffer_blocks, layout.block_bytes(), policy, !(adaptive_layout && records_denser(layout)),
              compress_gain),
      records_(record_cache_records, layout.record_bytes, policy, !adaptive_layout || records_denser(layout)) {
  if (adaptive_layout) {
    if (compress_gain > 1) throw std::invalid_argument("a compressed page buffer has no adaptive layout");
    if (!buffer_blocks || !record_cache_records)
      throw std::invalid_argument("an adaptive layout needs both buffer_blocks and record_cache records");
    // As Auto's miniature: a sample big enough that the block shadow has about 256 frames, a period of as many
    // touches as it has frames. It starts with the layout the bytes favour (records_denser), so that a stream
    // it never sees a reason to leave costs what the fixed layout does; no verdict comes until both shadows are
    // full, and a switch to records takes the most used blocks' records along (seed_records).
    const size_t rate = std::max<size_t>(1, buffer_blocks / 256);
    layout_mini_ = std::make_unique<LayoutMiniature>(buffer_blocks, record_cache_records, rate,
                                                     std::max<size_t>(256, buffer_blocks / rate));
  }
  if (io_backend != "auto" && io_backend != "io_uring" && io_backend != "pread")
    throw std::invalid_argument("io_backend must be 'auto', 'io_uring' or 'pread', not '" + io_backend + "'");
  if (direct_io != "auto" && direct_io != "on" && direct_io != "off")
    throw std::invalid_argument("direct_io must be 'auto', 'on' or 'off', not '" + direct_io + "'");
  if (io_threads < 1) throw std::invalid_argument("io_threads must be at least 1");
  if (crc_.size() > UINT32_MAX) throw std::invalid_argument("more than 2^32 - 1 blocks");

  direct_ = direct_io != "off";
  fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | (direct_ ? O_DIRECT : 0));
  if (fd_ < 0 && errno == EINVAL && direct_io == "auto") {  // e.g. tmpfs refuses O_DIRECT
    direct_ = false;
    fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  }
  if (fd_ < 0) {
    int err = errno;
    throw OsError(err, path + ": cannot open page file" + (direct_ ? " with O_DIRECT: " : ": ") + errno_text(err));
  }
  struct stat st;
  if (fstat(fd_, &st) != 0) {
    int err = errno;
    ::close(fd_);
    throw OsError(err, path + ": cannot stat page file: " + errno_text(err));
  }
  uint64_t want = uint64_t(crc_.size()) * layout.block_bytes();
  if (uint64_t(st.st_size) != want) {
    ::close(fd_);
    throw std::runtime_error(path + ": page file is " + std::to_string(st.st_size) + " bytes, the index expects " +
                             std::to_string(want) + " (" + std::to_string(crc_.size()) + " blocks of " +
                             std::to_string(layout.block_bytes()) + " bytes): truncated or the wrong file");
  }

  if (io_backend != "pread") {
    int err = make_uring_reader(path, fd_, layout.block_bytes(), reader_);
    if (err && io_backend == "io_uring") {
      ::close(fd_);
      throw OsError(err, path + ": io_uring is not available here: " + errno_text(err));
    }
  }
  if (!reader_) reader_ = make_pread_reader(path, fd_, layout.block_bytes(), io_threads);
}

PageStore::~PageStore() {
  wait_layout();   // a switch under way uses the buffers
  reader_.reset();  // threads and rings go before the fd they use
  ::close(fd_);
}

void PageStore::check_crc(const BlockRead& r) const {
  uint32_t got = crc32c(r.dst, layout_.block_bytes());
  if (got != crc_[r.block]) {
    char detail[64];
    std::snprintf(detail, sizeof detail, " (crc32c 0x%08x, expected 0x%08x)", got, crc_[r.block]);
    throw std::runtime_error(path_ + ": block " + std::to_string(r.block) + " fails its checksum" + detail +
                             ": the index is corrupt");
  }
}

size_t PageStore::fetch(const uint32_t* blocks, size_t n, uint8_t* out, uint8_t* read_from_ssd,
                        const uint32_t* weights, ReadAhead* ahead) {
  const size_t bb = layout_.block_bytes();
  std::vector<BlockRead> misses, fills;  // fills: every block from the SSD, read now or ahead
  std::vector<uint32_t> fill_weights;
  if (ahead && ahead->pending_) {
    try {
      ahead->pending_->wait();
    } catch (const std::exception&) {
      ahead->failed_ = true;  // every block is read again below, and fails there if it must
    }
    ahead->pending_.reset();
  }
  if (tracing_.load(std::memory_order_relaxed)) {  // a call's header, then its requests
    std::lock_guard<std::mutex> lk(trace_mutex_);
    trace_.push_back(kTraceCall), trace_.push_back(uint32_t(n));
    for (size_t i = 0; i < n; ++i) trace_.push_back(blocks[i]), trace_.push_back(weights ? weights[i] : 1);
  }
  for (size_t i = 0; i < n; ++i) {
    if (blocks[i] >= crc_.size())
      throw std::invalid_argument(path_ + ": block " + std::to_string(blocks[i]) + " is past the end (" +
                                  std::to_string(crc_.size()) + " blocks)");
    const uint32_t w = weights ? weights[i] : 1;
    bool hit = buffer_.lookup(blocks[i], out + i * bb, w);
    if (!hit && ahead && !ahead->failed_) {
      auto at = std::lower_bound(ahead->blocks_.begin(), ahead->blocks_.end(), blocks[i]);
      const size_t j = size_t(at - ahead->blocks_.begin());
      if (at != ahead->blocks_.end() && *at == blocks[i] && !ahead->taken_[j]) {
        ahead->taken_[j] = 1;
        check_crc(ahead->reads_[j]);
        std::memcpy(out + i * bb, ahead->reads_[j].dst, bb);
        // Into the buffer with the blocks read now, in the same order, as if read now.
        fills.push_back({blocks[i], out + i * bb}), fill_weights.push_back(w);
        if (read_from_ssd) read_from_ssd[i] = 1;
        continue;
      }
    }
    if (!hit) {
      misses.push_back({blocks[i], out + i * bb});
      fills.push_back(misses.back()), fill_weights.push_back(w);
    }
    if (read_from_ssd) read_from_ssd[i] = !hit;
  }
  blocks_from_buffer_.fetch_add(n - fills.size(), std::memory_order_relaxed);
  if (!misses.empty()) {
    read_calls_.fetch_add(1, std::memory_order_relaxed);
    blocks_read_.fetch_add(misses.size(), std::memory_order_relaxed);
    reader_->read(misses.data(), misses.size());
    for (const BlockRead& r : misses) check_crc(r);
  }
  for (size_t i = 0; i < fills.size(); ++i) buffer_.insert(fills[i].block, fills[i].dst, fill_weights[i]);
  return fills.size();
}

void PageStore::settle(ReadAhead& ahead, std::vector<uint32_t>* unused_blocks) {
  if (ahead.pending_) {
    try {
      ahead.pending_->wait();
    } catch (const std::exception&) {
    }
    ahead.pending_.reset();
  }
  size_t unused = 0;
  for (size_t i = 0; i < ahead.taken_.size(); ++i)
    if (!ahead.taken_[i]) {
      ++unused;
      if (unused_blocks) unused_blocks->push_back(ahead.blocks_[i]);
    }
  read_ahead_unused_.fetch_add(unused, std::memory_order_relaxed);
  ahead.blocks_.clear(), ahead.taken_.clear(), ahead.reads_.clear();
  ahead.failed_ = false;
}

void PageStore::read_ahead(ReadAhead& ahead, const uint32_t* blocks, size_t n) {
  settle(ahead);
  for (size_t i = 0; i < n; ++i)
    if (blocks[i] < crc_.size() && !buffer_.resident(blocks[i])) ahead.blocks_.push_back(blocks[i]);
  const size_t count = ahead.blocks_.size(), bb = layout_.block_bytes();
  if (!count) return;
  ahead.taken_.assign(count, 0);
  uint8_t* data = ahead.data_.get(count * bb);
  for (size_t i = 0; i < count; ++i) ahead.reads_.push_back({ahead.blocks_[i], data + i * bb});
  try {
    ahead.pending_ = reader_->start(ahead.reads_.data(), count);
  } catch (const std::exception&) {
    // Nothing went out: the fetch reads these blocks itself, and reports what fails.
    ahead.blocks_.clear(), ahead.taken_.clear(), ahead.reads_.clear();
    return;
  }
  read_calls_.fetch_add(1, std::memory_order_relaxed);
  blocks_read_.fetch_add(count, std::memory_order_relaxed);
  read_ahead_.fetch_add(count, std::memory_order_relaxed);
}

size_t PageStore::pin(const uint32_t* blocks, size_t n) {
  for (size_t i = 0; i < n; ++i)
    if (blocks[i] >= crc_.size())
      throw std::invalid_argument(path_ + ": block " + std::to_string(blocks[i]) + " is past the end (" +
                                  std::to_string(crc_.size()) + " blocks)");
  std::lock_guard<std::mutex> lk(pin_mutex_);
  std::vector<uint32_t> missing = buffer_.pin(blocks, n);
  // Read in modest batches: the background thread should not hog the SSD queue.
  constexpr size_t kBatch = 64;
  const size_t bb = layout_.block_bytes();
  AlignedBuffer buf;
  std::vector<BlockRead> reads;
  for (size_t first = 0; first < missing.size(); first += kBatch) {
    const size_t count = std::min(kBatch, missing.size() - first);
    uint8_t* data = buf.get(count * bb);
    reads.clear();
    for (size_t i = 0; i < count; ++i) reads.push_back({missing[first + i], data + i * bb});
    reader_->read(reads.data(), reads.size());
    for (const BlockRead& r : reads) check_crc(r);
    for (const BlockRead& r : reads) buffer_.insert(r.block, r.dst);
    pin_reads_.fetch_add(count, std::memory_order_relaxed);
  }
  return buffer_.pinned();
}

void PageStore::set_trace(bool on) {
  std::lock_guard<std::mutex> lk(trace_mutex_);
  tracing_.store(on, std::memory_order_relaxed);
}

std::vector<uint32_t> PageStore::take_trace() {
  std::lock_guard<std::mutex> lk(trace_mutex_);
  std::vector<uint32_t> out;
  out.swap(trace_);
  return out;
}

PageStoreStats PageStore::stats() {
  return {blocks_read_.load(), blocks_from_buffer_.load(), read_calls_.load(), buffer_.evictions(),
          pin_reads_.load(), buffer_.pinned(), read_ahead_.load(), read_ahead_unused_.load(), buffer_.switches(),
          record_lookups_.load(), records_from_cache_.load(), layout_switches_.load()};
}

}  // namespace fusionrag
