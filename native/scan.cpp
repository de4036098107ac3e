// The CPU filter tier: what the GPU does in FusionANNS, done on the CPU for
// machines without one. Per query: gather the IDs of the probed posting lists,
// drop duplicates (boundary replication puts a vector in up to 8 lists), score
// each by asymmetric distance computation (ADC) against the query's PQ table,
// and keep the n best.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/tuple.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "threadpool.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace fusionrag {
namespace {

constexpr size_t kCodebook = 256;  // centroids per PQ sub-space: one uint8 code

template <class T>
using Array = nb::ndarray<const T, nb::c_contig, nb::device::cpu>;

template <class A>
std::string shape_of(const A& a) {
  std::string s = "(";
  for (size_t i = 0; i < a.ndim(); ++i) s += (i ? ", " : "") + std::to_string(a.shape(i));
  return s + (a.ndim() == 1 ? ",)" : ")");
}

template <class T>
void check_ndim(const Array<T>& a, size_t ndim, const char* name) {
  if (a.ndim() != ndim)
    throw std::invalid_argument(std::string(name) + " must be " + std::to_string(ndim) + "-D, got shape " +
                                shape_of(a));
}

template <class T>
nb::ndarray<nb::numpy, T> to_numpy(std::unique_ptr<T[]> data, std::initializer_list<size_t> shape) {
  T* p = data.release();
  nb::capsule owner(p, [](void* v) noexcept { delete[] static_cast<T*>(v); });
  return nb::ndarray<nb::numpy, T>(p, shape, owner);
}

size_t pool_threads(int num_threads) {
  if (num_threads < 0) throw std::invalid_argument("num_threads must be >= 0, got " + std::to_string(num_threads));
  return num_threads ? size_t(num_threads) : ThreadPool::instance().size();
}

// Posting lists in CSR form. Offsets are checked only for the lists a query
// probes, so a call costs nothing per list it does not touch.
struct Lists {
  const int32_t* probes;  // q x m, -1 = no list
  size_t q, m;
  const int64_t* offsets;  // C + 1
  size_t num_lists;
  const uint32_t* ids;
  size_t total;

  Lists(const Array<int32_t>& probe_lists, const Array<int64_t>& list_offsets, const Array<uint32_t>& list_ids) {
    check_ndim(probe_lists, 2, "probe_lists");
    check_ndim(list_offsets, 1, "list_offsets");
    check_ndim(list_ids, 1, "list_ids");
    if (list_offsets.shape(0) < 1) throw std::invalid_argument("list_offsets must hold C+1 >= 1 entries");
    probes = probe_lists.data();
    q = probe_lists.shape(0);
    m = probe_lists.shape(1);
    offsets = list_offsets.data();
    num_lists = list_offsets.shape(0) - 1;
    ids = list_ids.data();
    total = list_ids.shape(0);
  }

  // Calls fn(begin, end) for each list query i probes.
  template <class Fn>
  void for_each_list(size_t i, Fn&& fn) const {
    for (size_t j = 0; j < m; ++j) {
      int32_t c = probes[i * m + j];
      if (c == -1) continue;
      if (c < 0 || size_t(c) >= num_lists)
        throw std::invalid_argument("probe_lists[" + std::to_string(i) + ", " + std::to_string(j) + "] = " +
                                    std::to_string(c) + " is not a list in [0, " + std::to_string(num_lists) + ")");
      int64_t lo = offsets[c], hi = offsets[c + 1];
      if (lo < 0 || lo > hi || uint64_t(hi) > total)
        throw std::invalid_argument("list_offsets[" + std::to_string(c) + ":" + std::to_string(c + 2) +
                                    "] is not a range inside list_ids (length " + std::to_string(total) + ")");
      fn(ids + lo, ids + hi);
    }
  }
};

// Per-query PQ tables and the codes they score.
struct Codes {
  const float* luts;  // q x M x 256
  const uint8_t* codes;  // N x M
  size_t M, N;

  Codes(const Array<float>& lut_array, const Array<uint8_t>& code_array, size_t q) {
    check_ndim(lut_array, 3, "luts");
    check_ndim(code_array, 2, "codes");
    if (lut_array.shape(0) != q || lut_array.shape(2) != kCodebook)
      throw std::invalid_argument("luts must have shape (" + std::to_string(q) + ", M, 256), got " +
                                  shape_of(lut_array));
    M = lut_array.shape(1);
    if (M == 0 || code_array.shape(1) != M)
      throw std::invalid_argument("codes must have shape (N, " + std::to_string(M) + ") to match luts, got " +
                                  shape_of(code_array));
    luts = lut_array.data();
    codes = code_array.data();
    N = code_array.shape(0);
  }

  const float* lut(size_t query) const { return luts + query * M * kCodebook; }

