// The navigation graph over posting-list centroids: a multi-layer HNSW
// (Malkov & Yashunin) in the manner of hnswlib. Fixed-size neighbour lists
// (2*M links on level 0, M above), the diversity heuristic for choosing links,
// per-node locks for a multi-threaded build, and per-thread search scratch.
// A loaded graph may keep its vectors as 8-bit codes (SQ8): it then only searches.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/filesystem.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/unique_ptr.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <vector>

#include "distance.h"
#include "numpy_out.h"
#include "scratch_meter.h"
#include "threadpool.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace fusionrag {
namespace {

constexpr uint32_t kNone = std::numeric_limits<uint32_t>::max();
constexpr int kMaxLevel = 32;
// select_neighbours' alpha for graphs made without one, and for every graph loaded from a file (only add() uses
// it): chosen on the centroids of clustered and real sets, bench/peers/graph_links.py.
constexpr float kAlpha = 1.0f;
constexpr int64_t kMaxDim = 1 << 20, kMaxM = 4096;  // bounds that keep file-size arithmetic from overflowing
constexpr char kMagic[8] = {'F', 'R', 'G', 'R', 'A', 'P', 'H', '\0'};
constexpr uint32_t kVersion = 1;

struct Cand {
  float dist;
  uint32_t id;
};
// Lambdas rather than functions, so the heap code inlines the comparison.
constexpr auto nearer = [](const Cand& a, const Cand& b) { return a.dist < b.dist; };   // max-heap order
constexpr auto farther = [](const Cand& a, const Cand& b) { return a.dist > b.dist; };  // min-heap order

constexpr size_t kAlignFloats = 64 / sizeof(float);
// exact_search screens with integer products (Graph::screen_block) where it keeps at most 1 / kScreenShare of
// the nodes (past that, most nodes pass the screen anyway) and rows have at least kScreenDim codes (GloVe's
// 40,555 x 50: 300 against 330 us a query unscreened at 64 kept, 237 against 223 at 256; the passes over
// every node cost as much as the products).
constexpr size_t kScreenShare = 4, kScreenDim = 64;
inline float* align_lines(float* p) {
  return reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(p) + 63) & ~uintptr_t(63));
}

// best[from .. from + found) (ascending) as a row of k ids and distances, padded with -1 / +inf.
inline void put_row(const std::vector<Cand>& best, size_t from, size_t found, size_t k, int32_t* ids, float* dists) {
  for (size_t j = 0; j < found; ++j) {
    ids[j] = int32_t(best[from + j].id);
    dists[j] = best[from + j].dist;
  }
  for (size_t j = found; j < k; ++j) {
    ids[j] = -1;
    dists[j] = std::numeric_limits<float>::infinity();
  }
}

// exact_search's order: nearer first, ties by id.
constexpr auto by_id = [](const Cand& a, const Cand& c) { return a.dist < c.dist || (a.dist == c.dist && a.id < c.id); };

// The kept nearest of count candidates (dist[j], id id(j), ids increasing, count >= kept) as a max-heap in
// h[0 .. kept), ties by id. Most candidates are turned away by one comparison with the top that the branch
// predictor gets right (a partial sort over all of them mispredicts about half its comparisons); one that gets
// in replaces the top and sinks.
template <class Id>
inline void keep_nearest(const float* dist, Id id, size_t count, size_t kept, Cand* h) {
  for (size_t j = 0; j < kept; ++j) h[j] = {dist[j], id(j)};
  std::make_heap(h, h + kept, by_id);
  for (size_t j = kept; j < count; ++j) {
    if (!(dist[j] < h[0].dist)) continue;  // a later id at an equal distance never displaces
    const Cand c{dist[j], id(j)};
    size_t i = 0;
    for (size_t l = 1; l < kept; l = 2 * i + 1) {
      size_t big = l + 1 < kept && by_id(h[l], h[l + 1]) ? l + 1 : l;
      if (!by_id(c, h[big])) break;
      h[i] = h[big];
      i = big;
    }
    h[i] = c;
  }
}

// A value with at least `kept` (1 <= kept <= n) of x[0 .. n) at or below it, and close above the kept-th
// smallest: bisection on the minima of blocks of x (so narrow that a few more than kept blocks have their
// minimum there: about 75 values at or below the cut for 64 kept of 3,550), counting by a branch-free loop. Any kept
// block minima are kept distinct values of x, so the count's guarantee carries over. Picking the kept smallest
// with a heap cost a mispredicted branch per level of every insertion, most of the time of a search over a few
// thousand nodes (12 us against 1.7 for 64 of 3,550).
inline float cut_at(const float* x, size_t n, size_t kept, std::vector<float>& mins) {
  const size_t width = std::clamp<size_t>(n / (4 * kept), 1, 16);
  const size_t blocks = n / width;  // block b: x[b], x[b + blocks], ... (strided: near ids are often near nodes)
  mins.assign(x, x + blocks);
  for (size_t from = blocks; from < n; from += blocks) {
    const float* y = x + from;
    for (size_t b = 0, end = std::min(blocks, n - from); b < end; ++b) mins[b] = std::min(mins[b], y[b]);
  }
  const float* m = mins.data();
  float lo = m[0], hi = m[0];
  for (size_t b = 1; b < blocks; ++b) {
    lo = std::min(lo, m[b]);
    hi = std::max(hi, m[b]);
  }
  // Invariant: at least kept minima at or below hi (at first, all of them: blocks >= kept).
  for (int step = 0; step < 24; ++step) {
    const float mid = lo + (hi - lo) * 0.5f;
    if (!(mid > lo && mid < hi)) break;
    size_t count = 0;
    for (size_t b = 0; b < blocks; ++b) count += m[b] <= mid;
    if (count < kept) {
      lo = mid;
      continue;
    }
    hi = mid;
    if (count <= kept + kept / 8) break;  // close enough: an eighth more than kept
  }
  return hi;
}

// Moves the candidates at or below cut_at(dist, count, kept) to the front, in order: dist in place, their ids
// (id(j), which may read band[j]: the move goes forward) into band. Returns how many: at least kept.
template <class Id>
inline size_t keep_below_cut(float* dist, Id id, size_t count, size_t kept, std::vector<uint32_t>& band,
                             std::vector<float>& mins) {
  const float cut = cut_at(dist, count, kept, mins);
  size_t left = 0;
  for (size_t j = 0; j < count; ++j) {
    band[left] = id(j);
    dist[left] = dist[j];
    left += dist[j] <= cut;
  }
  return left;
}

// A block of exact_search's queries: q.lo (SQ8) and ||q||^2.
struct Mapped {
  float base[kDotQueries] = {}, qn[kDotQueries] = {};
  // Query r's distance to a node from their inner product (q.x - q.lo for codes) and the node's ||x||^2.
  float distance(size_t r, float dot, float norm, bool l2) const {
    return l2 ? std::max(0.0f, (qn[r] - 2 * (base[r] + dot)) + norm) : -(base[r] + dot);
  }
};

