// Heuristic re-ranking (FusionANNS, Algorithm 1): exact distances on raw vectors
// read from the SSD in mini-batches, stopping once the top-k has held still for
// beta mini-batches in a row. With page-mates on, a block read for a mini-batch
// also scores the query's later candidates stored in it: they cost no read, the
// build puts near vectors on the same page, and their own mini-batch later has
// nothing to read for them. With prefetch on, the reads of the next mini-batches
// are in flight while this one is scored. With resident-first on, a query's first
// round also scores every later candidate whose block is in the page buffer then:
// a copy from DRAM, no read, and the top-k starts nearer where it ends, so it
// holds still after fewer SSD reads. With a record cache in the store, a block whose
// candidates of the round are all cached is scored from there and not asked for.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "distance.h"
#include "numpy_out.h"
#include "pagefile.h"
#include "scratch_meter.h"
#include "threadpool.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace fusionrag {
namespace {

struct Distance {
  RecordDistanceFn fn;
  size_t elem_bytes;
};

Distance pick_distance(const std::string& dtype, const std::string& metric) {
  if (dtype == "f32") return {record_distance<float>(parse_metric(metric)), 4};
  if (dtype == "u8") return {record_distance<uint8_t>(parse_metric(metric)), 1};
  if (dtype == "i8") return {record_distance<int8_t>(parse_metric(metric)), 1};
  throw std::invalid_argument("dtype must be 'f32', 'u8' or 'i8', not '" + dtype + "'");
}

using Queries = nb::ndarray<const float, nb::ndim<2>, nb::c_contig, nb::device::cpu>;
using IdMatrix = nb::ndarray<const int64_t, nb::ndim<2>, nb::c_contig, nb::device::cpu>;
using Locations = nb::ndarray<const uint32_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

// What both entry points share: the store, the id -> slot map and the distance.
struct Exact {
  PageStore& store;
  const uint32_t* locations;
  size_t num_ids, dim;
  RecordDistanceFn distance;

  Exact(PageStore& store, const Queries& queries, const Locations& locations, const std::string& dtype,
        const std::string& metric)
      : store(store), locations(locations.data()), num_ids(locations.shape(0)), dim(queries.shape(1)) {
    Distance d = pick_distance(dtype, metric);
    distance = d.fn;
    if (dim * d.elem_bytes != store.layout().record_bytes)
      throw std::invalid_argument("queries have " + std::to_string(dim) + " dims of " + dtype + ", which is " +
                                  std::to_string(dim * d.elem_bytes) + " bytes, but the page file holds records of " +
                                  std::to_string(store.layout().record_bytes) + " bytes");
  }

  // Checks ids against the map and the file: up to the first -1, or all of them
  // when -1 is a hole rather than the end.
  void validate(const int64_t* ids, size_t n, bool stop_at_padding) const {
    for (size_t j = 0; j < n; ++j) {
      int64_t id = ids[j];
      if (id == -1) {
        if (stop_at_padding) return;
        continue;
      }
      if (id < 0 || uint64_t(id) >= num_ids)
        throw std::invalid_argument("candidate id " + std::to_string(id) + " is outside [0, " +
                                    std::to_string(num_ids) + ") of locations");
      if (store.layout().block_of(locations[id]) >= store.num_blocks())
        throw std::invalid_argument("id " + std::to_string(id) + " maps to slot " + std::to_string(locations[id]) +
                                    ", past the end of the page file");
    }
  }

  // Appends the block of each id >= 0 of ids[0, n).
  void add_blocks(const int64_t* ids, size_t n, std::vector<uint32_t>& blocks) const {
    for (size_t j = 0; j < n; ++j)
      if (ids[j] >= 0) blocks.push_back(uint32_t(store.layout().block_of(locations[ids[j]])));
  }

  // Sorts and de-duplicates blocks, then reads them, one after another, into
  // scratch, which it returns; read_from_ssd as for PageStore::fetch. With
  // weights, each block's weight is how often blocks held it (how many queries
  // asked for it, when each query's blocks were distinct).
  const uint8_t* fetch(std::vector<uint32_t>& blocks, AlignedBuffer& scratch, uint8_t* read_from_ssd = nullptr,
                       std::vector<uint32_t>* weights = nullptr, ReadAhead* ahead = nullptr) const {
    distinct(blocks, weights);
    return fetch_distinct(blocks, scratch, read_from_ssd, weights, ahead);
  }
  // fetch's first half: blocks sorted and de-duplicated, with weights their counts.
  static void distinct(std::vector<uint32_t>& blocks, std::vector<uint32_t>* weights) {
    std::sort(blocks.begin(), blocks.end());
    if (weights) {
      weights->clear();
      size_t out = 0;
      for (size_t i = 0; i < blocks.size(); ++out) {
        size_t j = i;
        while (j < blocks.size() && blocks[j] == blocks[i]) ++j;
        blocks[out] = blocks[i], weights->push_back(uint32_t(j - i));
        i = j;
      }
      blocks.resize(out);
    } else {
      blocks.erase(std::unique(blocks.begin(), blocks.end()), blocks.end());
    }
  }
  // fetch's second half, of blocks distinct() made.
  const uint8_t* fetch_distinct(const std::vector<uint32_t>& blocks, AlignedBuffer& scratch, uint8_t* read_from_ssd,
                                const std::vector<uint32_t>* weights, ReadAhead* ahead) const {
    uint8_t* data = scratch.get(std::max<size_t>(1, blocks.size()) * store.layout().block_bytes());
    store.fetch(blocks.data(), blocks.size(), data, read_from_ssd, weights ? weights->data() : nullptr, ahead);
    return data;
  }

  uint64_t block_of(int64_t id) const { return store.layout().block_of(locations[id]); }

  // The distance from q to id's record, found in data, which holds `blocks`
  // (sorted, distinct) one after another.
  float distance_in(const float* q, int64_t id, const std::vector<uint32_t>& blocks, const uint8_t* data) const {
    return distance(q, record_in(locations[id], blocks, data), dim);
  }

