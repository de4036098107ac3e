// Heuristic re-ranking (FusionANNS, Algorithm 1): exact distances on raw vectors
// read from the SSD in mini-batches, stopping once the top-k has held still for
// beta mini-batches in a row.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <string>
#include <utility>

#include "numpy_out.h"
#include "pagefile.h"
#include "threadpool.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace fusionrag {
namespace {

// Several partial sums so the compiler vectorizes without -ffast-math.
constexpr size_t kLanes = 16;

template <class T>
float l2(const float* q, const uint8_t* record, size_t dim) {
  auto x = reinterpret_cast<const T*>(record);
  float acc[kLanes] = {};
  size_t i = 0;
  for (; i + kLanes <= dim; i += kLanes)
    for (size_t j = 0; j < kLanes; ++j) {
      float t = q[i + j] - float(x[i + j]);
      acc[j] += t * t;
    }
  float s = 0;
  for (; i < dim; ++i) {
    float t = q[i] - float(x[i]);
    s += t * t;
  }
  for (float a : acc) s += a;
  return s;
}

template <class T>
float neg_ip(const float* q, const uint8_t* record, size_t dim) {
  auto x = reinterpret_cast<const T*>(record);
  float acc[kLanes] = {};
  size_t i = 0;
  for (; i + kLanes <= dim; i += kLanes)
    for (size_t j = 0; j < kLanes; ++j) acc[j] += q[i + j] * float(x[i + j]);
  float s = 0;
  for (; i < dim; ++i) s += q[i] * float(x[i]);
  for (float a : acc) s += a;
  return -s;
}

using DistanceFn = float (*)(const float*, const uint8_t*, size_t);

template <class T>
DistanceFn pick_metric(const std::string& metric) {
  if (metric == "l2") return l2<T>;
  if (metric == "ip") return neg_ip<T>;
  throw std::invalid_argument("metric must be 'l2' or 'ip', not '" + metric + "'");
}

struct Distance {
  DistanceFn fn;
  size_t elem_bytes;
};

Distance pick_distance(const std::string& dtype, const std::string& metric) {
  if (dtype == "f32") return {pick_metric<float>(metric), 4};
  if (dtype == "u8") return {pick_metric<uint8_t>(metric), 1};
  if (dtype == "i8") return {pick_metric<int8_t>(metric), 1};
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
  DistanceFn distance;

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

  // Fetches the blocks that ids[0, n) live on, one read per distinct block, and
  // writes each id's distance from q to out. Returns blocks {from SSD, from buffer}.
  std::pair<size_t, size_t> distances(const float* q, const int64_t* ids, size_t n, float* out,
                                      std::vector<uint32_t>& blocks, AlignedBuffer& scratch) const {
    const PageLayout& layout = store.layout();
    blocks.clear();
    for (size_t j = 0; j < n; ++j)
      if (ids[j] >= 0) blocks.push_back(uint32_t(layout.block_of(locations[ids[j]])));
    std::sort(blocks.begin(), blocks.end());
    blocks.erase(std::unique(blocks.begin(), blocks.end()), blocks.end());
    const size_t bb = layout.block_bytes();
    uint8_t* data = scratch.get(std::max<size_t>(1, blocks.size()) * bb);
    size_t from_ssd = store.fetch(blocks.data(), blocks.size(), data);
    for (size_t j = 0; j < n; ++j) {
      if (ids[j] < 0) {
        out[j] = std::numeric_limits<float>::infinity();
        continue;
      }
      uint32_t slot = locations[ids[j]];
      size_t b = std::lower_bound(blocks.begin(), blocks.end(), uint32_t(layout.block_of(slot))) - blocks.begin();
      out[j] = distance(q, data + b * bb + layout.offset_in_block(slot), dim);
    }
    return {from_ssd, blocks.size() - from_ssd};
  }
};

struct Scratch {
  std::vector<uint32_t> blocks;
  AlignedBuffer data;
  std::vector<float> dist;
  std::vector<std::pair<float, int64_t>> heap;
  std::vector<int64_t> top, prev_top;
};

struct RerankParams {
  size_t k, minibatch;
  float eps;
  int64_t beta;
};

// One query; writes k ids and distances and the stats row.
void rerank_query(const Exact& ex, const RerankParams& p, const float* q, const int64_t* cand, size_t n, int64_t* ids,
                  float* dists, int64_t* stats, Scratch& s) {
  // Max-heap on (distance, id): the root is the worst kept, ties keep the smaller id.
  auto& heap = s.heap;
  heap.clear();
  s.prev_top.clear();
  size_t end = std::find(cand, cand + n, int64_t(-1)) - cand;
  int64_t batches = 0, reranked = 0, from_ssd = 0, from_buffer = 0, stable = 0;
  for (size_t pos = 0; pos < end; pos += p.minibatch) {
    size_t m = std::min(p.minibatch, end - pos);
    s.dist.resize(m);
    auto [ssd, buffered] = ex.distances(q, cand + pos, m, s.dist.data(), s.blocks, s.data);
    from_ssd += ssd, from_buffer += buffered;
    for (size_t j = 0; j < m; ++j) {
      std::pair<float, int64_t> e{s.dist[j], cand[pos + j]};
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
    ++batches, reranked += int64_t(m);

    // Delta = |S_n \ S_{n-1}| / k; the first mini-batch never counts as stable.
    s.top.clear();
    for (const auto& h : heap) s.top.push_back(h.second);
    std::sort(s.top.begin(), s.top.end());
    size_t kept = 0;
    for (size_t a = 0, b = 0; a < s.top.size() && b < s.prev_top.size();) {
      if (s.top[a] < s.prev_top[b]) ++a;
      else if (s.prev_top[b] < s.top[a]) ++b;
      else ++kept, ++a, ++b;
    }
    float delta = float(s.top.size() - kept) / float(p.k);
    stable = (batches > 1 && delta <= p.eps) ? stable + 1 : 0;
    std::swap(s.top, s.prev_top);
    if (p.beta > 0 && stable >= p.beta) break;
  }
  std::sort_heap(heap.begin(), heap.end());
  for (size_t j = 0; j < p.k; ++j) {
    ids[j] = j < heap.size() ? heap[j].second : -1;
    dists[j] = j < heap.size() ? heap[j].first : std::numeric_limits<float>::infinity();
  }
  stats[0] = batches, stats[1] = reranked, stats[2] = from_ssd, stats[3] = from_buffer;
}

size_t threads_for(int num_threads) {
  if (num_threads < 0) throw std::invalid_argument("num_threads must not be negative (0 = all cores)");
  return num_threads ? size_t(num_threads) : ThreadPool::instance().size();
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
         const std::string& metric, int64_t k, int64_t minibatch, float eps, int64_t beta, int num_threads) {
        Exact ex(store, queries, locations, dtype, metric);
        check_rows(queries, candidates, "candidates");
        if (k <= 0) throw std::invalid_argument("k must be positive");
        if (minibatch <= 0) throw std::invalid_argument("minibatch must be positive");
        const RerankParams p{size_t(k), size_t(minibatch), eps, beta};
        const size_t nq = queries.shape(0), n = candidates.shape(1), threads = threads_for(num_threads);
        NumpyOut<int64_t> ids({nq, p.k}), stats({nq, 4});
        NumpyOut<float> dists({nq, p.k});
        NumpyOut<double> seconds({nq});
        {
          nb::gil_scoped_release nogil;
          for (size_t i = 0; i < nq; ++i) ex.validate(candidates.data() + i * n, n, true);
          std::vector<Scratch> scratch(std::min(threads, std::max<size_t>(1, nq)));
          ThreadPool::instance().parallel_for(nq, scratch.size(), [&](size_t i, size_t worker) {
            auto t0 = std::chrono::steady_clock::now();
            rerank_query(ex, p, queries.data() + i * ex.dim, candidates.data() + i * n, n, ids.data() + i * p.k,
                         dists.data() + i * p.k, stats.data() + i * 4, scratch[worker]);
            seconds.data()[i] = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
          });
        }
        return nb::make_tuple(ids.release(), dists.release(), stats.release(), seconds.release());
      },
      "store"_a, "queries"_a, "candidates"_a, "locations"_a, "dtype"_a, "metric"_a, "k"_a, "minibatch"_a, "eps"_a,
      "beta"_a, "num_threads"_a = 0,
      "Exact top-k of each query's PQ-ranked candidates (best first, -1 padded), read from the page file in "
      "mini-batches with early stop. Returns (ids int64[q,k], dists float32[q,k], stats int64[q,4] = "
      "[minibatches, candidates re-ranked, blocks from SSD, blocks from buffer], seconds float64[q]).");