// Search state kept per thread between calls, so that a query allocates
// nothing. Thread-local rather than indexed by pool worker, because two Python
// threads may search at once.
struct Scratch {
  std::vector<uint32_t> visited;  // visited[i] == epoch: node i seen by this search
  uint32_t epoch = 0;
  std::vector<Cand> frontier;     // min-heap: nodes still to expand
  std::vector<Cand> best;         // max-heap: the ef nearest found so far
  std::vector<uint32_t> links;    // a neighbour list copied out under its node's lock
  std::vector<Cand> pruned;       // a full neighbour list being shrunk
  std::vector<float> query;       // the query mapped into SQ8 code units (a block of them: exact_search)
  std::vector<float> dots;        // exact_search: a block of queries' distances to every node
  std::vector<int8_t> qint;       // screen_block: a block of queries as 7-bit integers
  std::vector<int32_t> idots;     // screen_block: their integer products with every node
  std::vector<uint32_t> band;     // exact_search: the nodes one query's cut lets through
  std::vector<float> ups;         // screen_block: one query's upper ends (dots: lower ends)
  std::vector<float> mins;        // cut_at's block minima
  ScratchMeter meter;             // its bytes in native.scratch_bytes()

  size_t bytes() const {
    return capacity_bytes(visited, frontier, best, links, pruned, query, dots, qint, idots, band, ups, mins);
  }

  // Not inlined: seen through an inlined accessor, GCC re-derives the
  // thread-local address after every call in the search loop.
  __attribute__((noinline)) static Scratch& local() {
    thread_local Scratch s;
    return s;
  }

  void start(size_t nodes) {
    if (visited.size() < nodes) visited.resize(nodes, 0);
    if (++epoch == 0) {  // wrapped: old tags could collide
      std::fill(visited.begin(), visited.end(), 0);
      epoch = 1;
    }
    frontier.clear();
    best.clear();
  }
};

// Per-node locks for a build, striped so that growing a large graph by a few
// nodes stays cheap; a thread never holds two, so sharing cannot deadlock.
class NodeLocks {
 public:
  explicit NodeLocks(size_t nodes) : locks_(std::min<size_t>(nodes, 1 << 16)) {}
  std::mutex& operator[](uint32_t i) { return locks_[i % locks_.size()]; }

 private:
  std::vector<std::mutex> locks_;
};

class File {
 public:
  File(const std::string& path, const char* mode) : path_(path), f_(std::fopen(path.c_str(), mode)) {
    if (!f_) throw std::runtime_error("cannot open '" + path + "': " + std::strerror(errno));
  }
  ~File() {
    if (f_) std::fclose(f_);
  }
  void write(const void* p, size_t bytes) {
    if (bytes && std::fwrite(p, 1, bytes, f_) != bytes)
      throw std::runtime_error("cannot write '" + path_ + "': " + std::strerror(errno));
  }
  void read(void* p, size_t bytes) {
    if (bytes && std::fread(p, 1, bytes, f_) != bytes) bad("truncated");
  }
  uint64_t size() {
    long here = std::ftell(f_);
    std::fseek(f_, 0, SEEK_END);
    long end = std::ftell(f_);
    std::fseek(f_, here, SEEK_SET);
    if (here < 0 || end < 0) throw std::runtime_error("cannot seek in '" + path_ + "'");
    return uint64_t(end);
  }
  long tell() {
    long at = std::ftell(f_);
    if (at < 0) throw std::runtime_error("cannot seek in '" + path_ + "'");
    return at;
  }
  void seek(long at) {
    if (std::fseek(f_, at, SEEK_SET) != 0) throw std::runtime_error("cannot seek in '" + path_ + "'");
  }
  void close() {
    FILE* f = f_;
    f_ = nullptr;
    if (std::fclose(f) != 0) throw std::runtime_error("cannot write '" + path_ + "': " + std::strerror(errno));
  }
  [[noreturn]] void bad(const std::string& why) const {
    throw std::invalid_argument("graph file '" + path_ + "' is " + why);
  }

 private:
  std::string path_;
  FILE* f_;
};

// File layout (native byte order): Header, levels (uint8[size]),
// vectors (float[size*dim]), level-0 lists (uint32[size*(1+2M)]), then each
// node's upper lists in id order (uint32[level*(1+M)]). A list is [count, ids...].
struct Header {
  char magic[8];
  uint32_t version, metric;
  uint64_t dim, M, ef_construction, seed, size;
  uint32_t entry;
  int32_t max_level;
};
static_assert(sizeof(Header) == 64, "Header must have no padding");

// SQ8: per dimension i, code c_i = round((x_i - lo_i) / s_i). A query is mapped
// into code units once (q'_i = (q_i - lo_i) / s_i, or q_i * s_i for ip), so each
// distance is one pass over a node's bytes, in the original units (approximately):
// l2 is sq8_l2, ip is q.lo + neg_ip of the mapped query.

// The distance from one point (a query, or a node being inserted) to node i:
// the traversal is written once against these.
struct FloatDist {
  DistanceFn fn;
  const float* q;
  const float* vectors;
  size_t dim;
  float operator()(uint32_t i) const { return fn(q, vectors + size_t(i) * dim, dim); }
  void prefetch(uint32_t i) const { __builtin_prefetch(vectors + size_t(i) * dim); }
};

struct Sq8Dist {
  const float* q;  // in code units
  const float* s;  // s_i (l2), null for ip
  float offset;    // -q.lo (ip)
  const uint8_t* codes;
  size_t dim;
  float operator()(uint32_t i) const {
    const uint8_t* c = codes + size_t(i) * dim;
    return s ? sq8_l2(q, s, c, dim) : offset + neg_ip(q, c, dim);
  }
  void prefetch(uint32_t i) const { __builtin_prefetch(codes + size_t(i) * dim); }
};

class Graph {
 public:
  Graph(size_t dim, Metric metric, size_t M, size_t ef_construction, uint64_t seed, float alpha = kAlpha,
        bool repair = true)
      : dim_(dim), M_(M), M0_(2 * M), ef_construction_(ef_construction), seed_(seed),
        metric_(metric), dist_(distance_fn(metric)), level_mult_(1.0 / std::log(double(M))),
        alpha_sq_(metric == Metric::L2 ? alpha * alpha : 1.0f), repair_(repair) {}

  size_t size() const {
    std::shared_lock<std::shared_mutex> r(rw_);
    return count();
  }
  size_t dim() const { return dim_; }
  Metric metric() const { return metric_; }
  bool quantized() const { return quantized_; }
  bool linked() const { return linked_; }

  size_t memory_bytes() const {
    std::shared_lock<std::shared_mutex> r(rw_);
    size_t bytes = capacity_bytes(vectors_, codes_, lo_, scale_, links0_, levels_, upper_);
    for (const auto& u : upper_) bytes += capacity_bytes(u);
    std::lock_guard<std::mutex> lk(norms_mutex_);
    return bytes + capacity_bytes(norms_, spreads_);
  }

  std::unique_ptr<float[]> copy_vectors(size_t& rows) const {
    std::shared_lock<std::shared_mutex> r(rw_);
    rows = count();
    auto out = std::make_unique<float[]>(rows * dim_);
    if (!quantized_) {
      std::copy(vectors_.begin(), vectors_.end(), out.get());
      return out;
    }
    for (size_t r = 0; r < rows; ++r)
      for (size_t i = 0; i < dim_; ++i) out[r * dim_ + i] = decoded(r, i);
    return out;
  }

