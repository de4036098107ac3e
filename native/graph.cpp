// The navigation graph over posting-list centroids: a multi-layer HNSW
// (Malkov & Yashunin) in the manner of hnswlib. Fixed-size neighbour lists
// (2*M links on level 0, M above), the diversity heuristic for choosing links,
// per-node locks for a multi-threaded build, and per-thread search scratch.
// A loaded graph may keep its vectors as 8-bit codes (SQ8): it then only searches.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/filesystem.h>
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
#include "threadpool.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace fusionrag {
namespace {

constexpr uint32_t kNone = std::numeric_limits<uint32_t>::max();
constexpr int kMaxLevel = 32;
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
inline float* align_lines(float* p) {
  return reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(p) + 63) & ~uintptr_t(63));
}

// The first `found` of best (ascending) as a row of k ids and distances, padded with -1 / +inf.
inline void put_row(const std::vector<Cand>& best, size_t found, size_t k, int32_t* ids, float* dists) {
  for (size_t j = 0; j < found; ++j) {
    ids[j] = int32_t(best[j].id);
    dists[j] = best[j].dist;
  }
  for (size_t j = found; j < k; ++j) {
    ids[j] = -1;
    dists[j] = std::numeric_limits<float>::infinity();
  }
}

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
  Graph(size_t dim, Metric metric, size_t M, size_t ef_construction, uint64_t seed)
      : dim_(dim), M_(M), M0_(2 * M), ef_construction_(ef_construction), seed_(seed),
        metric_(metric), dist_(distance_fn(metric)), level_mult_(1.0 / std::log(double(M))) {}

  size_t size() const {
    std::shared_lock<std::shared_mutex> r(rw_);
    return count();
  }
  size_t dim() const { return dim_; }
  Metric metric() const { return metric_; }
  bool quantized() const { return quantized_; }

  size_t memory_bytes() const {
    std::shared_lock<std::shared_mutex> r(rw_);
    size_t bytes = vectors_.capacity() * sizeof(float) + codes_.capacity() +
                   (lo_.capacity() + scale_.capacity()) * sizeof(float) +
                   links0_.capacity() * sizeof(uint32_t) + levels_.capacity() + upper_.capacity() * sizeof(upper_[0]);
    for (const auto& u : upper_) bytes += u.capacity() * sizeof(uint32_t);
    std::lock_guard<std::mutex> lk(norms_mutex_);
    return bytes + norms_.capacity() * sizeof(float);
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
    ThreadPool::instance().parallel_for(n, threads, [&](size_t i, size_t) {
      insert(uint32_t(first + i), Scratch::local(), &locks);
    });
  }

  // Writes the k nearest of each query (ascending), padding with -1 / +inf.
  void search(const float* queries, size_t nq, size_t k, size_t ef, size_t threads, int32_t* ids,
              float* dists) const {
    std::shared_lock<std::shared_mutex> r(rw_);
    ef = std::max(ef, k);
    ThreadPool::instance().parallel_for(nq, threads, [&](size_t i, size_t) {
      Scratch& s = Scratch::local();
      const float* q = queries + i * dim_;
      size_t found = 0;
      if (entry_ != kNone) {
        if (quantized_)
          nearest(sq8_query(q, s), ef, s);
        else
          nearest(FloatDist{dist_, q, vectors_.data(), dim_}, ef, s);
        std::sort_heap(s.best.begin(), s.best.end(), nearer);
        found = std::min(k, s.best.size());
      }
      put_row(s.best, found, k, ids + i * k, dists + i * k);
    });
  }

  // The k nearest of every node (not the graph's approximation), nearest first, ties by id: what probing
  // all lists means, and where navigation is exhaustive (tiers.exhaustive_is_cheap), each query's lists.
  // Blocks of kDotQueries queries take inner products with the nodes' codes (or floats) in place: no
  // decoded copy of the vectors, and no BLAS buffers.
  void exact_search(const float* queries, size_t nq, size_t k, size_t threads, int32_t* ids, float* dists) const {
    std::shared_lock<std::shared_mutex> r(rw_);
    const size_t n = count();
    const float* norms = metric_ == Metric::L2 ? node_norms(n) : nullptr;
    const size_t kept = std::min(k, n);
    ThreadPool::instance().parallel_for((nq + kDotQueries - 1) / kDotQueries, threads, [&](size_t b, size_t) {
      Scratch& s = Scratch::local();
      const size_t q0 = b * kDotQueries, bq = std::min(kDotQueries, nq - q0);
      const float* q = queries + q0 * dim_;
      float base[kDotQueries] = {}, qn[kDotQueries] = {};
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
        base[r] = float(lo);
        qn[r] = float(sq);
      }
      s.dots.resize(bq * n);
      if (quantized_)
        dot_rows(mapped, bq, codes_.data(), n, dim_, s.dots.data());
      else
        dot_rows(mapped, bq, vectors_.data(), n, dim_, s.dots.data());
      for (size_t r = 0; r < bq; ++r) {
        float* dist = s.dots.data() + r * n;  // in place of the inner products
        if (norms)
          for (size_t j = 0; j < n; ++j) dist[j] = std::max(0.0f, (qn[r] - 2 * (base[r] + dist[j])) + norms[j]);
        else
          for (size_t j = 0; j < n; ++j) dist[j] = -(base[r] + dist[j]);
        // A max-heap of the kept nearest: most nodes are turned away by one comparison with its top that the
        // branch predictor gets right (a partial sort over all of them mispredicts about half its comparisons);
        // a node that gets in replaces the top and sinks.
        auto by = [](const Cand& a, const Cand& c) { return a.dist < c.dist || (a.dist == c.dist && a.id < c.id); };
        s.best.resize(kept);
        for (size_t j = 0; j < kept; ++j) s.best[j] = {dist[j], uint32_t(j)};
        std::make_heap(s.best.begin(), s.best.end(), by);
        Cand* h = s.best.data();
        for (size_t j = kept; j < n; ++j) {
          if (!(dist[j] < h[0].dist)) continue;  // a later id at an equal distance never displaces
          const Cand c{dist[j], uint32_t(j)};
          size_t i = 0;
          for (size_t l = 1; l < kept; l = 2 * i + 1) {
            size_t big = l + 1 < kept && by(h[l], h[l + 1]) ? l + 1 : l;
            if (!by(c, h[big])) break;
            h[i] = h[big];
            i = big;
          }
          h[i] = c;
        }
        std::sort_heap(s.best.begin(), s.best.end(), by);
        put_row(s.best, kept, k, ids + (q0 + r) * k, dists + (q0 + r) * k);
      }
    });
  }

  void save(const std::string& path) const {
    if (quantized_)
      throw std::invalid_argument("quantized graph cannot be saved (its vectors are 8-bit approximations); "
                                  "load it with quantize=False to save it");
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

  static std::unique_ptr<Graph> load(const std::string& path, bool quantize) {
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
    g->links0_.resize(h.size * (1 + g->M0_));
    f.read(g->links0_.data(), g->links0_.size() * sizeof(uint32_t));
    g->upper_.resize(h.size);
    for (size_t i = 0; i < h.size; ++i) {
      g->upper_[i].resize(g->levels_[i] * (1 + g->M_));
      f.read(g->upper_[i].data(), g->upper_[i].size() * sizeof(uint32_t));
    }
    g->entry_ = h.entry;
    g->max_level_ = h.max_level;
    if (!g->consistent()) f.bad("inconsistent (bad entry point or links)");
    return g;
  }

 private:
  size_t count() const { return levels_.size(); }  // callers hold rw_
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

  // The HNSW heuristic on candidates sorted by distance to a base point: keep a
  // candidate only if it is nearer the base than any candidate kept so far.
  // Links then spread across directions, which keeps clustered data navigable.
  void select_neighbours(std::vector<Cand>& c, size_t m) const {
    if (c.size() <= m) return;
    size_t kept = 0;
    for (size_t i = 0; i < c.size() && kept < m; ++i) {
      bool diverse = true;
      for (size_t j = 0; j < kept && diverse; ++j) diverse = dist_(vec(c[i].id), vec(c[j].id), dim_) >= c[i].dist;
      if (diverse) c[kept++] = c[i];
    }
    c.resize(kept);
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

  // ||x_j||^2 of the first n nodes (decoded, where quantized), kept once computed; a float graph that grew
  // gets its new nodes' on the next call (add() only appends).
  const float* node_norms(size_t n) const {
    std::lock_guard<std::mutex> lk(norms_mutex_);
    norms_.reserve(n);
    for (size_t j = norms_.size(); j < n; ++j) {
      double sq = 0;
      for (size_t i = 0; i < dim_; ++i) {
        float x = quantized_ ? decoded(j, i) : vectors_[j * dim_ + i];
        sq += double(x) * x;
      }
      norms_.push_back(float(sq));
    }
    return norms_.data();
  }

  bool consistent() const {
    if (count() == 0) return entry_ == kNone && max_level_ == -1;
    if (entry_ >= count() || max_level_ != levels_[entry_]) return false;
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
  std::vector<float> vectors_;               // size x dim, unless quantized
  bool quantized_ = false;                   // SQ8: codes_ (size x dim), lo_ and scale_ (dim) instead
  std::vector<uint8_t> codes_;
  std::vector<float> lo_, scale_;
  std::vector<uint32_t> links0_;             // size x (1 + 2M)
  std::vector<std::vector<uint32_t>> upper_; // per node: level x (1 + M)
  std::vector<uint8_t> levels_;
  uint32_t entry_ = kNone;
  int max_level_ = -1;
  std::mutex entry_mutex_;                   // entry_ and max_level_ during a build
  mutable std::shared_mutex rw_;             // add() excludes everything else
  mutable std::mutex norms_mutex_;           // norms_, filled by searches that share rw_
  mutable std::vector<float> norms_;         // exact_search's ||x_j||^2 (l2)
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
  nb::class_<Graph>(m, "Graph", "HNSW navigation graph over float32 vectors (ids are insertion order).")
      .def(
          "__init__",
          [](Graph* g, int64_t dim, const std::string& metric, int64_t M, int64_t ef_construction, uint64_t seed) {
            if (dim < 1 || dim > kMaxDim)
              throw std::invalid_argument("dim must be in [1, 2^20], got " + std::to_string(dim));
            if (M < 2 || M > kMaxM) throw std::invalid_argument("M must be in [2, 4096], got " + std::to_string(M));
            if (ef_construction < 1)
              throw std::invalid_argument("ef_construction must be positive, got " + std::to_string(ef_construction));
            new (g) Graph(size_t(dim), parse_metric(metric), size_t(M), size_t(ef_construction), seed);
          },
          "dim"_a, "metric"_a = "l2", "M"_a = 16, "ef_construction"_a = 200, "seed"_a = 0)
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
          [](const Graph& g, FloatMatrix queries, int64_t k, int64_t ef, int num_threads) {
            size_t beam = size_t(std::max<int64_t>(ef, 0));
            return top_k(g, queries, k, num_threads, [&](const float* q, size_t nq, size_t kk, size_t threads,
                                                         int32_t* ids, float* dists) {
              g.search(q, nq, kk, beam, threads, ids, dists);
            });
          },
          "queries"_a, "k"_a, "ef"_a, "num_threads"_a = 0,
          "Top-k (ids int32, dists float32), ascending, beam max(ef, k); rows padded with -1 / inf.")
      .def(
          "exact_search",
          [](const Graph& g, FloatMatrix queries, int64_t k, int num_threads) {
            return top_k(g, queries, k, num_threads, [&](const float* q, size_t nq, size_t kk, size_t threads,
                                                         int32_t* ids, float* dists) {
              g.exact_search(q, nq, kk, threads, ids, dists);
            });
          },
          "queries"_a, "k"_a, "num_threads"_a = 0,
          "The k nearest nodes by exact distance to every node's vector (decoded from its codes when quantized),\n"
          "ascending, ties by id: (ids int32, dists float32), rows padded with -1 / inf. No copy of the vectors.")
      .def(
          "save", [](const Graph& g, const std::filesystem::path& path) { g.save(path.string()); }, "path"_a,
          nb::call_guard<nb::gil_scoped_release>())
      .def_static(
          "load", [](const std::filesystem::path& path, bool quantize) { return Graph::load(path.string(), quantize); },
          "path"_a, "quantize"_a = false, nb::call_guard<nb::gil_scoped_release>(),
          "Reads a file written by save(); ValueError if it is not whole. quantize: keep the vectors as 8-bit\n"
          "codes per dimension (SQ8, a quarter of the memory, approximate distances); such a graph only searches.")
      .def_prop_ro("size", &Graph::size)
      .def_prop_ro("dim", &Graph::dim)
      .def_prop_ro("metric", [](const Graph& g) { return std::string(metric_name(g.metric())); })
      .def_prop_ro("quantized", &Graph::quantized, "Whether the vectors are held as SQ8 codes (load(quantize=True)).")
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