  // Where slot's record lies in data, which holds `blocks` (sorted, distinct, slot's among them) one after another.
  const uint8_t* record_in(uint32_t slot, const std::vector<uint32_t>& blocks, const uint8_t* data) const {
    const PageLayout& layout = store.layout();
    size_t b = std::lower_bound(blocks.begin(), blocks.end(), uint32_t(layout.block_of(slot))) - blocks.begin();
    return data + b * layout.block_bytes() + layout.offset_in_block(slot);
  }

  // Writes each id's distance from q to out (inf for -1), its record found in
  // data, which holds `blocks` (sorted, distinct) one after another.
  void distances_in(const float* q, const int64_t* ids, size_t n, const std::vector<uint32_t>& blocks,
                    const uint8_t* data, float* out) const {
    for (size_t j = 0; j < n; ++j)
      out[j] = ids[j] < 0 ? std::numeric_limits<float>::infinity() : distance_in(q, ids[j], blocks, data);
  }
};

struct RerankParams {
  size_t k, minibatch;
  float eps;
  int64_t beta;
  bool page_mates, prefetch, resident_first;
  // Whether a query tracks which candidates have a distance (by_block, scored).
  bool tracks() const { return page_mates || resident_first; }
};

// The early stop of Algorithm 1: Delta = |S_n \ S_{n-1}| / k, the share of the top-k a mini-batch changed; a
// mini-batch with Delta <= eps is stable (the first never is), and a query stops after beta stable ones in a row
// (beta 0: never early).
struct StopRule {
  int64_t batches = 0, stable = 0;
  std::vector<int64_t> top, prev_top;

  void reset() { batches = stable = 0, prev_top.clear(); }
  // After a mini-batch: the top-k's ids now (the heap's, any order).
  template <class Heap>
  void update(const Heap& heap, const RerankParams& p) {
    ++batches;
    top.clear();
    for (const auto& h : heap) top.push_back(h.second);
    std::sort(top.begin(), top.end());
    size_t kept = 0;
    for (size_t a = 0, b = 0; a < top.size() && b < prev_top.size();) {
      if (top[a] < prev_top[b]) ++a;
      else if (prev_top[b] < top[a]) ++b;
      else ++kept, ++a, ++b;
    }
    const float delta = float(top.size() - kept) / float(p.k);
    stable = (batches > 1 && delta <= p.eps) ? stable + 1 : 0;
    std::swap(top, prev_top);
  }
  bool stopped(const RerankParams& p) const { return p.beta > 0 && stable >= p.beta; }
  // One stable mini-batch from the stop: the next one is likely never read (prefetch leaves it out).
  bool one_from_stop(const RerankParams& p) const { return p.beta > 1 && stable == p.beta - 1; }
  size_t bytes() const { return capacity_bytes(top, prev_top); }
};

// One query's progress through Algorithm 1. It advances one mini-batch at a
// time, so that a worker can keep several queries in flight and read the blocks
// of all their next mini-batches together.
struct QueryState {
  size_t row = 0, pos = 0, end = 0;  // candidates [pos, end) are still to re-rank, less those scored
  bool live = false;
  std::vector<int64_t> batch;        // the next mini-batch: candidate ids, and their positions
  std::vector<uint32_t> batch_pos;
  // Of the mini-batch, those the record cache held: ids, exact distances, positions.
  std::vector<int64_t> hit_ids;
  std::vector<float> hit_dist;
  std::vector<uint32_t> hit_pos;
  // Page-mates or resident-first only: (block, position) of every candidate, sorted, and which have a distance.
  std::vector<std::pair<uint32_t, uint32_t>> by_block;
  std::vector<uint8_t> scored;
  // Max-heap on (distance, id): the root is the worst kept, ties keep the smaller id.
  std::vector<std::pair<float, int64_t>> heap;
  StopRule stop;
  int64_t from_ssd = 0, from_buffer = 0, reranked = 0, mates = 0, resident = 0, cached = 0;
  double seconds = 0;

  size_t bytes() const {
    return capacity_bytes(batch, batch_pos, hit_ids, hit_dist, hit_pos, by_block, scored, heap) + stop.bytes();
  }

  void start(size_t query, const int64_t* cand, size_t n, const Exact* tracked) {
    row = query, pos = 0, end = std::find(cand, cand + n, int64_t(-1)) - cand;
    live = true;
    heap.clear(), hit_ids.clear(), hit_dist.clear(), hit_pos.clear();
    stop.reset();
    from_ssd = from_buffer = reranked = mates = resident = cached = 0;
    seconds = 0;
    by_block.clear();
    if (!tracked) return;
    scored.assign(end, 0);
    for (size_t j = 0; j < end; ++j)
      if (cand[j] >= 0) by_block.push_back({uint32_t(tracked->block_of(cand[j])), uint32_t(j)});
    std::sort(by_block.begin(), by_block.end());
  }
  bool done(const RerankParams& p) const { return pos >= end || stop.stopped(p); }

  // Takes the next mini-batch, the next p.minibatch candidates, less those a
  // page-mate read already scored (they need no read; the batch may be empty).
  void next_batch(const int64_t* cand, const RerankParams& p) {
    batch.clear(), batch_pos.clear();
    for (const size_t stop = std::min(end, pos + p.minibatch); pos < stop; ++pos)
      if (!p.tracks() || !scored[pos]) batch.push_back(cand[pos]), batch_pos.push_back(uint32_t(pos));
  }

  // Calls fn(position) for each later candidate of the query stored in block b and not scored yet (the
  // mini-batch's page-mates there), until fn returns false. Page-mates or resident-first only (by_block).
  template <class Fn>
  void later_mates(uint32_t b, Fn&& fn) const {
    for (auto it = std::lower_bound(by_block.begin(), by_block.end(), std::make_pair(b, uint32_t(pos)));
         it != by_block.end() && it->first == b; ++it)
      if (!scored[it->second] && !fn(it->second)) return;
  }