  void add(const float* data, size_t n, size_t threads) {
    if (quantized_) throw std::invalid_argument("quantized graph is read-only; load it with quantize=False to grow it");
    need_links("grow it");
    std::unique_lock<std::shared_mutex> w(rw_);
    size_t first = count(), total = first + n;
    if (total > size_t(std::numeric_limits<int32_t>::max()))
      throw std::invalid_argument("graph would exceed 2^31-1 nodes");
    vectors_.insert(vectors_.end(), data, data + n * dim_);
    links0_.resize(total * (1 + M0_), 0);
    levels_.resize(total);
    upper_.resize(total);
    for (size_t i = first; i < total; ++i) {
      levels_[i] = uint8_t(random_level(i));
      upper_[i].assign(levels_[i] * (1 + M_), 0);
    }
    NodeLocks locks(total);
    // Each thread inserts one contiguous block of the new nodes, in order, rather than the next node of all:
    // nodes inserted at once do not find each other, and a full list's heuristic then drops one for the other
    // (the link that would have joined them never made), leaving nodes out of reach. Builds add centroids near
    // ones together, so taken node by node the threads' nodes were neighbours: on Fashion-MNIST's centroids, 2
    // threads left 7% out of reach against 0.02% on 1 (bench/results/peers/graph_threads.md). One block a thread, not
    // more handed out as threads come free: a thread starting block b while another ends block b - 1 would
    // insert neighbours at once again, at every boundary.
    size_t blocks = std::max<size_t>(1, std::min({threads, n, ThreadPool::instance().size()}));
    ThreadPool::instance().parallel_for(blocks, blocks, [&](size_t b, size_t) {
      Scratch& s = Scratch::local();
      SettleOnExit<Scratch> settle{s};
      for (size_t i = b * n / blocks, end = (b + 1) * n / blocks; i < end; ++i) insert(uint32_t(first + i), s, &locks);
    });
    if (repair_) repaired_ += reconnect();
  }

  // reconnect() on its own, for a graph made without repair (or loaded from a file made so); returns links added.
  size_t repair() {
    if (quantized_)
      throw std::invalid_argument("quantized graph is read-only; load it with quantize=False to repair it");
    need_links("repair it");
    std::unique_lock<std::shared_mutex> w(rw_);
    size_t added = reconnect();
    repaired_ += added;
    return added;
  }

  // Links added by reconnect() since this graph was made or loaded (a count for tests and benchmarks).
  size_t repaired() const {
    std::shared_lock<std::shared_mutex> r(rw_);
    return repaired_;
  }

  // Nodes a search can reach on level 0 from the entry point, where every search ends (a measure of the graph).
  size_t reachable() const {
    need_links("follow them");
    std::shared_lock<std::shared_mutex> r(rw_);
    std::vector<uint8_t> seen(count(), 0);
    return entry_ == kNone ? 0 : mark_from(entry_, seen);
  }

  // Writes the k nearest of each query (ascending), padding with -1 / +inf.
  // entries: a node per query to start level 0's search from (skipping the upper levels' greedy descent), or
  // nullptr; an entry outside the graph (negative, say) starts that query from the entry point as usual.
  void search(const float* queries, size_t nq, size_t k, size_t ef, size_t threads, int32_t* ids,
              float* dists, const int32_t* entries = nullptr) const {
    need_links("search by them (exact_search needs none)");
    std::shared_lock<std::shared_mutex> r(rw_);
    ef = std::max(ef, k);
    const size_t n = count();
    ThreadPool::instance().parallel_for(nq, threads, [&](size_t i, size_t) {
      Scratch& s = Scratch::local();
      SettleOnExit<Scratch> settle{s};
      const float* q = queries + i * dim_;
      size_t found = 0;
      const bool start = entries && entries[i] >= 0 && size_t(entries[i]) < n;
      if (entry_ != kNone) {
        if (quantized_)
          start ? from(sq8_query(q, s), uint32_t(entries[i]), ef, s) : nearest(sq8_query(q, s), ef, s);
        else if (start)
          from(FloatDist{dist_, q, vectors_.data(), dim_}, uint32_t(entries[i]), ef, s);
        else
          nearest(FloatDist{dist_, q, vectors_.data(), dim_}, ef, s);
        std::sort_heap(s.best.begin(), s.best.end(), nearer);
        found = std::min(k, s.best.size());
      }
      put_row(s.best, 0, found, k, ids + i * k, dists + i * k);
    });
  }

  // The k nearest of every node (not the graph's approximation), nearest first, ties by id: what probing
  // all lists means, and where navigation is exhaustive (tiers.exhaustive_is_cheap), each query's lists.
  // Blocks of kDotQueries queries take inner products with the nodes' codes (or floats) in place: no
  // decoded copy of the vectors, and no BLAS buffers.
  void exact_search(const float* queries, size_t nq, size_t k, size_t threads, int32_t* ids, float* dists,
                    bool screening = true) const {
    std::shared_lock<std::shared_mutex> r(rw_);
    const size_t n = count();
    const float* norms = metric_ == Metric::L2 ? node_norms(n) : nullptr;
    const size_t kept = std::min(k, n);
    // Codes, and few of the nodes kept: screen them with integer products first (screen_block).
    const bool screen = screening && quantized_ && dim_ >= kScreenDim && kept > 0 && kept * kScreenShare <= n;
    const float* spreads = screen ? code_spreads(n) : nullptr;
    ThreadPool::instance().parallel_for((nq + kDotQueries - 1) / kDotQueries, threads, [&](size_t b, size_t) {
      Scratch& s = Scratch::local();
      SettleOnExit<Scratch> settle{s};
      const size_t q0 = b * kDotQueries, bq = std::min(kDotQueries, nq - q0);
      const float* q = queries + q0 * dim_;
      Mapped m;
      // On 64-byte lines, so that a vector load of a row splits no cache line wherever the dimension allows.
      s.query.resize(bq * dim_ + kAlignFloats);
      float* mapped = align_lines(s.query.data());
      for (size_t r = 0; r < bq; ++r) {
        double lo = 0, sq = 0;  // q.x = q.lo + sum (q_i s_i) c_i
        for (size_t i = 0; i < dim_; ++i) {
          float x = q[r * dim_ + i];
          sq += double(x) * x;
          if (quantized_) {
            mapped[r * dim_ + i] = x * scale_[i];
            lo += double(x) * lo_[i];
          } else {
            mapped[r * dim_ + i] = x;
          }
        }
        m.base[r] = float(lo);
        m.qn[r] = float(sq);
      }
      if (screen) {
        screen_block(mapped, m, bq, n, kept, norms, spreads, s);
        for (size_t r = 0; r < bq; ++r) {
          std::sort_heap(s.best.begin() + r * kept, s.best.begin() + (r + 1) * kept, by_id);
          put_row(s.best, r * kept, kept, k, ids + (q0 + r) * k, dists + (q0 + r) * k);
        }
        return;
      }
      s.dots.resize(bq * n);
      if (quantized_)
        dot_rows(mapped, bq, codes_.data(), n, dim_, s.dots.data());
      else
        dot_rows(mapped, bq, vectors_.data(), n, dim_, s.dots.data());
      s.best.resize(kept);
      s.band.resize(n);
      for (size_t r = 0; r < bq; ++r) {
        float* dist = s.dots.data() + r * n;  // in place of the inner products
        for (size_t j = 0; j < n; ++j) dist[j] = m.distance(r, dist[j], norms ? norms[j] : 0.0f, norms != nullptr);
        const size_t through = kept ? keep_below_cut(dist, [](size_t j) { return uint32_t(j); }, n, kept, s.band,
                                                     s.mins) : 0;
        const uint32_t* band = s.band.data();
        keep_nearest(dist, [band](size_t j) { return band[j]; }, through, kept, s.best.data());
        std::sort_heap(s.best.begin(), s.best.end(), by_id);
        put_row(s.best, 0, kept, k, ids + (q0 + r) * k, dists + (q0 + r) * k);
      }
    });
  }