  // Several partial sums so consecutive table lookups do not wait on one add chain.
  float adc(const float* lut, size_t id) const {
    const uint8_t* c = codes + id * M;
    float s[4] = {0, 0, 0, 0};
    size_t m = 0;
    for (; m + 4 <= M; m += 4)
      for (size_t j = 0; j < 4; ++j) s[j] += lut[(m + j) * kCodebook + c[m + j]];
    for (; m < M; ++m) s[0] += lut[m * kCodebook + c[m]];
    return (s[0] + s[1]) + (s[2] + s[3]);
  }
};

// (distance, id) packed into one integer whose order is distance first, then
// id: selection and sorting become plain integer compares with the tie rule built in.
uint64_t rank_key(float d, uint32_t id) {
  uint32_t u;
  d += 0.0f;  // -0 -> +0, so equal distances tie
  std::memcpy(&u, &d, 4);
  u = (u & 0x80000000u) ? ~u : (u | 0x80000000u);  // IEEE order as unsigned order
  return (uint64_t(u) << 32) | id;
}

float key_distance(uint64_t key) {
  uint32_t u = uint32_t(key >> 32);
  u = (u & 0x80000000u) ? (u & 0x7fffffffu) : ~u;
  float d;
  std::memcpy(&d, &u, 4);
  return d;
}

// State kept per thread between calls (thread-local, since two Python threads
// may scan at once). The seen-bitmap costs N/8 bytes and must start all zero,
// which is cheaper to restore after each query than to allocate.
struct ScanScratch {
  std::vector<uint64_t> seen;  // bit id set: id already a candidate of this query
  std::vector<std::pair<const uint32_t*, const uint32_t*>> ranges;  // the probed lists
  std::vector<uint32_t> unique;
  std::vector<uint64_t> keys;