  // Takes out of the mini-batch the blocks the record cache covers: a block whose candidates of this round
  // (the mini-batch's, and with page-mates the query's later unscored ones) are all cached is scored from
  // there and not read; the others stay to be read. So a round scores the same candidates, whichever memory
  // held them, and answers do not depend on the cache. record: scratch of record_bytes; by_b, keep: scratch.
  void take_cached(const Exact& ex, const float* q, const int64_t* cand, const RerankParams& p,
                   std::vector<uint8_t>& record, std::vector<std::pair<uint32_t, uint32_t>>& by_b,
                   std::vector<uint8_t>& keep, RecordTally& tally) {
    hit_ids.clear(), hit_dist.clear(), hit_pos.clear();
    by_b.clear();
    keep.assign(batch.size(), 1);
    for (size_t j = 0; j < batch.size(); ++j)
      if (batch[j] >= 0) by_b.push_back({uint32_t(ex.block_of(batch[j])), uint32_t(j)});
    std::sort(by_b.begin(), by_b.end());
    auto take = [&](int64_t id, uint32_t at) {
      if (!ex.store.lookup_record(ex.locations[id], record.data(), tally)) return false;
      hit_ids.push_back(id), hit_dist.push_back(ex.distance(q, record.data(), ex.dim)), hit_pos.push_back(at);
      return true;
    };
    for (auto a = by_b.begin(); a != by_b.end();) {
      const uint32_t b = a->first;
      auto e = a;
      const size_t mark = hit_ids.size();
      bool all = true;
      for (; e != by_b.end() && e->first == b; ++e) all &= take(batch[e->second], batch_pos[e->second]);
      size_t mates_here = 0;
      if (all && p.page_mates) later_mates(b, [&](uint32_t at) { return ++mates_here, all = take(cand[at], at); });
      if (all) {
        for (auto i = a; i != e; ++i) keep[i->second] = 0;
        ++from_buffer;  // a block touched and served from memory
        mates += int64_t(mates_here), cached += int64_t(hit_ids.size() - mark);
      } else {
        hit_ids.resize(mark), hit_dist.resize(mark), hit_pos.resize(mark);
      }
      a = e;
    }
    size_t out = 0;
    for (size_t j = 0; j < batch.size(); ++j)
      if (keep[j]) batch[out] = batch[j], batch_pos[out] = batch_pos[j], ++out;
    batch.resize(out), batch_pos.resize(out);
  }

  // Resident-first: appends to ids/dist every candidate not scored yet whose block
  // is in the page buffer now, copied from there into one (nothing read, nothing
  // counted by the buffer's policy), and marks them scored.
  void residents(const Exact& ex, const float* q, const int64_t* cand, AlignedBuffer& one, std::vector<int64_t>& ids,
                 std::vector<float>& dist) {
    const PageLayout& layout = ex.store.layout();
    uint8_t* data = one.get(layout.block_bytes());
    for (auto it = by_block.begin(); it != by_block.end();) {
      auto stop = it;
      bool wanted = false;
      for (; stop != by_block.end() && stop->first == it->first; ++stop) wanted |= !scored[stop->second];
      if (wanted && ex.store.peek(it->first, data))
        for (; it != stop; ++it) {
          if (scored[it->second]) continue;
          scored[it->second] = 1;
          const int64_t id = cand[it->second];
          ids.push_back(id);
          dist.push_back(ex.distance(q, data + layout.offset_in_block(ex.locations[id]), ex.dim));
          ++resident;
        }
      it = stop;
    }
  }

  // Appends to ids/dist the later candidates stored in the query's blocks `mine`
  // (sorted), found in data, which holds `blocks`; marks them and the batch scored.
  void page_mates(const Exact& ex, const float* q, const int64_t* cand, const std::vector<uint32_t>& mine,
                  const std::vector<uint32_t>& blocks, const uint8_t* data, std::vector<int64_t>& ids,
                  std::vector<float>& dist) {
    auto it = by_block.begin();
    for (uint32_t b : mine) {
      it = std::lower_bound(it, by_block.end(), std::make_pair(b, uint32_t(0)));
      for (; it != by_block.end() && it->first == b; ++it) {
        if (scored[it->second]) continue;
        scored[it->second] = 1;
        const int64_t id = cand[it->second];
        ids.push_back(id);
        dist.push_back(ex.distance_in(q, id, blocks, data));
        ++mates;
      }
    }
  }

  // Takes the exact distances of ids[0, n) (the mini-batch's candidates, then those
  // page-mates and resident-first scored with them) and applies the stop rule.
  void absorb(const int64_t* ids, const float* dist, size_t n, const RerankParams& p) {
    for (size_t j = 0; j < n; ++j) {
      std::pair<float, int64_t> e{dist[j], ids[j]};
      if (heap.size() == p.k && !(e < heap.front())) continue;
      // A candidate list may repeat an id (boundary replicas); keep it once.
      if (std::any_of(heap.begin(), heap.end(), [&](const auto& h) { return h.second == e.second; })) continue;
      heap.push_back(e);
      std::push_heap(heap.begin(), heap.end());
      if (heap.size() > p.k) {
        std::pop_heap(heap.begin(), heap.end());
        heap.pop_back();
      }
    }
    reranked += int64_t(n);
    stop.update(heap, p);
  }