  void save(const std::string& path) const {
    if (quantized_)
      throw std::invalid_argument("quantized graph cannot be saved (its vectors are 8-bit approximations); "
                                  "load it with quantize=False to save it");
    need_links("save it");
    std::shared_lock<std::shared_mutex> r(rw_);
    Header h{};
    std::memcpy(h.magic, kMagic, sizeof kMagic);
    h.version = kVersion;
    h.metric = uint32_t(metric_);
    h.dim = dim_;
    h.M = M_;
    h.ef_construction = ef_construction_;
    h.seed = seed_;
    h.size = count();
    h.entry = entry_;
    h.max_level = max_level_;
    File f(path, "wb");
    f.write(&h, sizeof h);
    f.write(levels_.data(), levels_.size());
    f.write(vectors_.data(), vectors_.size() * sizeof(float));
    f.write(links0_.data(), links0_.size() * sizeof(uint32_t));
    for (const auto& u : upper_) f.write(u.data(), u.size() * sizeof(uint32_t));
    f.close();
  }

  // links false: the links are checked for size against the file but not read (exact_search needs none; an index
  // that navigates exactly holds no more): search, add, repair and save then refuse.
  static std::unique_ptr<Graph> load(const std::string& path, bool quantize, bool links = true) {
    File f(path, "rb");
    uint64_t file_size = f.size();
    Header h;
    f.read(&h, sizeof h);
    if (std::memcmp(h.magic, kMagic, sizeof kMagic) != 0) f.bad("not a fusionrag graph (bad magic)");
    if (h.version != kVersion) f.bad("version " + std::to_string(h.version) + ", expected " + std::to_string(kVersion));
    if (h.metric > uint32_t(Metric::IP) || h.dim < 1 || h.dim > kMaxDim || h.M < 2 || h.M > kMaxM ||
        h.ef_construction < 1 || h.size > uint64_t(std::numeric_limits<int32_t>::max()))
      f.bad("inconsistent (bad header)");
    auto g = std::make_unique<Graph>(h.dim, Metric(h.metric), h.M, h.ef_construction, h.seed);
    // Check sizes against the file before allocating, so a corrupt header
    // cannot ask for terabytes.
    uint64_t fixed = sizeof h + h.size * (1 + h.dim * sizeof(float) + (1 + g->M0_) * sizeof(uint32_t));
    if (fixed > file_size) f.bad("truncated");
    g->levels_.resize(h.size);
    f.read(g->levels_.data(), h.size);
    uint64_t upper_words = 0;
    for (uint8_t l : g->levels_) {
      if (l > kMaxLevel) f.bad("inconsistent (node level out of range)");
      upper_words += l * (1 + g->M_);
    }
    uint64_t expected = fixed + upper_words * sizeof(uint32_t);
    if (expected > file_size) f.bad("truncated");
    if (expected < file_size) f.bad("inconsistent (" + std::to_string(file_size - expected) + " trailing bytes)");
    if (quantize) {
      g->read_sq8(f);
    } else {
      g->vectors_.resize(h.size * h.dim);
      f.read(g->vectors_.data(), g->vectors_.size() * sizeof(float));
    }
    g->entry_ = h.entry;
    g->max_level_ = h.max_level;
    g->linked_ = links;
    if (!links) {
      if (!g->consistent()) f.bad("inconsistent (bad entry point or links)");
      return g;
    }
    g->links0_.resize(h.size * (1 + g->M0_));
    f.read(g->links0_.data(), g->links0_.size() * sizeof(uint32_t));
    g->upper_.resize(h.size);
    for (size_t i = 0; i < h.size; ++i) {
      g->upper_[i].resize(g->levels_[i] * (1 + g->M_));
      f.read(g->upper_[i].data(), g->upper_[i].size() * sizeof(uint32_t));
    }
    if (!g->consistent()) f.bad("inconsistent (bad entry point or links)");
    return g;
  }

 private:
  size_t count() const { return levels_.size(); }  // callers hold rw_
  void need_links(const char* what) const {
    if (!linked_) throw std::invalid_argument(std::string("graph loaded without its links (links=False) cannot ") + what);
  }
  const float* vec(uint32_t i) const { return vectors_.data() + size_t(i) * dim_; }

  // Reads the file's float vectors as SQ8 codes in two passes of small chunks
  // (per-dimension range, then codes), so the float matrix is never resident.
  void read_sq8(File& f) {
    size_t n = count(), rows = std::max<size_t>(1, (size_t(1) << 20) / (dim_ * sizeof(float)));
    std::vector<float> chunk(std::min(rows, n) * dim_);
    long start = f.tell();
    std::vector<float> hi(dim_, -std::numeric_limits<float>::infinity());
    lo_.assign(dim_, std::numeric_limits<float>::infinity());
    for (size_t at = 0; at < n; at += rows) {
      size_t r = std::min(rows, n - at);
      f.read(chunk.data(), r * dim_ * sizeof(float));
      for (size_t j = 0; j < r; ++j)
        for (size_t i = 0; i < dim_; ++i) {
          float x = chunk[j * dim_ + i];
          if (!std::isfinite(x)) f.bad("inconsistent (node " + std::to_string(at + j) + " has a non-finite coordinate)");
          lo_[i] = std::min(lo_[i], x);
          hi[i] = std::max(hi[i], x);
        }
    }
    scale_.resize(dim_);
    for (size_t i = 0; i < dim_; ++i) {
      if (n == 0) lo_[i] = hi[i] = 0;
      float s = float((double(hi[i]) - double(lo_[i])) / 255.0);  // in double: the range may exceed FLT_MAX
      scale_[i] = s > 0 ? s : 1.0f;  // a constant dimension: every code 0, exact
    }
    f.seek(start);
    codes_.resize(n * dim_);
    for (size_t at = 0; at < n; at += rows) {
      size_t r = std::min(rows, n - at);
      f.read(chunk.data(), r * dim_ * sizeof(float));
      for (size_t j = 0; j < r; ++j)
        for (size_t i = 0; i < dim_; ++i) {
          float c = std::round((chunk[j * dim_ + i] - lo_[i]) / scale_[i]);
          codes_[(at + j) * dim_ + i] = uint8_t(std::clamp(c, 0.0f, 255.0f));
        }
    }
    quantized_ = true;
  }

  Sq8Dist sq8_query(const float* q, Scratch& s) const {
    s.query.resize(dim_);
    if (metric_ == Metric::L2) {
      for (size_t i = 0; i < dim_; ++i) s.query[i] = (q[i] - lo_[i]) / scale_[i];
      return {s.query.data(), scale_.data(), 0.0f, codes_.data(), dim_};
    }
    double q_lo = 0;  // q.x = q.lo + sum (q_i s_i) c_i
    for (size_t i = 0; i < dim_; ++i) {
      s.query[i] = q[i] * scale_[i];
      q_lo += double(q[i]) * lo_[i];
    }
    return {s.query.data(), nullptr, float(-q_lo), codes_.data(), dim_};
  }

