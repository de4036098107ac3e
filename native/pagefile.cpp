// The page file: a streaming writer, and a reader that goes through the DRAM page
// buffer and reads misses with O_DIRECT via io_uring or a pread thread pool.
#include "pagefile.h"

#include <fcntl.h>
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <thread>

#include "crc32c.h"
#include "io_uring.h"
#include "numpy_out.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace fusionrag {

namespace {

std::string errno_text(int err) { return std::strerror(err); }

// Reads len bytes at off in full; returns 0, an errno, or -1 when the file ends first.
int pread_full(int fd, uint8_t* dst, size_t len, uint64_t off) {
  while (len) {
    ssize_t r = pread(fd, dst, len, static_cast<off_t>(off));
    if (r < 0) {
      if (errno == EINTR) continue;
      return errno;
    }
    if (r == 0) return -1;
    dst += r, len -= static_cast<size_t>(r), off += static_cast<uint64_t>(r);
  }
  return 0;
}

[[noreturn]] void throw_read_error(const std::string& path, uint32_t block, int err) {
  if (err < 0) throw std::runtime_error(path + ": short read of block " + std::to_string(block) + ": the file ends early");
  throw OsError(err, path + ": reading block " + std::to_string(block) + " failed: " + errno_text(err));
}

// Keeps queue depth high with plain blocking reads: for kernels or sandboxes
// without io_uring. Owned by one store, so queries never wait behind the
// compute pool.
class PreadReader : public BlockReader {
 public:
  PreadReader(std::string path, int fd, size_t block_bytes, int threads)
      : path_(std::move(path)), fd_(fd), block_bytes_(block_bytes) {
    for (int i = 0; i < threads; ++i) threads_.emplace_back([this] { loop(); });
  }
  ~PreadReader() override {
    {
      std::lock_guard<std::mutex> lk(mutex_);
      stop_ = true;
    }
    cv_.notify_all();
    for (auto& t : threads_) t.join();
  }
  const char* name() const override { return "pread"; }

  void read(const BlockRead* reads, size_t n) override {
    Batch batch;
    enqueue(reads, n, batch);
    batch.wait();
    if (batch.err) throw_read_error(path_, batch.err_block, batch.err);
  }

  std::unique_ptr<PendingRead> start(const BlockRead* reads, size_t n) override {
    auto pending = std::make_unique<Pending>(path_);
    enqueue(reads, n, pending->batch);
    return pending;
  }

 private:
  struct Batch {
    std::mutex mutex;
    std::condition_variable done;
    size_t left = 0;
    int err = 0;
    uint32_t err_block = 0;

    void wait() {
      std::unique_lock<std::mutex> lk(mutex);
      done.wait(lk, [&] { return left == 0; });
    }
  };
  struct Task {
    const BlockRead* read;
    Batch* batch;
  };
  struct Pending : PendingRead {
    const std::string& path;
    Batch batch;
    explicit Pending(const std::string& path) : path(path) {}
    ~Pending() override { batch.wait(); }
    void wait() override {
      batch.wait();
      if (batch.err) throw_read_error(path, batch.err_block, batch.err);
    }
  };

  void enqueue(const BlockRead* reads, size_t n, Batch& batch) {
    batch.left = n;
    if (!n) return;
    {
      std::lock_guard<std::mutex> lk(mutex_);
      for (size_t i = 0; i < n; ++i) queue_.push_back({&reads[i], &batch});
    }
    cv_.notify_all();
  }

  void loop() {
    for (;;) {
      Task t;
      {
        std::unique_lock<std::mutex> lk(mutex_);
        cv_.wait(lk, [&] { return stop_ || !queue_.empty(); });
        if (stop_) return;
        t = queue_.front();
        queue_.pop_front();
      }
      int err = pread_full(fd_, t.read->dst, block_bytes_, uint64_t(t.read->block) * block_bytes_);
      std::lock_guard<std::mutex> lk(t.batch->mutex);
      if (err && !t.batch->err) t.batch->err = err, t.batch->err_block = t.read->block;
      if (--t.batch->left == 0) t.batch->done.notify_one();
    }
  }

  std::string path_;
  int fd_;
  size_t block_bytes_;
  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<Task> queue_;
  bool stop_ = false;
  std::vector<std::thread> threads_;
};

// One ring per read in progress, taken from a pool: rings are not thread-safe,
// and a caller may be any pool worker or any Python thread.
class UringReader : public BlockReader {
 public:
  // A re-rank round of 16 queries in flight x 8-candidate mini-batches reads up
  // to 128 blocks (Fashion-MNIST: 108 on average); 256 lets even 32 in flight
  // go out as one submission rather than several waited out one after another.
  static constexpr unsigned kDepth = 256;

  UringReader(std::string path, int fd, size_t block_bytes, std::unique_ptr<IoUring> first)
      : path_(std::move(path)), fd_(fd), block_bytes_(block_bytes) {
    free_.push_back(std::move(first));
  }
  // Returns 0 and a ring, or the errno why this kernel gives none.
  static int make_ring(std::unique_ptr<IoUring>& ring) {
    ring.reset(new IoUring);
    int err = ring->init(kDepth);
    if (err) ring.reset();
    return err;
  }
  const char* name() const override { return "io_uring"; }

  void read(const BlockRead* reads, size_t n) override {
    std::unique_ptr<IoUring> ring = acquire();
    int err = 0;
    uint32_t err_block = 0;
    for (size_t first = 0; first < n && !err; first += ring->entries()) {
      size_t count = std::min<size_t>(ring->entries(), n - first);
      for (size_t i = first; i < first + count; ++i)
        ring->prep_read(fd_, reads[i].dst, unsigned(block_bytes_), offset(reads[i]), i);
      int rc = ring->submit_and_reap([&](uint64_t i, int res) { complete(reads[i], res, err, err_block); });
      if (rc) throw OsError(rc, path_ + ": io_uring_enter failed: " + errno_text(rc));  // drops the ring
    }
    release(std::move(ring));
    if (err) throw_read_error(path_, err_block, err);
  }