  // Writes k ids and distances and the stats row.
  void finish(const RerankParams& p, int64_t* ids, float* dists, int64_t* stats, double* secs) {
    std::sort_heap(heap.begin(), heap.end());
    for (size_t j = 0; j < p.k; ++j) {
      ids[j] = j < heap.size() ? heap[j].second : -1;
      dists[j] = j < heap.size() ? heap[j].first : std::numeric_limits<float>::infinity();
    }
    stats[0] = stop.batches, stats[1] = reranked, stats[2] = from_ssd, stats[3] = from_buffer, stats[4] = mates;
    stats[5] = resident, stats[6] = cached;
    *secs = seconds;
    live = false;
  }
};

constexpr size_t kStats = 7;  // per query: see rerank's docstring

// One rerank call: its inputs and outputs.
struct RerankJob {
  const Exact& ex;
  RerankParams p;
  const float* queries;
  const int64_t* cand;
  size_t n;
  int64_t *ids, *stats;
  float* dists;
  double* seconds;

  const int64_t* row(const QueryState& st) const { return cand + st.row * n; }
  void finish(QueryState& st) const {
    const size_t i = st.row;
    st.finish(p, ids + i * p.k, dists + i * p.k, stats + i * kStats, seconds + i);
  }
};

// Chunks of queries per worker: fewer, larger chunks keep the slots refilled
// for longer (each chunk's last queries drain with slots idle), more balance the
// workers' load better. Synthetic 100k, 2 workers, 16 in flight: 2 chunks each
// kept 13.3 slots busy on average, 4 kept 11.2, fixed groups of 16 only 9.6.
constexpr size_t kChunksPerWorker = 2;

struct Scratch {
  std::vector<QueryState> slots;
  std::vector<uint32_t> blocks, mine, weights, next_blocks;
  // Prefetch: ahead[cur], the blocks read ahead for this round (its fetch takes them), and ahead[cur ^ 1], the
  // next round's, started before this round's fetch waits, so that both rounds' reads are in flight at once.
  ReadAhead ahead[2];
  size_t cur = 0;
  // For each ahead, the query (its row) each block was read ahead for, by block: one that no fetch takes counts as
  // read for that query, so that pages read summed over queries are the reads done.
  std::vector<std::pair<uint32_t, uint32_t>> owners[2], next_owned;
  std::vector<uint32_t> unused;
  std::vector<uint8_t> unclaimed;  // per block of the round: read from the SSD, not yet counted
  AlignedBuffer data, one;  // one: a block peeked from the buffer (resident-first)
  std::vector<float> dist;
  std::vector<int64_t> ids;
  std::vector<uint8_t> record;  // one record from the record cache
  std::vector<std::pair<uint32_t, uint32_t>> by_b, sampled;
  std::vector<uint32_t> sampled_slots;
  std::vector<uint8_t> keep;
  RecordTally tally;  // the round's record cache requests and hits, for the store's stats
  ScratchMeter meter;  // its bytes in native.scratch_bytes() while it is kept (ScratchPool)

  size_t bytes() const {
    size_t n = capacity_bytes(slots, blocks, mine, weights, next_blocks, owners[0], owners[1], next_owned, unused,
                              unclaimed, dist, ids, record, by_b, sampled, sampled_slots, keep);
    for (const QueryState& st : slots) n += st.bytes();
    return n + data.bytes + one.bytes + ahead[0].bytes() + ahead[1].bytes();
  }
};

// Re-rank scratch kept between calls: a call takes one per worker and gives them back, so that a round's buffers
// (its blocks, the read-ahead's) are allocated once, not on every call. Allocated per call, they were freed into the
// malloc arenas of whichever threads had run the call, and the process's peak RSS grew with the churn: MiniLM, the
// lean build with half its page buffer, 2 threads, bench/harness/runner.py's sweep, 13.8 MiB net peak with read-ahead on
// against 9.8 off; kept, 10.6 against 9.9. At most kIdle are kept, of at most kIdleBytes together; a fetch buffer
// above kKeepBytes is freed when given back. give() allocates nothing (idle_ is reserved): a lease's destructor
// calls it.
class ScratchPool {
 public:
  static ScratchPool& instance() {
    static ScratchPool pool;
    return pool;
  }
  ScratchPool() { idle_.reserve(kIdle); }
  std::unique_ptr<Scratch> take() {
    std::lock_guard<std::mutex> lk(mutex_);
    if (idle_.empty()) return std::make_unique<Scratch>();
    std::unique_ptr<Scratch> s = std::move(idle_.back());
    idle_.pop_back();
    idle_bytes_ -= s->bytes();
    return s;
  }
  void give(std::unique_ptr<Scratch> s) {
    if (s->data.bytes > kKeepBytes) s->data.ptr.reset(), s->data.bytes = 0;
    const size_t bytes = s->bytes();
    s->meter.settle(bytes);
    std::lock_guard<std::mutex> lk(mutex_);
    if (idle_.size() < kIdle && idle_bytes_ + bytes <= kIdleBytes) idle_.push_back(std::move(s)), idle_bytes_ += bytes;
  }

 private:
  static constexpr size_t kKeepBytes = 1 << 20, kIdleBytes = 64 << 20;
  const size_t kIdle = 2 * ThreadPool::instance().size();
  std::mutex mutex_;
  std::vector<std::unique_ptr<Scratch>> idle_;
  size_t idle_bytes_ = 0;
};

// One call's scratch, a Scratch per worker from the pool; given back however the call ends, its reads ahead
// waited for and settled first (an exception may leave some in flight).
class ScratchLease {
 public:
  ScratchLease(PageStore& store, size_t workers) : store_(store) {
    for (size_t i = 0; i < workers; ++i) held_.push_back(ScratchPool::instance().take());
  }
  ~ScratchLease() {
    for (std::unique_ptr<Scratch>& s : held_) {
      for (size_t which = 0; which < 2; ++which) store_.settle(s->ahead[which]), s->owners[which].clear();
      s->cur = 0;
      ScratchPool::instance().give(std::move(s));
    }
  }
  Scratch& operator[](size_t worker) { return *held_[worker]; }
  size_t size() const { return held_.size(); }