  // Not inlined: seen through an inlined accessor, GCC re-derives the
  // thread-local address after every call in the scan loop.
  __attribute__((noinline)) static ScanScratch& local(size_t n_codes) {
    thread_local ScanScratch s;
    if (s.seen.size() * 64 < n_codes) s.seen.resize((n_codes + 63) / 64, 0);
    return s;
  }
};

struct ScanOut {
  int64_t* ids;
  float* dists;
  int64_t* counts;
  double* seconds;
};

void scan_query(size_t i, const Lists& lists, const Codes& pq, const uint8_t* exclude, size_t n, const ScanOut& out) {
  auto start = std::chrono::steady_clock::now();
  ScanScratch& s = ScanScratch::local(pq.N);
  s.unique.clear();
  // Unmarks exactly the words this query touched, also when a bad id throws.
  // A word is cleared whole: every bit set in it belongs to an id in s.unique.
  struct Unmark {
    ScanScratch& s;
    ~Unmark() {
      for (uint32_t id : s.unique) s.seen[id >> 6] = 0;
    }
  } unmark{s};
  // Lists lie scattered in memory: find and prefetch them all before reading any.
  int64_t gathered = 0;
  s.ranges.clear();
  lists.for_each_list(i, [&](const uint32_t* begin, const uint32_t* end) {
    __builtin_prefetch(begin);
    s.ranges.emplace_back(begin, end);
    gathered += end - begin;
  });
  for (auto [begin, end] : s.ranges) {
    for (const uint32_t* p = begin; p != end; ++p) {
      uint32_t id = *p;
      if (id >= pq.N)
        throw std::invalid_argument("list_ids[" + std::to_string(p - lists.ids) + "] = " + std::to_string(id) +
                                    " is out of range for " + std::to_string(pq.N) + " codes");
      if (exclude && (exclude[id >> 3] >> (id & 7) & 1)) continue;
      uint64_t& word = s.seen[id >> 6];
      uint64_t bit = uint64_t(1) << (id & 63);
      if (word & bit) continue;
      word |= bit;
      s.unique.push_back(id);
    }
  }

  const float* lut = pq.lut(i);
  size_t u = s.unique.size();
  s.keys.resize(u);
  constexpr size_t kAhead = 16;  // codes are scattered in memory; fetch them early
  for (size_t j = 0; j < u; ++j) {
    if (j + kAhead < u) __builtin_prefetch(pq.codes + size_t(s.unique[j + kAhead]) * pq.M);
    s.keys[j] = rank_key(pq.adc(lut, s.unique[j]), s.unique[j]);
  }
  size_t keep = std::min(n, u);
  std::nth_element(s.keys.begin(), s.keys.begin() + keep, s.keys.end());
  std::sort(s.keys.begin(), s.keys.begin() + keep);

  for (size_t j = 0; j < n; ++j) {
    out.ids[i * n + j] = j < keep ? int64_t(uint32_t(s.keys[j])) : -1;
    out.dists[i * n + j] = j < keep ? key_distance(s.keys[j]) : std::numeric_limits<float>::infinity();
  }
  out.counts[2 * i] = gathered;
  out.counts[2 * i + 1] = int64_t(u);
  out.seconds[i] = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

auto scan_topn(Array<float> luts, Array<int32_t> probe_lists, Array<int64_t> list_offsets, Array<uint32_t> list_ids,
               Array<uint8_t> codes, int64_t n, int num_threads, std::optional<Array<uint8_t>> exclude) {
  Lists lists(probe_lists, list_offsets, list_ids);
  Codes pq(luts, codes, lists.q);
  if (n <= 0) throw std::invalid_argument("n must be positive, got " + std::to_string(n));
  const uint8_t* excluded = nullptr;
  if (exclude) {
    check_ndim(*exclude, 1, "exclude");
    if (exclude->shape(0) != (pq.N + 7) / 8)
      throw std::invalid_argument("exclude must be a bitmap of ceil(N/8) = " + std::to_string((pq.N + 7) / 8) +
                                  " bytes, got " + std::to_string(exclude->shape(0)));
    excluded = exclude->data();
  }
  size_t q = lists.q, nn = size_t(n);
  auto ids = std::make_unique<int64_t[]>(q * nn);
  auto dists = std::make_unique<float[]>(q * nn);
  auto counts = std::make_unique<int64_t[]>(q * 2);
  auto seconds = std::make_unique<double[]>(q);
  size_t threads = pool_threads(num_threads);
  {
    nb::gil_scoped_release unlocked;
    ScanOut out{ids.get(), dists.get(), counts.get(), seconds.get()};
    ThreadPool::instance().parallel_for(q, threads,
                                        [&](size_t i, size_t) { scan_query(i, lists, pq, excluded, nn, out); });
  }
  return std::make_tuple(to_numpy(std::move(ids), {q, nn}), to_numpy(std::move(dists), {q, nn}),
                         to_numpy(std::move(counts), {q, size_t(2)}), to_numpy(std::move(seconds), {q}));
}

auto gather(Array<int32_t> probe_lists, Array<int64_t> list_offsets, Array<uint32_t> list_ids, int num_threads) {
  Lists lists(probe_lists, list_offsets, list_ids);
  size_t threads = pool_threads(num_threads);
  auto offsets = std::make_unique<int64_t[]>(lists.q + 1);
  for (size_t i = 0; i < lists.q; ++i) {  // validates every probe before anything is copied
    int64_t count = 0;
    lists.for_each_list(i, [&](const uint32_t* begin, const uint32_t* end) { count += end - begin; });
    offsets[i + 1] = offsets[i] + count;
  }
  size_t total = size_t(offsets[lists.q]);
  auto ids = std::make_unique<uint32_t[]>(total);
  {
    nb::gil_scoped_release unlocked;
    ThreadPool::instance().parallel_for(lists.q, threads, [&](size_t i, size_t) {
      uint32_t* dst = ids.get() + offsets[i];
      lists.for_each_list(i, [&](const uint32_t* begin, const uint32_t* end) { dst = std::copy(begin, end, dst); });
    });
  }
  return std::make_pair(to_numpy(std::move(ids), {total}), to_numpy(std::move(offsets), {lists.q + 1}));
}

auto pq_distances(Array<float> luts, Array<int64_t> ids, Array<uint8_t> codes, int num_threads) {
  check_ndim(ids, 2, "ids");
  size_t q = ids.shape(0), n = ids.shape(1);
  Codes pq(luts, codes, q);
  size_t threads = pool_threads(num_threads);
  auto dists = std::make_unique<float[]>(q * n);
  {
    nb::gil_scoped_release unlocked;
    ThreadPool::instance().parallel_for(q, threads, [&](size_t i, size_t) {
      for (size_t j = 0; j < n; ++j) {
        int64_t id = ids.data()[i * n + j];
        if (id < -1 || id >= int64_t(pq.N))
          throw std::invalid_argument("ids[" + std::to_string(i) + ", " + std::to_string(j) + "] = " +
                                      std::to_string(id) + " is out of range for " + std::to_string(pq.N) + " codes");
        dists[i * n + j] = id < 0 ? std::numeric_limits<float>::infinity() : pq.adc(pq.lut(i), size_t(id));
      }
    });
  }
  return to_numpy(std::move(dists), {q, n});
}

}  // namespace
}  // namespace fusionrag

void bind_scan(nb::module_& m) {
  using namespace fusionrag;
  m.def("scan_topn", &scan_topn, "luts"_a, "probe_lists"_a, "list_offsets"_a, "list_ids"_a, "codes"_a, "n"_a,
        "num_threads"_a = 0, "exclude"_a = nb::none(),
        "Per query: gather the probed posting lists (-1 entries skipped), de-duplicate, score by PQ ADC and keep\n"
        "the n nearest. Returns (ids int64[q, n], dists float32[q, n], counts int64[q, 2], seconds float64[q]):\n"
        "rows ascending by (distance, id), padded with -1 / inf; counts[:, 0] = ids gathered with duplicates,\n"
        "counts[:, 1] = unique ids scored (after exclude). exclude: uint8[ceil(N/8)], bit i (little-endian\n"
        "bit order, as np.packbits(..., bitorder='little')) set = vector i is left out.");
  m.def("gather", &gather, "probe_lists"_a, "list_offsets"_a, "list_ids"_a, "num_threads"_a = 0,
        "The ids of each query's probed lists concatenated, duplicates kept: (ids uint32[total], offsets int64[q+1]).");
  m.def("pq_distances", &pq_distances, "luts"_a, "ids"_a, "codes"_a, "num_threads"_a = 0,
        "PQ ADC distances float32[q, n] of the given ids; id -1 gives +inf.");
}