  // Submits the first ring-full of reads; the wait reaps them and reads any
  // rest as read() does.
  std::unique_ptr<PendingRead> start(const BlockRead* reads, size_t n) override {
    std::unique_ptr<IoUring> ring = acquire();
    const size_t count = std::min<size_t>(ring->entries(), n);
    for (size_t i = 0; i < count; ++i) ring->prep_read(fd_, reads[i].dst, unsigned(block_bytes_), offset(reads[i]), i);
    if (int rc = ring->submit()) {
      ring->reap([](uint64_t, int) {});  // whatever did go out
      throw OsError(rc, path_ + ": io_uring_enter failed: " + errno_text(rc));
    }
    return std::make_unique<Pending>(*this, std::move(ring), reads, n, count);
  }

 private:
  struct Pending : PendingRead {
    UringReader& reader;
    std::unique_ptr<IoUring> ring;  // null once reaped
    const BlockRead* reads;
    size_t n, submitted;

    Pending(UringReader& reader, std::unique_ptr<IoUring> ring, const BlockRead* reads, size_t n, size_t submitted)
        : reader(reader), ring(std::move(ring)), reads(reads), n(n), submitted(submitted) {}
    ~Pending() override {
      if (ring && ring->reap([](uint64_t, int) {}) == 0) reader.release(std::move(ring));
    }
    void wait() override {
      if (!ring) return;
      int err = 0;
      uint32_t err_block = 0;
      int rc = ring->reap([&](uint64_t i, int res) { reader.complete(reads[i], res, err, err_block); });
      if (rc) {
        ring.reset();
        throw OsError(rc, reader.path_ + ": io_uring_enter failed: " + errno_text(rc));
      }
      reader.release(std::move(ring));
      if (err) throw_read_error(reader.path_, err_block, err);
      if (submitted < n) reader.read(reads + submitted, n - submitted);
    }
  };

  uint64_t offset(const BlockRead& r) const { return uint64_t(r.block) * block_bytes_; }

  // A short read is finished with pread; if that finds the end too, it is reported.
  void complete(const BlockRead& r, int res, int& err, uint32_t& err_block) {
    int e = res < 0                        ? -res
            : size_t(res) == block_bytes_ ? 0
                                          : pread_full(fd_, r.dst + res, block_bytes_ - res, offset(r) + uint64_t(res));
    if (e && !err) err = e, err_block = r.block;
  }

  std::unique_ptr<IoUring> acquire() {
    {
      std::lock_guard<std::mutex> lk(mutex_);
      if (!free_.empty()) {
        auto ring = std::move(free_.back());
        free_.pop_back();
        return ring;
      }
    }
    std::unique_ptr<IoUring> ring;
    if (int err = make_ring(ring)) throw OsError(err, path_ + ": cannot set up another io_uring: " + errno_text(err));
    return ring;
  }
  void release(std::unique_ptr<IoUring> ring) {
    std::lock_guard<std::mutex> lk(mutex_);
    free_.push_back(std::move(ring));
  }

  std::string path_;
  int fd_;
  size_t block_bytes_;
  std::mutex mutex_;
  std::vector<std::unique_ptr<IoUring>> free_;
};

void pwrite_full(const std::string& path, int fd, const uint8_t* src, size_t len, uint64_t off, size_t block_bytes) {
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

}  // namespace

PageLayout::PageLayout(size_t record_bytes, size_t records_per_block, size_t pages_per_block)
    : record_bytes(record_bytes), records_per_block(records_per_block), pages_per_block(pages_per_block) {
  if (record_bytes == 0 || records_per_block == 0 || pages_per_block == 0)
    throw std::invalid_argument("record_bytes, records_per_block and pages_per_block must be positive");
  if (records_per_block * record_bytes > block_bytes())
    throw std::invalid_argument(std::to_string(records_per_block) + " records of " + std::to_string(record_bytes) +
                                " bytes do not fit a block of " + std::to_string(pages_per_block) + " pages");
}

uint8_t* AlignedBuffer::get(size_t need) {
  if (need > bytes) {
    void* p = nullptr;
    if (posix_memalign(&p, kPageBytes, need)) throw std::bad_alloc();
    ptr.reset(static_cast<uint8_t*>(p));
    bytes = need;
  }
  return ptr.get();
}

BufferPolicy parse_buffer_policy(const std::string& name) {
  if (name == "clock") return BufferPolicy::Clock;
  if (name == "lfu") return BufferPolicy::Lfu;
  if (name == "auto") return BufferPolicy::Auto;
  throw std::invalid_argument("buffer_policy must be 'auto', 'clock' or 'lfu', not '" + name + "'");
}

namespace {
size_t pow2_at_least(size_t n) {
  size_t p = 1;
  while (p < n) p <<= 1;
  return p;
}
}  // namespace

namespace {
// The index of the first set bit of bits ^ flip at or after `from`, or `limit` if none is before it.
inline size_t next_set(const uint64_t* bits, size_t from, size_t limit, uint64_t flip = 0) {
  for (size_t w = from / 64; w * 64 < limit; ++w) {
    uint64_t v = bits[w] ^ flip;
    if (w == from / 64) v &= ~uint64_t(0) << (from % 64);
    if (v) return std::min(limit, w * 64 + size_t(__builtin_ctzll(v)));
  }
  return limit;
}
}  // namespace

size_t zero_runs_encode(const uint8_t* src, size_t n, uint8_t* dst) {
  // Bit i of zero: byte i is 0; of run3: bytes i, i + 1 and i + 2 are (past the end counts as 0).
  const size_t words = n / 64 + 2;
  thread_local std::vector<uint64_t> zero, run3;
  zero.assign(words, ~uint64_t(0)), run3.resize(words);
  for (size_t w = 0; w * 64 < n; ++w) {
    uint64_t v = 0;
    const size_t m = std::min<size_t>(64, n - w * 64);
    const uint8_t* p = src + w * 64;
#if defined(__SSE2__)
    if (m == 64) {
      const __m128i z = _mm_setzero_si128();
      for (int k = 0; k < 4; ++k) {
        const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p) + k);
        v |= uint64_t(uint32_t(_mm_movemask_epi8(_mm_cmpeq_epi8(bytes, z)))) << (16 * k);
      }
    } else
#endif
      for (size_t k = 0; k < m; ++k) v |= uint64_t(!p[k]) << k;
    if (m < 64) v |= ~uint64_t(0) << m;
    zero[w] = v;
  }
  for (size_t w = 0; w < words; ++w) {
    const uint64_t a = zero[w], b = w + 1 < words ? zero[w + 1] : ~uint64_t(0);
    run3[w] = a & (a >> 1 | b << 63) & (a >> 2 | b << 62);
  }
  size_t i = 0, o = 0;
  while (i < n) {
    const size_t from = std::min(next_set(zero.data(), i, n, ~uint64_t(0)), i + 255);
    const size_t l = std::min(next_set(run3.data(), from, n), from + 255) - from;
    if (o + 2 + l >= n) return 0;
    dst[o] = uint8_t(from - i), dst[o + 1] = uint8_t(l);
    std::memcpy(dst + o + 2, src + from, l);
    o += 2 + l, i = from + l;
  }
  return o;
}