  // Leaves the ef nearest of d's point in s.best (a max-heap).
  template <class D>
  void nearest(const D& d, size_t ef, Scratch& s) const {
    uint32_t ep = entry_;
    float ep_dist = d(ep);
    for (int level = max_level_; level > 0; --level) greedy(d, ep, ep_dist, level, s, nullptr);
    search_layer(d, ep, ep_dist, ef, 0, s, nullptr);
  }

  // The same from node ep on level 0 alone.
  template <class D>
  void from(const D& d, uint32_t ep, size_t ef, Scratch& s) const {
    search_layer(d, ep, d(ep), ef, 0, s, nullptr);
  }

  // A list is [count, ids...].
  uint32_t* links(uint32_t i, int level) {
    return level == 0 ? &links0_[i * (1 + M0_)] : &upper_[i][(level - 1) * (1 + M_)];
  }
  const uint32_t* links(uint32_t i, int level) const { return const_cast<Graph*>(this)->links(i, level); }

  // While building, other threads rewrite lists, so a list is copied out under
  // its node's lock; searches run only when no build is (see rw_) and read in place.
  const uint32_t* neighbours(uint32_t i, int level, NodeLocks* locks, Scratch& s) const {
    const uint32_t* l = links(i, level);
    if (!locks) return l;
    std::lock_guard<std::mutex> lk((*locks)[i]);
    s.links.assign(l, l + 1 + l[0]);
    return s.links.data();
  }

  // Levels hash (seed, id) instead of drawing from a stateful generator, so a
  // graph grown by several add() calls, or saved, loaded and grown, gets the
  // same levels as one built at once.
  int random_level(uint64_t id) const {
    uint64_t x = seed_ + (id + 1) * 0x9E3779B97F4A7C15ull;  // splitmix64
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    x ^= x >> 31;
    double u = double((x >> 11) + 1) * 0x1.0p-53;  // in (0, 1]
    return std::min(kMaxLevel, int(-std::log(u) * level_mult_));
  }

  // Moves ep to a local minimum of the distance to q on one upper level.
  template <class D>
  void greedy(const D& d, uint32_t& ep, float& ep_dist, int level, Scratch& s, NodeLocks* locks) const {
    for (bool moved = true; moved;) {
      moved = false;
      const uint32_t* l = neighbours(ep, level, locks, s);
      for (uint32_t j = 1; j <= l[0]; ++j) {
        float dj = d(l[j]);
        if (dj < ep_dist) {
          ep_dist = dj;
          ep = l[j];
          moved = true;
        }
      }
    }
  }

  // Beam search on one level; leaves the ef nearest found in s.best (a max-heap).
  template <class D>
  void search_layer(const D& d, uint32_t ep, float ep_dist, size_t ef, int level, Scratch& s,
                    NodeLocks* locks) const {
    s.start(count());
    s.visited[ep] = s.epoch;
    s.frontier.push_back({ep_dist, ep});
    s.best.push_back({ep_dist, ep});
    while (!s.frontier.empty()) {
      Cand c = s.frontier.front();
      if (c.dist > s.best.front().dist) break;  // nothing left can improve the beam
      std::pop_heap(s.frontier.begin(), s.frontier.end(), farther);
      s.frontier.pop_back();
      const uint32_t* l = neighbours(c.id, level, locks, s);
      for (uint32_t j = 1; j <= l[0]; ++j) d.prefetch(l[j]);
      for (uint32_t j = 1; j <= l[0]; ++j) {
        uint32_t n = l[j];
        if (s.visited[n] == s.epoch) continue;
        s.visited[n] = s.epoch;
        float dn = d(n);
        if (s.best.size() < ef || dn < s.best.front().dist) {
          s.frontier.push_back({dn, n});
          std::push_heap(s.frontier.begin(), s.frontier.end(), farther);
          __builtin_prefetch(links(s.frontier.front().id, level));  // likely expanded next
          s.best.push_back({dn, n});
          std::push_heap(s.best.begin(), s.best.end(), nearer);
          if (s.best.size() > ef) {
            std::pop_heap(s.best.begin(), s.best.end(), nearer);
            s.best.pop_back();
          }
        }
      }
    }
  }

  // The HNSW heuristic on candidates sorted by distance to a base point, relaxed by alpha as DiskANN's
  // RobustPrune is: keep a candidate unless a candidate kept so far is nearer to it, by a factor alpha, than
  // the base is (alpha 1: HNSW's rule, the default). Links then spread across directions; alpha > 1 keeps more,
  // longer ones: measured on clustered centroids it found fewer of a row's nearest at the same beam, and left
  // more nodes out of reach for reconnect() to link (bench/peers/graph_links.py, bench/results/peers/graph_links.md).
  void select_neighbours(std::vector<Cand>& c, size_t m) const {
    if (c.size() <= m) return;
    size_t kept = 0;
    for (size_t i = 0; i < c.size() && kept < m; ++i) {
      bool diverse = true;
      for (size_t j = 0; j < kept && diverse; ++j)
        diverse = alpha_sq_ * dist_(vec(c[i].id), vec(c[j].id), dim_) >= c[i].dist;
      if (diverse) c[kept++] = c[i];
    }
    c.resize(kept);
  }

  // Marks (in seen) the nodes reachable on level 0 from `from` that are not marked yet; returns how many.
  size_t mark_from(uint32_t from, std::vector<uint8_t>& seen) const {
    if (seen[from]) return 0;
    std::vector<uint32_t> stack{from};
    seen[from] = 1;
    size_t marked = 1;
    while (!stack.empty()) {
      uint32_t i = stack.back();
      stack.pop_back();
      const uint32_t* l = links(i, 0);
      for (uint32_t j = 1; j <= l[0]; ++j)
        if (!seen[l[j]]) {
          seen[l[j]] = 1;
          ++marked;
          stack.push_back(l[j]);
        }
    }
    return marked;
  }

