// Block I/O: the two BlockReader implementations, reading whole page-file blocks with O_DIRECT via io_uring or
// a pread thread pool, and the 4096-aligned memory those reads land in.
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <condition_variable>
#include <cstdlib>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "io_uring.h"
#include "pagefile.h"

namespace fusionrag {

namespace {

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

}  // namespace

uint8_t* AlignedBuffer::get(size_t need) {
  if (need > bytes) {
    void* p = nullptr;
    if (posix_memalign(&p, kPageBytes, need)) throw std::bad_alloc();
    ptr.reset(static_cast<uint8_t*>(p));
    bytes = need;
  }
  return ptr.get();
}

int make_uring_reader(const std::string& path, int fd, size_t block_bytes, std::unique_ptr<BlockReader>& reader) {
  std::unique_ptr<IoUring> ring;
  int err = UringReader::make_ring(ring);
  if (!err) reader.reset(new UringReader(path, fd, block_bytes, std::move(ring)));
  return err;
}

std::unique_ptr<BlockReader> make_pread_reader(const std::string& path, int fd, size_t block_bytes, int threads) {
  return std::unique_ptr<BlockReader>(new PreadReader(path, fd, block_bytes, threads));
}

}  // namespace fusionrag
