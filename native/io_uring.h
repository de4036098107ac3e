// A minimal io_uring on the raw syscalls (liburing is not a dependency): enough to
// queue a batch of reads, submit them with one system call and reap them all.
#pragma once
#include <linux/io_uring.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <vector>

namespace fusionrag {

class IoUring {
 public:
  IoUring() = default;
  IoUring(const IoUring&) = delete;
  IoUring& operator=(const IoUring&) = delete;
  ~IoUring() {
    if (sqes_) munmap(sqes_, sqes_bytes_);
    if (cq_ring_) munmap(cq_ring_, cq_bytes_);
    if (sq_ring_) munmap(sq_ring_, sq_bytes_);
    if (fd_ >= 0) close(fd_);
  }

  // Returns 0, or the errno that says why this kernel gives us no usable ring:
  // ENOSYS (no io_uring), EPERM (io_uring_disabled, seccomp), EOPNOTSUPP (older
  // than 5.6, which lacks IORING_OP_READ).
  int init(unsigned entries) {
    io_uring_params p{};
    fd_ = static_cast<int>(syscall(__NR_io_uring_setup, entries, &p));
    if (fd_ < 0) return errno;
    if (!supports_read()) return EOPNOTSUPP;
    sq_bytes_ = p.sq_off.array + p.sq_entries * sizeof(unsigned);
    cq_bytes_ = p.cq_off.cqes + p.cq_entries * sizeof(io_uring_cqe);
    sqes_bytes_ = p.sq_entries * sizeof(io_uring_sqe);
    sq_ring_ = map(sq_bytes_, IORING_OFF_SQ_RING);
    cq_ring_ = map(cq_bytes_, IORING_OFF_CQ_RING);
    sqes_ = static_cast<io_uring_sqe*>(map(sqes_bytes_, IORING_OFF_SQES));
    if (!sq_ring_ || !cq_ring_ || !sqes_) return errno;
    auto at = [](void* base, unsigned off) { return reinterpret_cast<unsigned*>(static_cast<char*>(base) + off); };
    sq_tail_ = at(sq_ring_, p.sq_off.tail);
    sq_mask_ = *at(sq_ring_, p.sq_off.ring_mask);
    sq_array_ = at(sq_ring_, p.sq_off.array);
    cq_head_ = at(cq_ring_, p.cq_off.head);
    cq_tail_ = at(cq_ring_, p.cq_off.tail);
    cq_mask_ = *at(cq_ring_, p.cq_off.ring_mask);
    cqes_ = reinterpret_cast<io_uring_cqe*>(static_cast<char*>(cq_ring_) + p.cq_off.cqes);
    entries_ = p.sq_entries;
    return 0;
  }

  unsigned entries() const { return entries_; }

  // Queues one read; at most entries() may be queued before submit_and_reap.
  void prep_read(int fd, void* buf, unsigned len, uint64_t offset, uint64_t user_data) {
    unsigned idx = tail_ & sq_mask_;
    io_uring_sqe& e = sqes_[idx];
    std::memset(&e, 0, sizeof e);
    e.opcode = IORING_OP_READ;
    e.fd = fd;
    e.addr = reinterpret_cast<uint64_t>(buf);
    e.len = len;
    e.off = offset;
    e.user_data = user_data;
    sq_array_[idx] = idx;
    ++tail_;
    ++queued_;
  }

  // Submits what is queued without waiting for it: reap() collects it later, so
  // the caller may compute meanwhile. Returns 0 or the errno of io_uring_enter.
  int submit() {
    unsigned to_submit = queued_;
    __atomic_store_n(sq_tail_, tail_, __ATOMIC_RELEASE);
    queued_ = 0;
    while (to_submit) {
      long r = syscall(__NR_io_uring_enter, fd_, to_submit, 0, 0, nullptr, 0);
      if (r < 0) {
        if (errno == EINTR || errno == EAGAIN || errno == EBUSY) continue;
        return errno;  // what did go out can still be reaped
      }
      to_submit -= static_cast<unsigned>(r);
      submitted_ += static_cast<unsigned>(r);
    }
    return 0;
  }

  // Waits for everything submit() sent, calling on_done(user_data, res) for each.
  // Returns 0 or the errno of io_uring_enter (then the ring must be thrown away).
  template <class F>
  int reap(F&& on_done) {
    while (submitted_) {
      unsigned head = *cq_head_, tail = __atomic_load_n(cq_tail_, __ATOMIC_ACQUIRE);
      for (; head != tail && submitted_; ++head, --submitted_) {
        const io_uring_cqe& c = cqes_[head & cq_mask_];
        on_done(c.user_data, c.res);
      }
      __atomic_store_n(cq_head_, head, __ATOMIC_RELEASE);
      if (!submitted_) break;
      long r = syscall(__NR_io_uring_enter, fd_, 0, submitted_, IORING_ENTER_GETEVENTS, nullptr, 0);
      if (r < 0 && errno != EINTR && errno != EAGAIN && errno != EBUSY) return errno;
    }
    return 0;
  }

  // Submits what is queued and reaps exactly that many completions, calling
  // on_done(user_data, res) for each. Returns 0 or the errno of io_uring_enter;
  // on an error the ring may still own requests and must be thrown away.
  template <class F>
  int submit_and_reap(F&& on_done) {
    unsigned to_submit = queued_, left = queued_;
    __atomic_store_n(sq_tail_, tail_, __ATOMIC_RELEASE);
    queued_ = 0;
    while (left) {
      unsigned head = *cq_head_, tail = __atomic_load_n(cq_tail_, __ATOMIC_ACQUIRE);
      for (; head != tail && left; ++head, --left) {
        const io_uring_cqe& c = cqes_[head & cq_mask_];
        on_done(c.user_data, c.res);
      }
      __atomic_store_n(cq_head_, head, __ATOMIC_RELEASE);
      if (!left) break;
      // The kernel waits only when it took every queued entry, so a partial
      // submission loops back here instead of blocking on reads never sent.
      long r = syscall(__NR_io_uring_enter, fd_, to_submit, left, IORING_ENTER_GETEVENTS, nullptr, 0);
      if (r < 0) {
        if (errno == EINTR || errno == EAGAIN || errno == EBUSY) continue;
        return errno;
      }
      to_submit -= static_cast<unsigned>(r);
    }
    return 0;
  }

 private:
  bool supports_read() {
    std::vector<char> buf(sizeof(io_uring_probe) + 256 * sizeof(io_uring_probe_op), 0);
    auto probe = reinterpret_cast<io_uring_probe*>(buf.data());
    if (syscall(__NR_io_uring_register, fd_, IORING_REGISTER_PROBE, probe, 256) < 0) return false;
    return probe->ops_len > IORING_OP_READ && (probe->ops[IORING_OP_READ].flags & IO_URING_OP_SUPPORTED);
  }

  void* map(size_t bytes, uint64_t offset) {
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd_, static_cast<off_t>(offset));
    return p == MAP_FAILED ? nullptr : p;
  }

  int fd_ = -1;
  void *sq_ring_ = nullptr, *cq_ring_ = nullptr;
  io_uring_sqe* sqes_ = nullptr;
  io_uring_cqe* cqes_ = nullptr;
  size_t sq_bytes_ = 0, cq_bytes_ = 0, sqes_bytes_ = 0;
  unsigned *sq_tail_ = nullptr, *sq_array_ = nullptr, *cq_head_ = nullptr, *cq_tail_ = nullptr;
  unsigned sq_mask_ = 0, cq_mask_ = 0, entries_ = 0, tail_ = 0, queued_ = 0, submitted_ = 0;
};

}  // namespace fusionrag