  // Makes every node reachable on level 0 from the entry point: the heuristic can leave a cluster with no link
  // into it, and a node no search reaches is a posting list no query probes and a row put in the wrong list.
  // Each node out of reach gets a link from the nearest reachable node a search for it finds that has room
  // (or, where none has, in place of that node's farthest link, checked again after). Returns links added.
  size_t reconnect() {
    if (entry_ == kNone) return 0;
    size_t added = 0;
    Scratch& s = Scratch::local();
    SettleOnExit<Scratch> settle{s};
    // Links into each node on level 0: a full list gives up a link whose node another list also links to,
    // where it has one. Giving up the only link into a node cut it off, and the next round's repair of that
    // node could take the list's new link back (two nodes taking turns, out of reach after every round).
    std::vector<uint32_t> into(count(), 0);
    for (uint32_t i = 0; i < count(); ++i) {
      const uint32_t* l = links(i, 0);
      for (uint32_t j = 1; j <= l[0]; ++j) ++into[l[j]];
    }
    for (int round = 0; round < 8; ++round) {
      std::vector<uint8_t> seen(count(), 0);
      size_t reached = mark_from(entry_, seen);
      if (reached == count()) break;
      for (uint32_t u = 0; u < count(); ++u) {
        if (seen[u]) continue;
        FloatDist d{dist_, vec(u), vectors_.data(), dim_};
        nearest(d, ef_construction_, s);
        // The descent through the upper levels can end on an island that level 0 does not reach from the entry
        // point, u's own among them: then a search of level 0 from the entry point, where all it finds is reached.
        if (std::none_of(s.best.begin(), s.best.end(), [&](const Cand& c) { return c.id != u && seen[c.id]; }))
          search_layer(d, entry_, d(entry_), ef_construction_, 0, s, nullptr);
        std::sort_heap(s.best.begin(), s.best.end(), nearer);
        uint32_t from = kNone;
        for (const Cand& c : s.best)
          if (c.id != u && seen[c.id] && links(c.id, 0)[0] < M0_) {
            from = c.id;
            break;
          }
        uint32_t* l = nullptr;
        if (from != kNone) {
          l = links(from, 0);
          l[1 + l[0]++] = u;
        } else {
          for (const Cand& c : s.best)
            if (c.id != u && seen[c.id]) {
              from = c.id;
              break;
            }
          if (from == kNone) continue;
          // Full: its farthest link into a node linked from elsewhere too makes way (its farthest of all where
          // none is; the next round finds what that cut off).
          l = links(from, 0);
          uint32_t far = 0;
          float far_d = -1;
          for (int shared = 1; shared >= 0 && !far; --shared)
            for (uint32_t j = 1; j <= l[0]; ++j) {
              if (shared && into[l[j]] < 2) continue;
              float dj = dist_(vec(from), vec(l[j]), dim_);
              if (dj > far_d) far = j, far_d = dj;
            }
          --into[l[far]];
          l[far] = u;
        }
        ++into[u];
        ++added;
        mark_from(u, seen);
      }
    }
    return added;
  }

  // Adds the link node -> id at a level; a full list is re-chosen by the heuristic.
  void link_back(uint32_t node, uint32_t id, float d, int level, Scratch& s, NodeLocks* locks) {
    size_t cap = level == 0 ? M0_ : M_;
    std::lock_guard<std::mutex> lk((*locks)[node]);
    uint32_t* l = links(node, level);
    if (l[0] < cap) {
      l[1 + l[0]++] = id;
      return;
    }
    s.pruned.assign(1, {d, id});
    for (uint32_t j = 1; j <= l[0]; ++j) s.pruned.push_back({dist_(vec(node), vec(l[j]), dim_), l[j]});
    std::sort(s.pruned.begin(), s.pruned.end(), nearer);
    select_neighbours(s.pruned, cap);
    l[0] = uint32_t(s.pruned.size());
    for (size_t j = 0; j < s.pruned.size(); ++j) l[1 + j] = s.pruned[j].id;
  }

  void insert(uint32_t id, Scratch& s, NodeLocks* locks) {
    FloatDist d{dist_, vec(id), vectors_.data(), dim_};
    int level = levels_[id];
    // A node that raises the top level holds this lock for its whole insertion,
    // so no thread enters the graph through its half-linked upper levels.
    std::unique_lock<std::mutex> top(entry_mutex_);
    uint32_t ep = entry_;
    int top_level = max_level_;
    if (level <= top_level) top.unlock();
    if (ep == kNone) {
      entry_ = id;
      max_level_ = level;
      return;
    }
    float ep_dist = d(ep);
    for (int l = top_level; l > level; --l) greedy(d, ep, ep_dist, l, s, locks);
    for (int l = std::min(level, top_level); l >= 0; --l) {
      search_layer(d, ep, ep_dist, ef_construction_, l, s, locks);
      std::sort_heap(s.best.begin(), s.best.end(), nearer);
      ep = s.best[0].id;
      ep_dist = s.best[0].dist;
      select_neighbours(s.best, M_);
      {
        std::lock_guard<std::mutex> lk((*locks)[id]);
        uint32_t* own = links(id, l);
        own[0] = uint32_t(s.best.size());
        for (size_t j = 0; j < s.best.size(); ++j) own[1 + j] = s.best[j].id;
      }
      for (const Cand& c : s.best) link_back(c.id, id, c.dist, l, s, locks);
    }
    if (level > top_level) {
      entry_ = id;
      max_level_ = level;
    }
  }

  // Coordinate i of quantized node j, as its code stands for it.
  float decoded(size_t j, size_t i) const { return lo_[i] + scale_[i] * float(codes_[j * dim_ + i]); }

  // f(j) of the first n nodes, in cache (norms_ or spreads_), kept once computed; a float graph that grew gets
  // its new nodes' on the next call (add() only appends). Callers hold rw_.
  template <class F>
  const float* per_node(std::vector<float>& cache, size_t n, F f) const {
    std::lock_guard<std::mutex> lk(norms_mutex_);
    cache.reserve(n);
    for (size_t j = cache.size(); j < n; ++j) cache.push_back(f(j));
    return cache.data();
  }

  // ||x_j||^2 (decoded, where quantized).
  const float* node_norms(size_t n) const {
    return per_node(norms_, n, [this](size_t j) {
      double sq = 0;
      for (size_t i = 0; i < dim_; ++i) {
        float x = quantized_ ? decoded(j, i) : vectors_[j * dim_ + i];
        sq += double(x) * x;
      }
      return float(sq);
    });
  }

  // ||c_j - 128|| of each node's codes (screen_block's bound).
  const float* code_spreads(size_t n) const {
    return per_node(spreads_, n, [this](size_t j) {
      int64_t sq = 0;
      for (size_t i = 0; i < dim_; ++i) {
        int64_t c = int64_t(codes_[j * dim_ + i]) - 128;
        sq += c * c;
      }
      return float(std::sqrt(double(sq)));
    });
  }