  m.def(
      "exact_distances",
      [](PageStore& store, Queries queries, IdMatrix ids, Locations locations, const std::string& dtype,
         const std::string& metric, int num_threads) {
        Exact ex(store, queries, locations, dtype, metric);
        check_rows(queries, ids, "ids");
        const size_t nq = queries.shape(0), n = ids.shape(1), threads = threads_for(num_threads);
        NumpyOut<float> out({nq, n});
        {
          nb::gil_scoped_release nogil;
          for (size_t i = 0; i < nq; ++i) ex.validate(ids.data() + i * n, n, false);
          std::vector<Scratch> scratch(std::min(threads, std::max<size_t>(1, nq)));
          ThreadPool::instance().parallel_for(nq, scratch.size(), [&](size_t i, size_t worker) {
            constexpr size_t kBatch = 64;  // one batched read per 64 ids bounds the scratch
            for (size_t j = 0; j < n; j += kBatch)
              ex.distances(queries.data() + i * ex.dim, ids.data() + i * n + j, std::min(kBatch, n - j),
                           out.data() + i * n + j, scratch[worker].blocks, scratch[worker].data);
          });
        }
        return out.release();
      },
      "store"_a, "queries"_a, "ids"_a, "locations"_a, "dtype"_a, "metric"_a, "num_threads"_a = 0,
      "Exact distance (float32[q,n]) of each query to each listed id, read through the page buffer; -1 gives inf.");
}
