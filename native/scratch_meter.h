// Bytes the search kernels keep per thread between calls (thread-local scratch: the graph's visited tags, a
// scan's seen-bitmap, a batch plan's masks, and their smaller buffers). They grow with the index (4 B per
// centroid, N / 8 or N bytes per vector) and live as long as their thread, one copy per thread that ever
// searched, so a process's total is counted here: native.scratch_bytes(). The re-rank's scratch is kept in a pool
// between calls instead (rerank.cpp, ScratchPool), and counted here while kept.
#pragma once
#include <atomic>
#include <cstddef>
#include <cstdint>

namespace fusionrag {

inline std::atomic<int64_t>& scratch_total() {
  static std::atomic<int64_t> total{0};
  return total;
}

// Bytes of the buffers' capacity (what they hold allocated, not what they use now); also Graph::memory_bytes's.
template <class... V>
size_t capacity_bytes(const V&... v) {
  return (size_t(0) + ... + (v.capacity() * sizeof(typename V::value_type)));
}

// One thread's scratch in the total: settle(bytes) after a use records what it holds now; destroyed with its
// thread, it takes that back.
class ScratchMeter {
 public:
  ScratchMeter() = default;
  ScratchMeter(const ScratchMeter&) = delete;
  ScratchMeter& operator=(const ScratchMeter&) = delete;
  ~ScratchMeter() { scratch_total().fetch_sub(held_, std::memory_order_relaxed); }
  void settle(size_t bytes) {
    const int64_t now = int64_t(bytes);
    if (now != held_) scratch_total().fetch_add(now - held_, std::memory_order_relaxed), held_ = now;
  }

 private:
  int64_t held_ = 0;
};

// Settles a scratch's meter when a use of it ends, however it ends (an exception included).
template <class S>
struct SettleOnExit {
  S& s;
  ~SettleOnExit() { s.meter.settle(s.bytes()); }
};

}  // namespace fusionrag