void zero_runs_decode(const uint8_t* src, size_t len, uint8_t* dst, size_t n) {
  const uint8_t* const end = dst + n;
  for (size_t i = 0; i + 1 < len;) {
    const size_t z = src[i], l = src[i + 1];
#if defined(__SSE2__)
    // Away from both ends, whole 16-byte stores: a token writes up to 15 bytes past its own, which the next
    // tokens overwrite (they cover every byte up to the end, and at least 32 are left).
    if (size_t(end - dst) >= z + l + 32 && i + 2 + l + 16 <= len) {
      const __m128i zero = _mm_setzero_si128();
      for (size_t k = 0; k < z; k += 16) _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + k), zero);
      dst += z;
      for (size_t k = 0; k < l; k += 16)
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + k),
                         _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 2 + k)));
      dst += l, i += 2 + l;
      continue;
    }
#endif
    std::memset(dst, 0, z);
    std::memcpy(dst + z, src + i + 2, l);
    dst += z + l, i += 2 + l;
  }
}

PageBuffer::PageBuffer(size_t capacity, size_t block_bytes, BufferPolicy policy, bool active, double compress_gain)
    : capacity_(capacity), block_bytes_(block_bytes), policy_(policy), active_(active) {
  if (!capacity) return;
  if (compress_gain > 1) {
    if (!block_bytes || block_bytes % kChunkBytes)
      throw std::invalid_argument("a compressed page buffer needs blocks of whole chunks");
    compressed_ = true;
    entry_factor_ = std::min(4.0, compress_gain * 1.25);
  }
  // Anonymous memory is page-aligned and committed only as frames fill. No block bytes: a shadow, metadata only.
  arena_bytes_ = capacity * block_bytes;
  if (arena_bytes_) {
    arena_ = mmap(nullptr, arena_bytes_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (arena_ == MAP_FAILED) throw std::bad_alloc();
  }
  // At least 256 frames a shard, so CLOCK still sees a useful window.
  size_t n = std::clamp<size_t>(capacity / 256, 1, 16);
  shards_ = std::vector<Shard>(n);
  for (size_t i = 0; i < n; ++i) {
    size_t lo = capacity * i / n, hi = capacity * (i + 1) / n;
    shards_[i].frames = arena_ ? static_cast<uint8_t*>(arena_) + lo * block_bytes : nullptr;
    shards_[i].nominal = hi - lo;
    const size_t entries = compressed_ ? size_t(std::ceil(double(hi - lo) * entry_factor_)) : hi - lo;
    if (active) {
      init(shards_[i], entries, policy != BufferPolicy::Clock);
      if (compressed_) init_chunks(shards_[i]);
    } else {
      shards_[i].size = entries;
    }
  }
  if (policy == BufferPolicy::Auto) {
    // A sample of the blocks big enough that each shadow is a shard's size: about 256 frames or more. Compressed:
    // shadows of as many blocks as the memory is expected to hold.
    const size_t effective = compressed_ ? size_t(double(capacity) * compress_gain) : capacity;
    mini_ = std::make_unique<Miniature>();
    mini_->rate = std::max<size_t>(1, effective / 256);
    const size_t frames = std::max<size_t>(1, effective / mini_->rate);
    mini_->period = frames;
    for (int i = 0; i < 2; ++i) init(mini_->shadow[i], frames, i == 1);
  }
}

void FrameMap::reset(size_t frames) {
  slots_.assign(pow2_at_least(std::max<size_t>(8, 2 * frames)), Slot{kNone, 0});
  mask_ = slots_.size() - 1;
}

bool FrameMap::erase(uint32_t key) {
  if (slots_.empty()) return false;
  size_t i = home(key);
  for (; slots_[i].key != key; i = (i + 1) & mask_)
    if (slots_[i].key == kNone) return false;
  // Backward shift: an entry after the hole moves into it unless its home lies cyclically in (hole, entry].
  for (size_t j = i;;) {
    j = (j + 1) & mask_;
    if (slots_[j].key == kNone) break;
    const size_t h = home(slots_[j].key);
    if (((j - h) & mask_) >= ((j - i) & mask_)) slots_[i] = slots_[j], i = j;
  }
  slots_[i] = Slot{kNone, 0};
  return true;
}

// A shard's frames all free; with a sketch (Lfu, Auto) of sixteen counters a frame:
// it must tell apart blocks not in the buffer too.
void PageBuffer::init(Shard& s, size_t frames, bool sketch) {
  s.size = frames;
  s.block_of.assign(frames, kEmpty);
  s.uses.assign(frames, 0);
  s.pinned.assign(frames, 0);
  s.frame_of.reset(frames);
  if (sketch) s.sketch.assign(pow2_at_least(std::max<size_t>(64, 16 * frames)), 0);
}

void PageBuffer::init_chunks(Shard& s) const {
  const size_t chunks = s.nominal * block_bytes_ / kChunkBytes;
  s.next.resize(chunks);
  for (size_t c = 0; c < chunks; ++c) s.next[c] = c + 1 < chunks ? uint32_t(c + 1) : kEmpty;
  s.free_head = chunks ? 0 : kEmpty, s.free_chunks = chunks;
  s.head.assign(s.block_of.size(), kEmpty);
  s.coded.assign(s.block_of.size(), 0);
}

size_t PageBuffer::entries() const {
  if (!compressed_) return capacity_;
  size_t n = 0;
  for (const Shard& s : shards_) n += s.size;
  return n;
}

size_t PageBuffer::chunk_bytes_held() {
  size_t n = 0;
  if (!compressed_) return n;
  for (Shard& s : shards_) {
    std::lock_guard<std::mutex> lk(s.mutex);
    n += (s.next.size() - s.free_chunks) * kChunkBytes;
  }
  return n;
}

// Empties a shard: no block, nothing pinned or wanted, no counts.
void PageBuffer::reset(Shard& s) {
  std::fill(s.block_of.begin(), s.block_of.end(), kEmpty);
  std::fill(s.uses.begin(), s.uses.end(), 0);
  std::fill(s.pinned.begin(), s.pinned.end(), 0);
  std::fill(s.sketch.begin(), s.sketch.end(), 0);
  s.frame_of.clear();
  s.wanted.clear();
  s.hand = s.num_pinned = 0;
  s.requests = 0;
}

PageBuffer::~PageBuffer() {
  if (arena_) munmap(arena_, arena_bytes_);
}

// Auto's miniature as new: shadows empty, no hits, no score (the mode it runs in is left as it is).
void PageBuffer::reset_miniature() {
  if (!mini_) return;
  std::lock_guard<std::mutex> lk(mini_->mutex);
  for (Shard& s : mini_->shadow) reset(s);
  mini_->seen = mini_->hits[0] = mini_->hits[1] = 0;
  mini_->score[0] = mini_->score[1] = 0;
}

void PageBuffer::set_active(bool on) {
  if (!capacity_ || active_.load() == on) return;
  if (!on) active_.store(false);  // new lookups miss from here on; those under way finish under their shard's lock
  for (Shard& s : shards_) {
    std::lock_guard<std::mutex> lk(s.mutex);
    if (on) {
      init(s, s.size, policy_ != BufferPolicy::Clock);
      if (compressed_) init_chunks(s);
    } else {  // metadata freed, not just emptied: the other layout holds the bytes now
      s.block_of = {}, s.uses = {}, s.pinned = {}, s.sketch = {};
      s.next = {}, s.head = {}, s.coded = {};
      s.free_head = kEmpty, s.free_chunks = 0;
      s.frame_of.release(), s.wanted = {};
      s.hand = s.num_pinned = 0;
      s.requests = 0;
    }
  }
  if (!on && arena_) madvise(arena_, arena_bytes_, MADV_DONTNEED);  // the frames' memory back to the system
  reset_miniature();
  if (on) active_.store(true);
}

namespace {
// Two hashes of a block into the sketch, independent of the shard hash.
inline size_t sketch_slot(uint32_t block, int row, size_t mask) {
  uint64_t h = (uint64_t(block) + 1) * (row ? 0xC2B2AE3D27D4EB4Full : 0x9E3779B97F4A7C15ull);
  return size_t(h >> 32) & mask;
}
}  // namespace

uint32_t PageBuffer::estimate(const Shard& s, uint32_t block) const {
  const size_t mask = s.sketch.size() - 1;
  return std::min(s.sketch[sketch_slot(block, 0, mask)], s.sketch[sketch_slot(block, 1, mask)]);
}

void PageBuffer::count(Shard& s, uint32_t block, uint32_t weight) {
  if (s.sketch.empty()) return;  // Clock
  const size_t mask = s.sketch.size() - 1;
  // Conservative update: only the counters at the minimum grow.
  const uint32_t now = estimate(s, block), to = std::min<uint32_t>(255, now + weight);
  for (int row = 0; row < 2; ++row) {
    uint8_t& c = s.sketch[sketch_slot(block, row, mask)];
    if (c < to) c = uint8_t(to);
  }
  // Aging: halve every count once the shard has seen kAgingRequests requests a frame.
  s.requests += weight;
  if (s.requests >= kAgingRequests * s.block_of.size()) {
    for (uint8_t& c : s.sketch) c >>= 1;
    for (uint8_t& u : s.uses) u >>= 1;
    s.requests /= 2;
  }
}

// The frame to fill: a free one, or the victim of a sweep that passes pinned
// frames and spends one use of every other frame it passes.
size_t PageBuffer::victim(Shard& s) {
  for (;;) {
    size_t f = s.hand;
    s.hand = (s.hand + 1) % s.block_of.size();
    if (s.block_of[f] == kEmpty) return f;
    if (s.pinned[f]) continue;
    if (!s.uses[f]) return f;
    --s.uses[f];
  }
}

// A hit on a frame: Clock marks it referenced, Lfu counts its uses.
void PageBuffer::hit(Shard& s, size_t frame, uint32_t weight, bool lfu) {
  uint8_t& uses = s.uses[frame];
  uses = lfu ? uint8_t(std::min<uint32_t>(kMaxUses, uses + weight)) : 1;
}

// The frame a missed block takes, with `need` chunks free for it (compressed; 0 otherwise), its victims evicted
// (*evicted counts them), or SIZE_MAX when Lfu's admission keeps a victim (those evicted before it stay free).
// Clock: a new block earns its second chance only when it is hit again, so one scan of cold blocks cannot flush
// the hot ones. Lfu: it was admitted for its requests, and starts with one use.
size_t PageBuffer::place(Shard& s, uint32_t block, uint32_t weight, bool lfu, bool pin, size_t need,
                         size_t* evicted) {
  size_t entry = SIZE_MAX;
  *evicted = 0;
  while (entry == SIZE_MAX || s.free_chunks < need) {
    const size_t f = victim(s);
    if (s.block_of[f] != kEmpty) {
      // TinyLFU admission: a block requested no more often than the victim would
      // only push out something as likely to come back.
      if (lfu && !pin && estimate(s, block) <= estimate(s, s.block_of[f])) return SIZE_MAX;
      drop_frame(s, f);
      ++*evicted;
    }
    if (entry == SIZE_MAX) entry = f;
  }
  s.block_of[entry] = block;
  s.uses[entry] = lfu ? uint8_t(std::min<uint32_t>(kMaxUses, weight)) : 0;
  s.frame_of.insert(block, uint32_t(entry));
  return entry;
}

void PageBuffer::drop_frame(Shard& s, size_t f) {
  s.frame_of.erase(s.block_of[f]);
  s.block_of[f] = kEmpty, s.uses[f] = 0;
  if (s.pinned[f]) s.pinned[f] = 0, --s.num_pinned;
  if (s.head.empty()) return;  // no chunks: a plain buffer, or a shadow
  for (uint32_t c = s.head[f], n = uint32_t(chunks_for(s.coded[f])); n--;) {
    const uint32_t after = s.next[c];
    s.next[c] = s.free_head, s.free_head = c, ++s.free_chunks;
    c = after;
  }
  s.head[f] = kEmpty, s.coded[f] = 0;
}

// Frame f takes a block's bytes: data, or with compression its code (len bytes; coded null: data as it is).
void PageBuffer::store_frame(Shard& s, size_t f, const uint8_t* data, const uint8_t* coded, size_t len) {
  if (!block_bytes_) return;
  if (!compressed_) {
    std::memcpy(s.frames + f * block_bytes_, data, block_bytes_);
    return;
  }
  const uint8_t* src = coded ? coded : data;
  if (!coded) len = block_bytes_;
  s.coded[f] = uint32_t(len);
  uint32_t* link = &s.head[f];
  for (size_t at = 0; at < len; at += kChunkBytes) {
    const uint32_t c = s.free_head;
    s.free_head = s.next[c], --s.free_chunks;
    *link = c, link = &s.next[c];
    std::memcpy(s.frames + size_t(c) * kChunkBytes, src + at, std::min(kChunkBytes, len - at));
  }
}

void PageBuffer::load_frame(const Shard& s, size_t f, uint8_t* out) const {
  if (!block_bytes_) return;
  if (!compressed_) {
    std::memcpy(out, s.frames + f * block_bytes_, block_bytes_);
    return;
  }
  const size_t len = s.coded[f];
  thread_local std::vector<uint8_t> code;
  uint8_t* dst = out;
  if (len != block_bytes_) {
    if (code.size() < len) code.resize(block_bytes_);
    dst = code.data();
  }
  uint32_t c = s.head[f];
  for (size_t at = 0; at < len; at += kChunkBytes, c = s.next[c])
    std::memcpy(dst + at, s.frames + size_t(c) * kChunkBytes, std::min(kChunkBytes, len - at));
  if (len != block_bytes_) zero_runs_decode(code.data(), len, out, block_bytes_);
}

// Auto: a request of a sampled block through both shadows; at the end of each
// period the buffer takes the mode whose shadow served more, recent periods
// weighing most.
void PageBuffer::simulate(uint32_t block, uint32_t weight) {
  Miniature& m = *mini_;
  std::lock_guard<std::mutex> lk(m.mutex);
  for (int i = 0; i < 2; ++i) {
    Shard& s = m.shadow[i];
    count(s, block, weight);
    const uint32_t f = s.frame_of.find(block);
    size_t evicted;
    if (f != FrameMap::kNone) {
      m.hits[i] += weight;
      hit(s, f, weight, i == 1);
    } else {
      place(s, block, weight, i == 1, false, 0, &evicted);
    }
  }
  m.seen += weight;
  if (m.seen < m.period) return;
  m.seen = 0;
  for (int i = 0; i < 2; ++i) m.score[i] = m.score[i] / 2 + double(m.hits[i]), m.hits[i] = 0;
  const bool lfu = m.score[1] >= m.score[0];
  if (lfu_mode_.exchange(lfu, std::memory_order_relaxed) != lfu) switches_.fetch_add(1, std::memory_order_relaxed);
}

bool PageBuffer::lookup(uint32_t block, uint8_t* out, uint32_t weight) {
  if (!capacity_ || !active()) return false;
  if (mini_ && mini_sampled(block)) simulate(block, weight);
  Shard& s = shard(block);
  std::lock_guard<std::mutex> lk(s.mutex);
  if (s.block_of.empty()) return false;  // off
  count(s, block, weight);
  const uint32_t f = s.frame_of.find(block);
  if (f == FrameMap::kNone) return false;
  hit(s, f, weight, lfu_now());
  if (out) load_frame(s, f, out);
  return true;
}

bool PageBuffer::offer(uint32_t block, const uint8_t* data, uint32_t weight, bool requested) {
  if (!capacity_ || (requested && !active())) return false;
  if (requested && mini_ && mini_sampled(block)) simulate(block, weight);
  // Coded before the lock is taken, so that other threads do not wait for it.
  thread_local std::vector<uint8_t> code;
  size_t len = 0;
  if (compressed_) {
    if (code.size() < block_bytes_) code.resize(block_bytes_);
    len = zero_runs_encode(data, block_bytes_, code.data());
  }
  Shard& s = shard(block);
  std::lock_guard<std::mutex> lk(s.mutex);
  if (s.block_of.empty()) return false;  // off
  if (requested) count(s, block, weight);
  const bool pin = !s.wanted.empty() && s.wanted.count(block) && s.num_pinned < pin_limit(s);
  const bool lfu = lfu_now();
  const uint32_t held = s.frame_of.find(block);
  if (held != FrameMap::kNone) {  // a hit, or another query read it meanwhile
    if (requested) hit(s, held, weight, lfu);
    if (pin && !s.pinned[held]) s.pinned[held] = 1, ++s.num_pinned;
    return true;
  }
  size_t evicted;
  const size_t need = compressed_ ? chunks_for(len ? len : block_bytes_) : 0;
  const size_t f = place(s, block, weight, lfu, pin, need, &evicted);
  if (evicted) evictions_.fetch_add(evicted, std::memory_order_relaxed);
  if (f == SIZE_MAX) return false;
  if (pin) s.pinned[f] = 1, ++s.num_pinned;
  store_frame(s, f, data, len ? code.data() : nullptr, len);
  return false;
}

bool PageBuffer::resident(uint32_t block) { return peek(block, nullptr); }

std::vector<std::pair<uint32_t, uint32_t>> PageBuffer::held_blocks() {
  std::vector<std::pair<uint32_t, uint32_t>> out;
  for (Shard& s : shards_) {
    std::lock_guard<std::mutex> lk(s.mutex);
    for (size_t f = 0; f < s.block_of.size(); ++f)
      if (s.block_of[f] != kEmpty) out.push_back({s.uses[f], s.block_of[f]});
  }
  return out;
}

bool PageBuffer::evict(uint32_t block, const std::function<void(const uint8_t*)>& take) {
  if (!capacity_) return false;
  Shard& s = shard(block);
  std::lock_guard<std::mutex> lk(s.mutex);
  const uint32_t f = s.frame_of.find(block);
  if (f == FrameMap::kNone) return false;
  if (take && s.frames && !compressed_) {
    take(s.frames + size_t(f) * block_bytes_);
  } else if (take && s.frames) {
    thread_local std::vector<uint8_t> bytes;
    bytes.resize(block_bytes_);
    load_frame(s, f, bytes.data());
    take(bytes.data());
  }
  drop_frame(s, f);
  // Whole pages, frames page-aligned; a compressed block's chunks share pages with others and stay.
  if (s.frames && !compressed_) madvise(s.frames + size_t(f) * block_bytes_, block_bytes_, MADV_DONTNEED);
  return true;
}

bool PageBuffer::peek(uint32_t block, uint8_t* out) {
  if (!capacity_) return false;
  Shard& s = shard(block);
  std::lock_guard<std::mutex> lk(s.mutex);
  const uint32_t f = s.frame_of.find(block);
  if (f == FrameMap::kNone) return false;
  if (out) load_frame(s, f, out);
  return true;
}

std::vector<uint32_t> PageBuffer::pin(const uint32_t* blocks, size_t n) {
  std::vector<uint32_t> missing;
  if (!capacity_) return missing;
  std::vector<std::vector<uint32_t>> per_shard(shards_.size());
  for (size_t i = 0; i < n; ++i) per_shard[shard_index(blocks[i])].push_back(blocks[i]);
  for (size_t i = 0; i < shards_.size(); ++i) {
    Shard& s = shards_[i];
    std::lock_guard<std::mutex> lk(s.mutex);
    if (s.block_of.empty()) continue;  // off: nothing pinned
    std::fill(s.pinned.begin(), s.pinned.end(), 0);
    s.num_pinned = 0;
    s.wanted.clear();
    for (uint32_t b : per_shard[i]) {
      if (s.wanted.size() >= pin_limit(s)) break;
      if (!s.wanted.insert(b).second) continue;
      const uint32_t f = s.frame_of.find(b);
      if (f == FrameMap::kNone) {
        missing.push_back(b);
      } else {
        s.pinned[f] = 1, ++s.num_pinned;
      }
    }
  }
  return missing;
}

size_t PageBuffer::pinned() {
  size_t total = 0;
  for (Shard& s : shards_) {
    std::lock_guard<std::mutex> lk(s.mutex);
    total += s.num_pinned;
  }
  return total;
}

void PageBuffer::clear() {
  for (Shard& s : shards_) {
    std::lock_guard<std::mutex> lk(s.mutex);
    reset(s);
    if (compressed_ && !s.block_of.empty()) init_chunks(s);
  }
  reset_miniature();
  if (mini_) lfu_mode_.store(true, std::memory_order_relaxed);
}

// Whether a record cached alone, with its metadata, costs less than its share of a block (index.py's
// records_cache_denser): an adaptive layout starts with records then, with blocks otherwise.
static bool records_denser(const PageLayout& layout) {
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
    std::unique_ptr<IoUring> ring;
    int err = UringReader::make_ring(ring);
    if (!err) {
      reader_.reset(new UringReader(path, fd_, layout.block_bytes(), std::move(ring)));
    } else if (io_backend == "io_uring") {
      ::close(fd_);
      throw OsError(err, path + ": io_uring is not available here: " + errno_text(err));
    }
  }
  if (!reader_) reader_.reset(new PreadReader(path, fd_, layout.block_bytes(), io_threads));
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

using namespace fusionrag;

namespace {

std::string policy_name(BufferPolicy p) {
  return p == BufferPolicy::Lfu ? "lfu" : p == BufferPolicy::Clock ? "clock" : "auto";
}

using U8Array = nb::ndarray<const uint8_t, nb::c_contig, nb::device::cpu>;
using U32Vector = nb::ndarray<const uint32_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using U8Matrix = nb::ndarray<const uint8_t, nb::ndim<2>, nb::c_contig, nb::device::cpu>;
using U8Vector = nb::ndarray<const uint8_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

size_t non_negative(int64_t v, const char* name) {
  if (v < 0) throw std::invalid_argument(std::string(name) + " must not be negative");
  return size_t(v);
}

PageLayout make_layout(int64_t record_bytes, int64_t records_per_block, int64_t pages_per_block) {
  return PageLayout(non_negative(record_bytes, "record_bytes"), non_negative(records_per_block, "records_per_block"),
                    non_negative(pages_per_block, "pages_per_block"));
}

}  // namespace

void bind_pagefile(nb::module_& m) {
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const OsError& e) {
      PyObject* args = Py_BuildValue("(is)", e.err, e.what());
      PyErr_SetObject(PyExc_OSError, args);
      Py_XDECREF(args);
    }
  });

  m.def(
      "crc32c",
      [](nb::bytes data, bool software) {
        nb::gil_scoped_release nogil;
        return crc32c(data.c_str(), data.size(), software);
      },
      "data"_a, "software"_a = false, "CRC32C (Castagnoli) of the bytes; software=True skips the SSE4.2 path.");
  m.def(
      "crc32c",
      [](U8Array data, bool software) {
        nb::gil_scoped_release nogil;
        return crc32c(data.data(), data.size(), software);
      },
      "data"_a.noconvert(), "software"_a = false);

  m.def(
      "zero_runs_gain",
      [](U8Matrix blocks) {
        const size_t n = blocks.shape(0), bb = blocks.shape(1);
        if (!n || !bb || bb % kChunkBytes)
          throw std::invalid_argument("blocks must be a non-empty uint8 matrix of rows of whole chunks");
        nb::gil_scoped_release nogil;
        std::vector<uint8_t> code(bb);
        size_t held = 0;
        for (size_t i = 0; i < n; ++i) {
          const size_t len = zero_runs_encode(blocks.data() + i * bb, bb, code.data());
          held += chunks_for(len ? len : bb) * kChunkBytes;
        }
        return double(n * bb) / double(held);
      },
      "blocks"_a.noconvert(),
      "How many times more of these blocks a compressed page buffer holds than a plain one (its chunks counted "
      "whole; 1.0: none of them codes shorter).");
  m.def(
      "zero_runs",
      [](U8Vector data) {
        const size_t n = data.shape(0);
        std::vector<uint8_t> code(n), back(n);
        size_t len;
        {
          nb::gil_scoped_release nogil;
          len = n ? zero_runs_encode(data.data(), n, code.data()) : 0;
          if (len) zero_runs_decode(code.data(), len, back.data(), n);
        }
        NumpyOut<uint8_t> coded({len}), decoded({len ? n : 0});
        std::copy(code.begin(), code.begin() + len, coded.data());
        std::copy(back.begin(), back.begin() + (len ? n : 0), decoded.data());
        return std::make_pair(coded.release(), decoded.release());
      },
      "data"_a.noconvert(),
      "(code, decoded): the page buffer's zero-run code of data (empty where it would not be shorter) and that "
      "code decoded again (tests).");
  m.def(
      "page_layout",
      [](int64_t record_bytes) {
        if (record_bytes <= 0) throw std::invalid_argument("record_bytes must be positive");
        size_t rb = size_t(record_bytes);
        if (rb <= kPageBytes) return std::make_pair(kPageBytes / rb, size_t(1));
        return std::make_pair(size_t(1), (rb + kPageBytes - 1) / kPageBytes);
      },
      "record_bytes"_a, "(records_per_block, pages_per_block) for records of this size.");

  nb::class_<PageWriter>(m, "PageWriter", "Streams records, in ascending slot order, into a new page file.")
      .def(
          "__init__",
          [](PageWriter* self, const std::string& path, int64_t record_bytes, int64_t records_per_block,
             int64_t pages_per_block) {
            new (self) PageWriter(path, make_layout(record_bytes, records_per_block, pages_per_block));
          },
          "path"_a, "record_bytes"_a, "records_per_block"_a, "pages_per_block"_a)
      .def(
          "write",
          [](PageWriter& w, U32Vector slots, U8Matrix records) {
            if (records.shape(0) != slots.shape(0) || records.shape(1) != w.record_bytes())
              throw std::invalid_argument("records must be uint8[" + std::to_string(slots.shape(0)) + ", " +
                                          std::to_string(w.record_bytes()) + "] to match slots and record_bytes");
            nb::gil_scoped_release nogil;
            w.write(slots.data(), slots.shape(0), records.data());
          },
          "slots"_a, "records"_a.noconvert())  // a cast would silently change the bytes
      .def(
          "close",
          [](PageWriter& w) {
            std::vector<uint32_t> crc;
            {
              nb::gil_scoped_release nogil;
              crc = w.close();
            }
            NumpyOut<uint32_t> out({crc.size()});
            std::copy(crc.begin(), crc.end(), out.data());
            return out.release();
          },
          "Flushes the last block, fsyncs, and returns the CRC32C of every block (uint32).")
      .def("__enter__", [](nb::handle self) { return self; })
      .def("__exit__", [](PageWriter& w, nb::args) {
        nb::gil_scoped_release nogil;
        w.close();
      });

  nb::class_<PageStore>(m, "PageStore", "Reads page-file blocks through a shared DRAM page buffer.")
      .def(
          "__init__",
          [](PageStore* self, const std::string& path, int64_t record_bytes, int64_t records_per_block,
             int64_t pages_per_block, U32Vector block_crc, int64_t buffer_blocks, const std::string& io_backend,
             const std::string& direct_io, int io_threads, const std::string& buffer_policy, int64_t record_cache,
             bool adaptive_layout, double compress_gain) {
            PageLayout layout = make_layout(record_bytes, records_per_block, pages_per_block);
            std::vector<uint32_t> crc(block_crc.data(), block_crc.data() + block_crc.shape(0));
            size_t capacity = non_negative(buffer_blocks, "buffer_blocks");
            size_t records = non_negative(record_cache, "record_cache");
            BufferPolicy policy = parse_buffer_policy(buffer_policy);
            nb::gil_scoped_release nogil;
            new (self)
                PageStore(path, layout, std::move(crc), capacity, io_backend, direct_io, io_threads, policy, records,
                          adaptive_layout, compress_gain);
          },
          "path"_a, "record_bytes"_a, "records_per_block"_a, "pages_per_block"_a, "block_crc"_a, "buffer_blocks"_a,
          "io_backend"_a = "auto", "direct_io"_a = "auto", "io_threads"_a = 8, "buffer_policy"_a = "clock",
          "record_cache"_a = 0, "adaptive_layout"_a = false, "compress_gain"_a = 0.0,
          "record_cache: records (not blocks) the record cache holds, beside the page buffer (0: none).\n"
          "adaptive_layout: the page buffer (buffer_blocks) and the record cache (record_cache) are two layouts of\n"
          "the same bytes, one on at a time, whichever a miniature of both serves more blocks from memory now.\n"
          "compress_gain > 1: the page buffer holds blocks zero-run coded in chunks of its same bytes, with entries\n"
          "for 1.25 x compress_gain x buffer_blocks blocks (zero_runs_gain of a sample of the blocks tells the gain).")
      .def_prop_ro("path", &PageStore::path)
      .def_prop_ro("backend", [](const PageStore& s) { return std::string(s.backend()); })
      .def_prop_ro("direct", &PageStore::direct)
      .def_prop_ro("fd", &PageStore::fd)
      .def_prop_ro("num_blocks", &PageStore::num_blocks)
      .def_prop_ro("record_bytes", [](const PageStore& s) { return s.layout().record_bytes; })
      .def_prop_ro("records_per_block", [](const PageStore& s) { return s.layout().records_per_block; })
      .def_prop_ro("pages_per_block", [](const PageStore& s) { return s.layout().pages_per_block; })
      .def_prop_ro("block_bytes", [](const PageStore& s) { return s.layout().block_bytes(); })
      .def_prop_ro("buffer_capacity", &PageStore::buffer_capacity)
      .def_prop_ro("buffer_compressed", &PageStore::buffer_compressed)
      .def_prop_ro("buffer_entries", &PageStore::buffer_entries, "Blocks the page buffer can hold at most.")
      .def_prop_ro("buffer_chunk_bytes",
                   [](PageStore& s) {
                     nb::gil_scoped_release nogil;
                     return s.buffer_chunk_bytes();
                   },
                   "Bytes of coded blocks a compressed page buffer holds now, chunks counted whole.")
      .def_prop_ro("buffer_bytes",
                   [](const PageStore& s) { return s.buffer_on() ? s.buffer_capacity() * s.layout().block_bytes() : 0; },
                   "Host bytes the page buffer may hold when full (0 while an adaptive layout holds records).")
      .def_prop_ro("record_cache_capacity", &PageStore::record_cache_capacity)
      .def_prop_ro("record_cache_bytes",
                   [](const PageStore& s) {
                     return s.records_on() ? s.record_cache_capacity() * (s.layout().record_bytes + kRecordCacheOverhead)
                                           : 0;
                   },
                   "Host bytes the record cache may hold when full: records and their metadata (0 while an adaptive "
                   "layout holds blocks).")
      .def_prop_ro("adaptive_layout", &PageStore::adaptive)
      .def_prop_ro("layout", [](const PageStore& s) { return std::string(s.records_on() ? "records" : "blocks"); },
                   "What the buffer's bytes hold now: 'records' (the record cache) or 'blocks' (the page buffer).")
      .def("wait_layout", &PageStore::wait_layout, nb::call_guard<nb::gil_scoped_release>(),
           "Waits for a switch of layout the miniature started (on a thread of its own).")
      .def("set_layout", [](PageStore& s, bool records, bool hold) {
             nb::gil_scoped_release nogil;
             s.set_layout(records, hold);
           }, "records"_a, "hold"_a = false,
           "An adaptive layout's switch, now: the layout given up is emptied. hold: its miniature switches no "
           "more (tests, benchmarks).")
      .def(
          "observe",
          [](PageStore& s, int64_t block, U32Vector slots) {
            if (block < 0 || uint64_t(block) >= s.num_blocks())
              throw std::invalid_argument("block " + std::to_string(block) + " out of range [0, " +
                                          std::to_string(s.num_blocks()) + ")");
            s.observe(uint32_t(block), slots.data(), slots.shape(0));
          },
          "block"_a, "slots"_a,
          "One query's touch of a block with the record slots of its candidates there, as a re-rank reports it to "
          "an adaptive layout's miniature (sampled blocks only; nothing without an adaptive layout).")
      .def_prop_ro_static("record_cache_overhead", [](nb::handle) { return kRecordCacheOverhead; },
                          "Bytes of metadata a record cache entry holds beside its record.")
      .def_static(
          "records_denser",
          [](int64_t record_bytes, int64_t records_per_block, int64_t pages_per_block) {
            return records_denser(make_layout(record_bytes, records_per_block, pages_per_block));
          },
          "record_bytes"_a, "records_per_block"_a, "pages_per_block"_a,
          "The byte rule: whether a record cached alone (its bytes and record_cache_overhead) costs less than its "
          "share of a block, as for records that leave part of their pages empty. An adaptive layout starts with "
          "records where it holds.")
      .def_prop_ro("buffer_policy", [](const PageStore& s) { return policy_name(s.buffer_policy()); })
      .def_prop_ro("buffer_mode", [](const PageStore& s) { return policy_name(s.buffer_mode()); },
                   "The policy the page buffer runs now: 'clock' or 'lfu' ('auto' switches between them).")
      .def(
          "pin",
          [](PageStore& s, U32Vector blocks) {
            nb::gil_scoped_release nogil;
            return s.pin(blocks.data(), blocks.shape(0));
          },
          "blocks"_a,
          "Pins these blocks (most wanted first) in the page buffer in place of those pinned before, reading the ones "
          "not there; at most 3/4 of each buffer shard is pinned. Returns how many blocks are pinned.")
      .def(
          "resident",
          [](PageStore& s, U32Vector blocks) {
            const size_t n = blocks.shape(0);
            NumpyOut<uint8_t> out({n});
            {
              nb::gil_scoped_release nogil;
              for (size_t i = 0; i < n; ++i) out.data()[i] = s.resident(blocks.data()[i]);
            }
            return out.release();
          },
          "blocks"_a, "uint8[n]: whether each block is in the page buffer now (reads nothing).")
      .def(
          "read_block",
          [](PageStore& s, int64_t block) {
            if (block < 0 || uint64_t(block) >= s.num_blocks())
              throw std::invalid_argument("block " + std::to_string(block) + " out of range [0, " +
                                          std::to_string(s.num_blocks()) + ")");
            AlignedBuffer buf;
            uint32_t b = uint32_t(block);
            {
              nb::gil_scoped_release nogil;
              s.fetch(&b, 1, buf.get(s.layout().block_bytes()));
            }
            return nb::bytes(buf.ptr.get(), s.layout().block_bytes());
          },
          "block"_a, "One block's bytes, through the page buffer.")
      .def(
          "read_blocks",
          [](PageStore& s, U32Vector blocks) {
            const size_t n = blocks.shape(0), bb = s.layout().block_bytes();
            NumpyOut<uint8_t> out({n, bb});
            {
              nb::gil_scoped_release nogil;
              s.fetch(blocks.data(), n, out.data());
            }
            return out.release();
          },
          "blocks"_a, "Several blocks (uint8[n, block_bytes]), the misses read in one batch.")
      .def("reset_buffer", &PageStore::reset_buffer, nb::call_guard<nb::gil_scoped_release>(),
           "Empties the page buffer.")
      .def("set_trace", &PageStore::set_trace, "on"_a,
           "Record every block asked of the store, in order, with its weight (bench/cache/cache_sim.py).")
      .def(
          "take_trace",
          [](PageStore& s) {
            std::vector<uint32_t> t = s.take_trace();
            NumpyOut<uint32_t> out({t.size() / 2, size_t(2)});
            std::memcpy(out.data(), t.data(), t.size() * sizeof(uint32_t));
            return out.release();
          },
          "The recorded calls, oldest first, and clears them: uint32[rows, 2], each call a row (0xFFFFFFFF, n) and "
          "its n requests (block, how many queries asked). A call looks all its blocks up in the page buffer, "
          "then inserts those it read, in order.")
      .def(
          "stats",
          [](PageStore& s) {
            PageStoreStats st = s.stats();
            nb::dict d;
            d["blocks_read"] = st.blocks_read;
            d["blocks_from_buffer"] = st.blocks_from_buffer;
            d["read_calls"] = st.read_calls;
            d["evictions"] = st.evictions;
            d["pin_reads"] = st.pin_reads;
            d["pinned"] = st.pinned;
            d["read_ahead"] = st.read_ahead;
            d["read_ahead_unused"] = st.read_ahead_unused;
            d["policy_switches"] = st.policy_switches;
            d["record_lookups"] = st.record_lookups;
            d["records_from_cache"] = st.records_from_cache;
            d["layout_switches"] = st.layout_switches;
            return d;
          },
          "Cumulative counters: blocks_read (from the SSD, for fetches, read-ahead included), blocks_from_buffer, "
          "read_calls (batched submissions), evictions, pin_reads (blocks read from the SSD to pin them), "
          "read_ahead (blocks read for a re-rank's next mini-batches before it asked: rerank(prefetch=True)), "
          "read_ahead_unused (of those, the ones no mini-batch took: early stops' wasted reads); and pinned, the "
          "blocks pinned now; policy_switches (buffer_policy 'auto': times it changed between clock and lfu); "
          "record_lookups (candidates a re-rank asked of the record cache) and records_from_cache (of those, found); "
          "layout_switches (adaptive_layout: times it changed between blocks and records).");
}