 private:
  PageStore& store_;
  std::vector<std::unique_ptr<Scratch>> held_;
};

// An adaptive layout's miniature learns of every query's touch of each sampled block, with the slots of the
// candidates the round scores from it, whichever layout is on (PageStore::observe): the mini-batch's, and with
// page-mates the query's later unscored ones, which the record cache must hold too for the block to be skipped.
void observe_round(const Exact& ex, const QueryState& st, const int64_t* cand, const RerankParams& p, Scratch& s) {
  s.sampled.clear();
  for (int64_t id : st.batch) {
    if (id < 0) continue;
    const uint32_t b = uint32_t(ex.block_of(id));
    if (!ex.store.layout_sampled(b)) continue;
    s.sampled.push_back({b, ex.locations[id]});
    if (p.page_mates) st.later_mates(b, [&](uint32_t at) { return s.sampled.push_back({b, ex.locations[cand[at]]}), true; });
  }
  std::sort(s.sampled.begin(), s.sampled.end());
  s.sampled.erase(std::unique(s.sampled.begin(), s.sampled.end()), s.sampled.end());
  std::vector<uint32_t>& slots = s.sampled_slots;
  for (size_t a = 0; a < s.sampled.size();) {
    size_t e = a;
    slots.clear();
    for (; e < s.sampled.size() && s.sampled[e].first == s.sampled[a].first; ++e) slots.push_back(s.sampled[e].second);
    ex.store.observe(s.sampled[a].first, slots.data(), slots.size());
    a = e;
  }
}

// Prefetch: starts reading the blocks of each live query's next mini-batch, as it
// will be if the query goes on (its next candidates, less those scored already or
// about to be as page-mates of this round's blocks), so that the reads overlap this
// round's reads and scoring. It runs before this round's fetch waits (two rounds' reads
// share one round trip of the SSD), so where a page buffer takes the blocks this round
// reads (s.blocks, distinct) it leaves them out, as it left out blocks resident when it
// ran after the fetch. A query one stable mini-batch from its stop is left out: its next
// mini-batch is likely never read. With beta 1 every round may be a query's last, so
// all are read ahead, and a query the stop ends leaves its blocks read for nothing
// (the store counts them as read_ahead_unused).
// Settles s.ahead[which]: the blocks read ahead that no fetch took count as read from the SSD for the query they
// were read for (its stats row, or its slot while it is live).
void settle_ahead(const RerankJob& job, Scratch& s, size_t which) {
  s.unused.clear();
  job.ex.store.settle(s.ahead[which], &s.unused);
  const auto& owners = s.owners[which];
  for (uint32_t b : s.unused) {
    auto at = std::lower_bound(owners.begin(), owners.end(), std::make_pair(b, uint32_t(0)));
    if (at == owners.end() || at->first != b) continue;
    const size_t row = at->second;
    auto st = std::find_if(s.slots.begin(), s.slots.end(), [&](const QueryState& q) { return q.live && q.row == row; });
    if (st != s.slots.end()) ++st->from_ssd;
    else ++job.stats[row * kStats + 2];
  }
  s.owners[which].clear();
}

// At most this many bytes of blocks are read ahead at a time per worker (two rounds' worth are held): a few queries
// in flight get all of their next mini-batches read ahead; many share their reads of a round anyway, and gain little
// more from it than the memory it would hold (uncapped, 16 queries' mini-batches of 8 blocks of 4 KiB: 512 KiB a
// round).
constexpr size_t kAheadBytes = 128 << 10;

void read_next(const RerankJob& job, Scratch& s, size_t which) {
  const Exact& ex = job.ex;
  const RerankParams& p = job.p;
  const bool buffered = ex.store.buffer_on();
  const size_t cap = std::max<size_t>(p.minibatch, kAheadBytes / ex.store.layout().block_bytes());
  s.next_owned.clear();
  for (QueryState& st : s.slots) {
    if (s.next_owned.size() >= cap) break;  // whole queries' mini-batches, in slot order
    if (!st.live || st.pos >= st.end || st.stop.one_from_stop(p)) continue;
    if (p.page_mates) {
      s.mine.clear();
      ex.add_blocks(st.batch.data(), st.batch.size(), s.mine);
      std::sort(s.mine.begin(), s.mine.end());
    }
    const int64_t* cand = job.row(st);
    for (size_t j = st.pos, stop = std::min(st.end, st.pos + p.minibatch); j < stop; ++j) {
      // A cached record's block is left to the round: most are scored from the record cache.
      if (cand[j] < 0 || (p.tracks() && st.scored[j]) || ex.store.record_cached(ex.locations[cand[j]])) continue;
      const uint32_t b = uint32_t(ex.block_of(cand[j]));
      if (p.page_mates && std::binary_search(s.mine.begin(), s.mine.end(), b)) continue;
      if (buffered && std::binary_search(s.blocks.begin(), s.blocks.end(), b)) continue;
      s.next_owned.push_back({b, uint32_t(st.row)});
    }
  }
  // A block several queries want is read for the first of them.
  std::sort(s.next_owned.begin(), s.next_owned.end());
  s.next_owned.erase(std::unique(s.next_owned.begin(), s.next_owned.end(),
                                 [](const auto& a, const auto& b) { return a.first == b.first; }),
                     s.next_owned.end());
  s.next_blocks.clear();
  for (const auto& o : s.next_owned) s.next_blocks.push_back(o.first);
  settle_ahead(job, s, which);
  std::swap(s.owners[which], s.next_owned);
  ex.store.read_ahead(s.ahead[which], s.next_blocks.data(), s.next_blocks.size());
}

// Offers ids[0, n) (ids >= 0, their blocks in the round's s.blocks, read into s.data) to the record cache;
// those from `asked` on were not looked up in it yet and count as requested first.
void offer_records(const Exact& ex, const int64_t* ids, size_t n, size_t asked, Scratch& s) {
  for (size_t j = 0; j < n; ++j) {
    if (ids[j] < 0) continue;
    const uint32_t slot = ex.locations[ids[j]];
    ex.store.offer_record(slot, ex.record_in(slot, s.blocks, s.data.ptr.get()), j >= asked, s.tally);
  }
}

// Re-ranks queries [first, last) with up to `inflight` in flight, in rounds:
// every live query's next mini-batch is read by one fetch, so the SSD sees all
// of their reads at once instead of one mini-batch's round trip at a time. A
// query leaving frees its slot for the next one, and the fetch buffer never
// holds more than inflight * minibatch blocks.
void rerank_queries(const RerankJob& job, size_t first, size_t last, size_t inflight, Scratch& s) {
  const Exact& ex = job.ex;
  const RerankParams& p = job.p;
  const bool cache = ex.store.records_on(), adaptive = ex.store.adaptive();
  s.record.resize(ex.store.layout().record_bytes);
  s.slots.resize(inflight);
  for (QueryState& st : s.slots) st.live = false;
  for (size_t next = first;;) {
    size_t live = 0;
    for (QueryState& st : s.slots) {
      while (!st.live && next < last) {
        st.start(next, job.cand + next * job.n, job.n, p.tracks() ? &ex : nullptr);
        ++next;
        if (st.done(p)) job.finish(st);  // no candidates
      }
      live += st.live;
    }
    if (!live) {
      settle_ahead(job, s, 0), settle_ahead(job, s, 1);
      return;
    }

    auto t0 = std::chrono::steady_clock::now();
    s.blocks.clear();
    for (QueryState& st : s.slots)
      if (st.live) {
        st.next_batch(job.row(st), p);
        if (adaptive) observe_round(ex, st, job.row(st), p, s);
        if (cache) st.take_cached(ex, job.queries + st.row * ex.dim, job.row(st), p, s.record, s.by_b, s.keep, s.tally);
        // Each query's blocks once: a block's weight in the page buffer is how many queries asked.
        const size_t from = s.blocks.size();
        ex.add_blocks(st.batch.data(), st.batch.size(), s.blocks);
        std::sort(s.blocks.begin() + from, s.blocks.end());
        s.blocks.erase(std::unique(s.blocks.begin() + from, s.blocks.end()), s.blocks.end());
      }
    s.unclaimed.resize(s.blocks.size());  // sized before de-duplication: a flag per distinct block and more
    Exact::distinct(s.blocks, &s.weights);
    if (p.prefetch) read_next(job, s, s.cur ^ 1);
    const uint8_t* data =
        ex.fetch_distinct(s.blocks, s.data, s.unclaimed.data(), &s.weights, p.prefetch ? &s.ahead[s.cur] : nullptr);
    s.cur ^= 1;
    for (QueryState& st : s.slots) {
      if (!st.live) continue;
      const int64_t* cand = st.batch.data();
      const size_t m = st.batch.size();
      // A block read for several queries counts as read for the first, buffered
      // for the others: summed over queries, pages read are the reads done.
      s.mine.clear();
      ex.add_blocks(cand, m, s.mine);
      std::sort(s.mine.begin(), s.mine.end());
      s.mine.erase(std::unique(s.mine.begin(), s.mine.end()), s.mine.end());
      for (uint32_t b : s.mine) {
        size_t at = std::lower_bound(s.blocks.begin(), s.blocks.end(), b) - s.blocks.begin();
        if (s.unclaimed[at]) ++st.from_ssd, s.unclaimed[at] = 0;
        else ++st.from_buffer;
      }
      const float* q = job.queries + st.row * ex.dim;
      s.dist.resize(m);
      ex.distances_in(q, cand, m, s.blocks, data, s.dist.data());
      if (!p.tracks() && st.hit_ids.empty()) {
        if (cache) offer_records(ex, cand, m, m, s);
        st.absorb(cand, s.dist.data(), m, p);
        continue;
      }
      s.ids.assign(cand, cand + m);
      if (p.tracks()) {
        for (uint32_t at : st.batch_pos) st.scored[at] = 1;
        for (uint32_t at : st.hit_pos) st.scored[at] = 1;
        if (p.page_mates) st.page_mates(ex, q, job.row(st), s.mine, s.blocks, data, s.ids, s.dist);
      }
      // The records scored from blocks read (the mini-batch's, then its page-mates) go to the record cache,
      // whose policy decides what stays; the page-mates were not asked for yet, so they are asked now.
      if (cache) offer_records(ex, s.ids.data(), s.ids.size(), m, s);
      s.ids.insert(s.ids.end(), st.hit_ids.begin(), st.hit_ids.end());
      s.dist.insert(s.dist.end(), st.hit_dist.begin(), st.hit_dist.end());
      if (p.resident_first && st.stop.batches == 0) st.residents(ex, q, job.row(st), s.one, s.ids, s.dist);
      st.absorb(s.ids.data(), s.dist.data(), s.ids.size(), p);
    }
    ex.store.tally(s.tally);
    // The round's time is split among its queries, so per-query seconds sum to the worker's time.
    double share = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / double(live);
    for (QueryState& st : s.slots)
      if (st.live) {
        st.seconds += share;
        if (st.done(p)) job.finish(st);
      }
  }
}

// Resident raw vectors (EngineConfig.raw_in_ram): every record in one array in RAM, row = vector id, so a
// candidate's exact distance is one kernel call on its row, with no page buffer lookup, no block CRC, no copy and
// no read. Every candidate of the query is scored (the early stop exists to save SSD reads, and here a candidate
// costs a few nanoseconds), with the same record kernel as the SSD path, so the answer is the SSD path's without
// the early stop (beta 0): the exact top-k of the distinct candidates by (distance, id).
using RawRows = nb::ndarray<const uint8_t, nb::ndim<2>, nb::c_contig, nb::device::cpu>;

// Rows ahead whose cache lines are asked for before their distance: a candidate's row is a random one of a
// matrix far larger than the caches, and a DRAM miss per line waited out one row at a time was most of the cost.
constexpr size_t kRowsAhead = 4;

inline void prefetch_row(const uint8_t* row, size_t bytes) {
  for (size_t o = 0; o < bytes; o += 64) __builtin_prefetch(row + o);
}

void rerank_rows(const uint8_t* raw, size_t record_bytes, RecordDistanceFn distance, const float* q, size_t dim,
                 const int64_t* cand, size_t n, size_t k, std::vector<std::pair<float, int64_t>>& scored,
                 int64_t* ids, float* dists, int64_t* stats) {
  const size_t end = std::find(cand, cand + n, int64_t(-1)) - cand;
  // Max-heap on (distance, id), as the SSD path's: the root is the worst kept, ties keep the smaller id. Sorting
  // all the candidates instead cost more than their distances (GloVe, 200 candidates: ~8 us a query).
  std::vector<std::pair<float, int64_t>>& heap = scored;
  heap.clear();
  int64_t reranked = 0;
  for (size_t j = 0; j < std::min(end, kRowsAhead); ++j)
    if (cand[j] >= 0) prefetch_row(raw + size_t(cand[j]) * record_bytes, record_bytes);
  for (size_t j = 0; j < end; ++j) {
    if (j + kRowsAhead < end && cand[j + kRowsAhead] >= 0)
      prefetch_row(raw + size_t(cand[j + kRowsAhead]) * record_bytes, record_bytes);
    if (cand[j] < 0) continue;
    ++reranked;
    const std::pair<float, int64_t> e{distance(q, raw + size_t(cand[j]) * record_bytes, dim), cand[j]};
    if (heap.size() == k && !(e < heap.front())) continue;
    // A candidate list may repeat an id (boundary replicas): the same distance twice, kept once.
    if (std::any_of(heap.begin(), heap.end(), [&](const auto& h) { return h.second == e.second; })) continue;
    heap.push_back(e);
    std::push_heap(heap.begin(), heap.end());
    if (heap.size() > k) {
      std::pop_heap(heap.begin(), heap.end());
      heap.pop_back();
    }
  }
  std::sort_heap(heap.begin(), heap.end());
  for (size_t j = 0; j < k; ++j) {
    ids[j] = j < heap.size() ? heap[j].second : -1;
    dists[j] = j < heap.size() ? heap[j].first : std::numeric_limits<float>::infinity();
  }
  // [minibatches, re-ranked, blocks from SSD, blocks from buffer, page-mates, resident-first, record cache]
  stats[0] = reranked > 0, stats[1] = reranked;
  for (size_t c = 2; c < kStats; ++c) stats[c] = 0;
}

void check_rows(const Queries& queries, const IdMatrix& ids, const char* name) {
  if (ids.shape(0) != queries.shape(0))
    throw std::invalid_argument(std::string(name) + " has " + std::to_string(ids.shape(0)) + " rows but there are " +
                                std::to_string(queries.shape(0)) + " queries");
}

}  // namespace
}  // namespace fusionrag