  // exact_search's screen, for a block of bq queries (mapped: q_i s_i; m: q.lo, ||q||^2) over codes: leaves each
  // query's kept nearest, by exact distance, ties by id, as a max-heap in s.best[r * kept ..).
  //
  // With a = q s, a.c is first taken in integers: a ~ delta r, r of 7 bits, e = a - delta r, and
  //   a.c = delta (r.c) + 128 sum(e) + e.(c - 128),  |e.(c - 128)| <= ||e|| ||c - 128||  (Cauchy-Schwarz).
  // So every node's exact distance lies within a known band around an estimate from integer products (128
  // sum(e) is the same for every node: it matters only to where the estimates stand against l2's clamp at 0).
  // With T at or above the kept-th smallest upper end (cut_at), at least kept nodes lie at or below T, and a
  // node whose lower end is past T cannot be among the kept: only the others (about 1.3-1.6 x kept on the
  // benchmark sets) get their exact product in floats. The answer is the unscreened one's, float rounding of
  // the two ways included (kappa).
  void screen_block(const float* mapped, const Mapped& m, size_t bq, size_t n, size_t kept, const float* norms,
                    const float* spreads, Scratch& s) const {
    constexpr float kLevels = 63;  // 7 bits: vpmaddubsw's pair sums cannot saturate (2 x 255 x 63 < 2^15)
    const size_t dpad = (dim_ + kIdotPad - 1) / kIdotPad * kIdotPad;
    const bool l2 = norms != nullptr;
    const float w = l2 ? 2.0f : 1.0f;  // the distance's multiple of q.x: ||q||^2 - 2 q.x + ||x||^2, or -q.x
    // Float rounding of the estimate and of the exact product, each a sum of at most dim + a few terms, stays
    // within kappa times the sum of the terms' magnitudes.
    const float kappa = float(dim_ + 64) * 0x1p-22f;
    float delta[kDotQueries], shift[kDotQueries], err[kDotQueries], fixed[kDotQueries];
    s.qint.assign(bq * dpad, 0);
    for (size_t r = 0; r < bq; ++r) {
      const float* a = mapped + r * dim_;
      float amax = 0;
      double magnitude = 0;
      for (size_t i = 0; i < dim_; ++i) {
        amax = std::max(amax, std::fabs(a[i]));
        magnitude += std::fabs(a[i]);
      }
      const float dl = amax > 0 ? amax / kLevels : 1.0f, inv = 1 / dl;
      double esum = 0, e2 = 0;
      for (size_t i = 0; i < dim_; ++i) {
        const float v = a[i] * inv;  // rounded half away from zero (nearbyint is a call without SSE4.1)
        const float t = std::clamp(float(int32_t(v + (v < 0 ? -0.5f : 0.5f))), -kLevels, kLevels);
        s.qint[r * dpad + i] = int8_t(t);
        double e = double(a[i]) - double(dl) * t;
        esum += e;
        e2 += e * e;
      }
      delta[r] = dl;
      shift[r] = float(128 * esum);
      err[r] = w * float(std::sqrt(e2)) * (1 + kappa);
      fixed[r] = kappa * ((l2 ? m.qn[r] : 0.0f) + w * float(std::fabs(m.base[r]) + 255 * magnitude));
    }
    s.idots.resize(bq * n);
    idot_rows(s.qint.data(), bq, codes_.data(), n, dim_, s.idots.data());
    s.dots.resize(n);
    s.ups.resize(n);
    s.band.resize(n);
    s.best.resize(bq * kept);
    for (size_t r = 0; r < bq; ++r) {
      // Each node's band [low, up] (branch-free loops over arrays, for the vectorizer).
      const int32_t* dots = s.idots.data() + r * n;
      float* low = s.dots.data();
      float* up = s.ups.data();
      const float off = m.base[r] + shift[r], dl = delta[r], e = err[r], f = fixed[r], qn = m.qn[r];
      if (l2) {
        for (size_t j = 0; j < n; ++j) {
          const float est = (qn - 2 * (off + dl * float(dots[j]))) + norms[j];
          const float tol = e * spreads[j] + (f + kappa * norms[j]);
          low[j] = est - tol;
          up[j] = est + tol;
        }
      } else {
        for (size_t j = 0; j < n; ++j) {
          const float est = -(off + dl * float(dots[j]));
          const float tol = e * spreads[j] + f;
          low[j] = est - tol;
          up[j] = est + tol;
        }
      }
      // An l2 distance is clamped at 0: nodes whose lower end is at most 0 may tie at 0 with the kept.
      const float top = cut_at(up, n, kept, s.mins);
      const float cut = l2 ? std::max(top, 0.0f) : top;
      size_t through = 0;
      for (size_t j = 0; j < n; ++j) {
        s.band[through] = uint32_t(j);
        through += low[j] <= cut;
      }
      float* exact = s.dots.data();  // in place of the lower ends
      dot_some(mapped + r * dim_, codes_.data(), s.band.data(), through, dim_, exact);
      for (size_t j = 0; j < through; ++j)
        exact[j] = m.distance(r, exact[j], l2 ? norms[s.band[j]] : 0.0f, l2);
      const uint32_t* band = s.band.data();
      if (through > kept + kept / 4)  // fewer into the heap: the nodes at or below a cut of the exact distances
        through = keep_below_cut(exact, [band](size_t j) { return band[j]; }, through, kept, s.band, s.mins);
      keep_nearest(exact, [band](size_t j) { return band[j]; }, through, kept, s.best.data() + r * kept);
    }
  }

  bool consistent() const {
    if (count() == 0) return entry_ == kNone && max_level_ == -1;
    if (entry_ >= count() || max_level_ != levels_[entry_]) return false;
    if (!linked_) return true;  // (load(links=False): no links to check)
    for (uint32_t i = 0; i < count(); ++i)
      for (int level = 0; level <= levels_[i]; ++level) {
        const uint32_t* l = links(i, level);
        if (l[0] > (level == 0 ? M0_ : M_)) return false;
        for (uint32_t j = 1; j <= l[0]; ++j)
          if (l[j] >= count() || levels_[l[j]] < level) return false;  // a link must exist on its level
      }
    return true;
  }

  size_t dim_, M_, M0_, ef_construction_;
  uint64_t seed_;
  Metric metric_;
  DistanceFn dist_;
  double level_mult_;
  float alpha_sq_;                           // select_neighbours' alpha, squared (l2 distances are squared)
  bool repair_;                              // add() ends with reconnect()
  size_t repaired_ = 0;
  std::vector<float> vectors_;               // size x dim, unless quantized
  bool quantized_ = false;                   // SQ8: codes_ (size x dim), lo_ and scale_ (dim) instead
  bool linked_ = true;                       // false: loaded without links0_ and upper_ (exact_search only)
  std::vector<uint8_t> codes_;
  std::vector<float> lo_, scale_;
  std::vector<uint32_t> links0_;             // size x (1 + 2M)
  std::vector<std::vector<uint32_t>> upper_; // per node: level x (1 + M)
  std::vector<uint8_t> levels_;
  uint32_t entry_ = kNone;
  int max_level_ = -1;
  std::mutex entry_mutex_;                   // entry_ and max_level_ during a build
  mutable std::shared_mutex rw_;             // add() excludes everything else
  mutable std::mutex norms_mutex_;           // norms_ and spreads_, filled by searches that share rw_
  mutable std::vector<float> norms_;         // exact_search's ||x_j||^2 (l2)
  mutable std::vector<float> spreads_;       // screen_block's ||c_j - 128|| (codes)
};

using FloatMatrix = nb::ndarray<const float, nb::c_contig, nb::device::cpu>;

void check_rows(const FloatMatrix& a, size_t dim, const char* name) {
  if (a.ndim() == 2 && a.shape(1) == dim) return;
  throw std::invalid_argument(std::string(name) + " must have shape (n, " + std::to_string(dim) + "), got " +
                              shape_of(a));
}

// A search's binding: checks, the (ids, dists) arrays of nq x k, the search without the GIL.
template <class Search>
auto top_k(const Graph& g, const FloatMatrix& queries, int64_t k, int num_threads, Search search) {
  check_rows(queries, g.dim(), "queries");
  if (k <= 0) throw std::invalid_argument("k must be positive, got " + std::to_string(k));
  size_t threads = pool_threads(num_threads);
  size_t nq = queries.shape(0), kk = size_t(k);
  auto ids = std::make_unique<int32_t[]>(nq * kk);
  auto dists = std::make_unique<float[]>(nq * kk);
  {
    nb::gil_scoped_release unlocked;
    search(queries.data(), nq, kk, threads, ids.get(), dists.get());
  }
  return std::make_pair(to_numpy(std::move(ids), {nq, kk}), to_numpy(std::move(dists), {nq, kk}));
}

}  // namespace
}  // namespace fusionrag