using namespace fusionrag;

void bind_rerank(nb::module_& m) {
  m.def(
      "rerank",
      [](PageStore& store, Queries queries, IdMatrix candidates, Locations locations, const std::string& dtype,
         const std::string& metric, int64_t k, int64_t minibatch, float eps, int64_t beta, int num_threads,
         int64_t inflight, bool page_mates, bool prefetch, bool resident_first) {
        Exact ex(store, queries, locations, dtype, metric);
        check_rows(queries, candidates, "candidates");
        if (k <= 0) throw std::invalid_argument("k must be positive");
        if (minibatch <= 0) throw std::invalid_argument("minibatch must be positive");
        if (inflight <= 0) throw std::invalid_argument("inflight (queries in flight per worker) must be positive");
        const size_t nq = queries.shape(0), n = candidates.shape(1), threads = pool_threads(num_threads);
        NumpyOut<int64_t> ids({nq, size_t(k)}), stats({nq, kStats});
        NumpyOut<float> dists({nq, size_t(k)});
        NumpyOut<double> seconds({nq});
        const RerankParams params{size_t(k), size_t(minibatch), eps, beta, page_mates, prefetch, resident_first};
        const RerankJob job{ex, params, queries.data(), candidates.data(), n,
                            ids.data(), stats.data(), dists.data(), seconds.data()};
        {
          nb::gil_scoped_release nogil;
          for (size_t i = 0; i < nq; ++i) ex.validate(candidates.data() + i * n, n, true);
          const size_t workers = std::min(threads, std::max<size_t>(1, nq));
          // No more in flight than spreads the queries over every worker: a small
          // call still uses all threads.
          const size_t slots = std::min(size_t(inflight), std::max<size_t>(1, (nq + workers - 1) / workers));
          // Workers take fixed chunks of consecutive queries, so which queries share
          // a round, and so each query's blocks from SSD, does not depend on timing.
          const size_t chunk = std::max(slots, (nq + workers * kChunksPerWorker - 1) / (workers * kChunksPerWorker));
          const size_t chunks = (nq + chunk - 1) / chunk;
          ScratchLease scratch(store, workers);
          ThreadPool::instance().parallel_for(chunks, workers, [&](size_t c, size_t worker) {
            rerank_queries(job, c * chunk, std::min(nq, (c + 1) * chunk), slots, scratch[worker]);
          });
        }
        return nb::make_tuple(ids.release(), dists.release(), stats.release(), seconds.release());
      },
      "store"_a, "queries"_a, "candidates"_a, "locations"_a, "dtype"_a, "metric"_a, "k"_a, "minibatch"_a, "eps"_a,
      "beta"_a, "num_threads"_a = 0, "inflight"_a = 16, "page_mates"_a = false, "prefetch"_a = false,
      "resident_first"_a = false,
      "Exact top-k of each query's PQ-ranked candidates (best first, -1 padded), read from the page file in mini-"
      "batches with early stop; each worker thread keeps up to `inflight` queries in flight and reads their mini-"
      "batches' blocks together. With page_mates, a block read also scores the query's later candidates stored in it;"
      " their own mini-batch then reads nothing for them. With prefetch, the reads of each query's next mini-batch "
      "start before this one is scored, so they overlap the scoring (not for a query one stable mini-batch from its "
      "stop, unless beta is 1); those an early stop (or the record cache) leaves unused show in "
      "store.stats()['read_ahead_unused'], and count as blocks from SSD of the query they were read for. With "
      "resident_first, a query's first mini-batch also scores every later candidate whose block is in the page buffer"
      " then (copied from it, nothing read, not counted as a buffer request). Returns (ids int64[q,k], dists "
      "float32[q,k], stats int64[q,7] = [minibatches, candidates re-ranked, blocks from SSD, blocks from buffer (or "
      "whose candidates all came from the record cache), of those re-ranked the page-mates, of those re-ranked the "
      "resident-first ones, of those re-ranked the ones from the record cache], seconds float64[q] = the query's "
      "share of its worker's time). A block read once for several queries counts as from SSD for one of them.");

  m.def(
      "rerank_resident",
      [](RawRows raw, Queries queries, IdMatrix candidates, const std::string& dtype, const std::string& metric,
         int64_t k, int num_threads) {
        check_rows(queries, candidates, "candidates");
        if (k <= 0) throw std::invalid_argument("k must be positive");
        const Distance d = pick_distance(dtype, metric);
        const size_t nq = queries.shape(0), n = candidates.shape(1), dim = queries.shape(1);
        const size_t rows = raw.shape(0), record_bytes = raw.shape(1);
        if (dim * d.elem_bytes != record_bytes)
          throw std::invalid_argument("queries have " + std::to_string(dim) + " dims of " + dtype + ", which is " +
                                      std::to_string(dim * d.elem_bytes) + " bytes, but the raw rows have " +
                                      std::to_string(record_bytes));
        const int64_t* cand = candidates.data();
        for (size_t i = 0; i < nq * n; ++i)
          if (cand[i] < -1 || cand[i] >= int64_t(rows))
            throw std::invalid_argument("candidate id " + std::to_string(cand[i]) + " is outside [0, " +
                                        std::to_string(rows) + ") of the raw rows");
        NumpyOut<int64_t> ids({nq, size_t(k)}), stats({nq, kStats});
        NumpyOut<float> dists({nq, size_t(k)});
        NumpyOut<double> seconds({nq});
        {
          nb::gil_scoped_release nogil;
          const uint8_t* base = raw.data();
          const float* qs = queries.data();
          auto one = [&](size_t i, std::vector<std::pair<float, int64_t>>& scratch) {
            auto t0 = std::chrono::steady_clock::now();
            rerank_rows(base, record_bytes, d.fn, qs + i * dim, dim, cand + i * n, n, size_t(k), scratch,
                        ids.data() + i * k, dists.data() + i * k, stats.data() + i * kStats);
            seconds.data()[i] = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
          };
          const size_t workers = std::min(pool_threads(num_threads), std::max<size_t>(1, nq / 8));
          if (workers <= 1) {  // a small call: no hand-off to the pool
            std::vector<std::pair<float, int64_t>> scratch;
            for (size_t i = 0; i < nq; ++i) one(i, scratch);
          } else {
            const size_t chunk = (nq + workers * kChunksPerWorker - 1) / (workers * kChunksPerWorker);
            ThreadPool::instance().parallel_for((nq + chunk - 1) / chunk, workers, [&](size_t c, size_t) {
              std::vector<std::pair<float, int64_t>> scratch;
              for (size_t i = c * chunk; i < std::min(nq, (c + 1) * chunk); ++i) one(i, scratch);
            });
          }
        }
        return nb::make_tuple(ids.release(), dists.release(), stats.release(), seconds.release());
      },
      "raw"_a, "queries"_a, "candidates"_a, "dtype"_a, "metric"_a, "k"_a, "num_threads"_a = 0,
      "rerank's answer from raw vectors resident in RAM (uint8[count, record_bytes], row = id): every candidate up to "
      "the first -1 scored exactly with the re-rank's record kernel, the top-k of the distinct ones by (distance, "
      "id); no page read, no early stop (the SSD path's answer at beta 0). Returns rerank's (ids, dists, stats "
      "[1, re-ranked, 0...], seconds).");

  m.def(
      "exact_distances",
      [](PageStore& store, Queries queries, IdMatrix ids, Locations locations, const std::string& dtype,
         const std::string& metric, int num_threads) {
        Exact ex(store, queries, locations, dtype, metric);
        check_rows(queries, ids, "ids");
        const size_t nq = queries.shape(0), n = ids.shape(1), threads = pool_threads(num_threads);
        NumpyOut<float> out({nq, n});
        {
          nb::gil_scoped_release nogil;
          for (size_t i = 0; i < nq; ++i) ex.validate(ids.data() + i * n, n, false);
          ScratchLease scratch(store, std::min(threads, std::max<size_t>(1, nq)));
          ThreadPool::instance().parallel_for(nq, scratch.size(), [&](size_t i, size_t worker) {
            constexpr size_t kBatch = 64;  // one batched read per 64 ids bounds the scratch
            Scratch& s = scratch[worker];
            for (size_t j = 0; j < n; j += kBatch) {
              const int64_t* batch = ids.data() + i * n + j;
              const size_t m = std::min(kBatch, n - j);
              s.blocks.clear();
              ex.add_blocks(batch, m, s.blocks);
              const uint8_t* data = ex.fetch(s.blocks, s.data);
              ex.distances_in(queries.data() + i * ex.dim, batch, m, s.blocks, data, out.data() + i * n + j);
            }
          });
        }
        return out.release();
      },
      "store"_a, "queries"_a, "ids"_a, "locations"_a, "dtype"_a, "metric"_a, "num_threads"_a = 0,
      "Exact distance (float32[q,n]) of each query to each listed id, read through the page buffer; -1 gives inf.");
}