void bind_graph(nb::module_& m) {
  using namespace fusionrag;
  m.def("dot_isa", [] { return std::string(dot_isa()); },
        "The build of exact_search's kernels this CPU runs: baseline, avx2, avxvnni or avx512vnni (environment "
        "FUSIONRAG_DOT_ISA, read once, asks for one where the CPU has it).");
  nb::class_<Graph>(m, "Graph", "HNSW navigation graph over float32 vectors (ids are insertion order).")
      .def(
          "__init__",
          [](Graph* g, int64_t dim, const std::string& metric, int64_t M, int64_t ef_construction, uint64_t seed,
             float alpha, bool repair) {
            if (dim < 1 || dim > kMaxDim)
              throw std::invalid_argument("dim must be in [1, 2^20], got " + std::to_string(dim));
            if (M < 2 || M > kMaxM) throw std::invalid_argument("M must be in [2, 4096], got " + std::to_string(M));
            if (ef_construction < 1)
              throw std::invalid_argument("ef_construction must be positive, got " + std::to_string(ef_construction));
            if (!(alpha >= 1.0f && alpha <= 4.0f))
              throw std::invalid_argument("alpha must be in [1, 4], got " + std::to_string(alpha));
            new (g) Graph(size_t(dim), parse_metric(metric), size_t(M), size_t(ef_construction), seed, alpha, repair);
          },
          "dim"_a, "metric"_a = "l2", "M"_a = 16, "ef_construction"_a = 200, "seed"_a = 0, "alpha"_a = kAlpha,
          "repair"_a = true,
          "alpha: links a node keeps (1: HNSW's heuristic; more keeps longer links, as DiskANN's RobustPrune; l2\n"
          "only). repair: add() ends by linking every node that level 0 cannot reach from the entry point.")
      .def(
          "add",
          [](Graph& g, FloatMatrix vectors, int num_threads) {
            check_rows(vectors, g.dim(), "vectors");
            size_t threads = pool_threads(num_threads);
            nb::gil_scoped_release unlocked;
            g.add(vectors.data(), vectors.shape(0), threads);
          },
          "vectors"_a, "num_threads"_a = 0, "Append vectors; they get ids size .. size+n-1.")
      .def(
          "search",
          [](const Graph& g, FloatMatrix queries, int64_t k, int64_t ef, int num_threads,
             std::optional<nb::ndarray<const int32_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>> entries) {
            size_t beam = size_t(std::max<int64_t>(ef, 0));
            if (entries && queries.ndim() == 2 && entries->shape(0) != queries.shape(0))
              throw std::invalid_argument("entries must have one node per query: " + std::to_string(entries->shape(0)) +
                                          " for " + std::to_string(queries.shape(0)) + " queries");
            const int32_t* start = entries ? entries->data() : nullptr;
            return top_k(g, queries, k, num_threads, [&](const float* q, size_t nq, size_t kk, size_t threads,
                                                         int32_t* ids, float* dists) {
              g.search(q, nq, kk, beam, threads, ids, dists, start);
            });
          },
          "queries"_a, "k"_a, "ef"_a, "num_threads"_a = 0, "entries"_a = nb::none(),
          "Top-k (ids int32, dists float32), ascending, beam max(ef, k); rows padded with -1 / inf.\n"
          "entries: int32, a node per query whose level-0 search starts there instead of descending from the\n"
          "entry point (a node the query is known to be near: the build's own cluster of a row); -1 descends.")
      .def(
          "exact_search",
          [](const Graph& g, FloatMatrix queries, int64_t k, int num_threads, bool screen) {
            check_rows(queries, g.dim(), "queries");
            const float* q = queries.data();
            for (size_t i = 0, total = queries.shape(0) * queries.shape(1); i < total; ++i)
              if (!std::isfinite(q[i])) throw std::invalid_argument("queries must be finite (a NaN or inf at row " +
                                                                    std::to_string(i / g.dim()) + ")");
            return top_k(g, queries, k, num_threads, [&](const float* q, size_t nq, size_t kk, size_t threads,
                                                         int32_t* ids, float* dists) {
              g.exact_search(q, nq, kk, threads, ids, dists, screen);
            });
          },
          "queries"_a, "k"_a, "num_threads"_a = 0, "screen"_a = true,
          "The k nearest nodes by exact distance to every node's vector (decoded from its codes when quantized),\n"
          "ascending, ties by id: (ids int32, dists float32), rows padded with -1 / inf. No copy of the vectors.\n"
          "screen: on codes of 64 dimensions or more, where k is at most a quarter of the nodes, first rule out by\n"
          "integer products the nodes that cannot be among the k (the same answer; False: every node's exact\n"
          "product, for comparison).")
      .def(
          "save", [](const Graph& g, const std::filesystem::path& path) { g.save(path.string()); }, "path"_a,
          nb::call_guard<nb::gil_scoped_release>())
      .def_static(
          "load",
          [](const std::filesystem::path& path, bool quantize, bool links) {
            return Graph::load(path.string(), quantize, links);
          },
          "path"_a, "quantize"_a = false, "links"_a = true, nb::call_guard<nb::gil_scoped_release>(),
          "Reads a file written by save(); ValueError if it is not whole. quantize: keep the vectors as 8-bit\n"
          "codes per dimension (SQ8, a quarter of the memory, approximate distances); such a graph only searches.\n"
          "links=False: leave the links on disk (for exact_search alone, as an index that navigates exactly uses\n"
          "it; 4 (1 + 2M) B a node less): search, add, repair, reachable and save then raise ValueError.")
      .def("repair", &Graph::repair, nb::call_guard<nb::gil_scoped_release>(),
           "Link every node that level 0 cannot reach from the entry point (what add() ends with where repair is\n"
           "on); returns the links added.")
      .def("reachable", &Graph::reachable, nb::call_guard<nb::gil_scoped_release>(),
           "How many nodes a search can reach on level 0 from the entry point.")
      .def_prop_ro("repaired", &Graph::repaired, "Links add() or repair() added to reach nodes out of reach (since\n"
                   "the graph was made or loaded).")
      .def_prop_ro("size", &Graph::size)
      .def_prop_ro("dim", &Graph::dim)
      .def_prop_ro("metric", [](const Graph& g) { return std::string(metric_name(g.metric())); })
      .def_prop_ro("quantized", &Graph::quantized, "Whether the vectors are held as SQ8 codes (load(quantize=True)).")
      .def_prop_ro("linked", &Graph::linked, "Whether the links are held (False after load(links=False)).")
      .def("memory_bytes", &Graph::memory_bytes, "Bytes held by vectors (or codes) and links.")
      .def("vectors", [](const Graph& g) {
        size_t rows;
        auto out = g.copy_vectors(rows);
        return to_numpy(std::move(out), {rows, g.dim()});
      }, "A copy of the vectors, row i = node i (decoded from the codes when quantized).")
      .def("__len__", &Graph::size)
      .def("__repr__", [](const Graph& g) {
        return "Graph(dim=" + std::to_string(g.dim()) + ", metric='" + metric_name(g.metric()) +
               "', size=" + std::to_string(g.size()) + (g.quantized() ? ", quantized=True)" : ")");
      });
}
