// The SSD tier: raw vectors in a file of 4 KiB pages, read with O_DIRECT through
// a bounded DRAM page buffer. Record slot s lives in block s / records_per_block
// at byte (s % records_per_block) * record_bytes; a block is pages_per_block
// pages and every block carries a CRC32C kept by the index.
//
// Declared here, defined by concept: block_io.cpp (the BlockReader implementations, AlignedBuffer),
// page_buffer.cpp (PageBuffer, FrameMap, the zero-run code), page_store.cpp (PageStore, PageLayout,
// LayoutMiniature); page_writer.h is the writer, pagefile_bindings.cpp the Python bindings.
#pragma once
#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <unordered_set>
#include <vector>

#include "scratch_meter.h"

namespace fusionrag {

constexpr size_t kPageBytes = 4096;

// A failed system call: becomes OSError(errno, message) in Python.
struct OsError : std::runtime_error {
  OsError(int err, const std::string& what) : std::runtime_error(what), err(err) {}
  int err;
};

inline std::string errno_text(int err) { return std::strerror(err); }

struct PageLayout {
  size_t record_bytes, records_per_block, pages_per_block;

  // Throws std::invalid_argument unless records fit their blocks.
  PageLayout(size_t record_bytes, size_t records_per_block, size_t pages_per_block);
  size_t block_bytes() const { return pages_per_block * kPageBytes; }
  uint64_t block_of(uint64_t slot) const { return slot / records_per_block; }
  size_t offset_in_block(uint64_t slot) const { return (slot % records_per_block) * record_bytes; }
};

// 4096-aligned memory: O_DIRECT reads land in it.
struct AlignedBuffer {
  std::unique_ptr<uint8_t, void (*)(void*)> ptr{nullptr, free};
  size_t bytes = 0;
  uint8_t* get(size_t need);  // grows, keeps alignment, drops old contents
};

// Block -> frame of one buffer shard: open addressing with linear probing in a power-of-two table of at least
// twice the shard's frames, so that a lookup is one or two cache lines and neither a hit nor a miss allocates
// (std::unordered_map allocated a node per block taken in and freed one per block evicted, on every re-rank).
// Erase shifts the entries after it back, so there are no tombstones and probes stay short however long it runs.
class FrameMap {
 public:
  static constexpr uint32_t kNone = UINT32_MAX;  // no such key; also the empty slot's key (no block is UINT32_MAX)
  // Room for `frames` entries, all gone.
  void reset(size_t frames);
  // Memory given back; holds nothing until reset.
  void release() { slots_ = {}, mask_ = 0; }
  void clear() { std::fill(slots_.begin(), slots_.end(), Slot{kNone, 0}); }
  uint32_t find(uint32_t key) const {
    if (slots_.empty()) return kNone;
    for (size_t i = home(key);; i = (i + 1) & mask_) {
      if (slots_[i].key == key) return slots_[i].frame;
      if (slots_[i].key == kNone) return kNone;
    }
  }
  // key must not be in the map, and the map holds fewer entries than reset's frames.
  void insert(uint32_t key, uint32_t frame) {
    size_t i = home(key);
    while (slots_[i].key != kNone) i = (i + 1) & mask_;
    slots_[i] = {key, frame};
  }
  // Whether key was there.
  bool erase(uint32_t key);

 private:
  struct Slot {
    uint32_t key, frame;
  };
  size_t home(uint32_t key) const {  // murmur3's finaliser: independent of the shard hash and the samplers'
    key ^= key >> 16, key *= 0x85EBCA6Bu, key ^= key >> 13, key *= 0xC2B2AE35u, key ^= key >> 16;
    return key & mask_;
  }
  std::vector<Slot> slots_;
  size_t mask_ = 0;
};

// A compressed page buffer's unit of memory: a block held there takes as many chunks as its coded bytes need.
constexpr size_t kChunkBytes = 256;
inline size_t chunks_for(size_t bytes) { return (bytes + kChunkBytes - 1) / kChunkBytes; }

// Codes n bytes as tokens [zeros][literals][the literal bytes], each count a byte (0-255): zero runs of three or
// more become a count, anything else is copied. Returns the coded length (dst needs room for n bytes), or 0 when
// it would not be shorter than n (the bytes are better kept as they are).
size_t zero_runs_encode(const uint8_t* src, size_t n, uint8_t* dst);
// Decodes len bytes of zero_runs_encode's tokens into dst, the n bytes they code.
void zero_runs_decode(const uint8_t* src, size_t len, uint8_t* dst, size_t n);

// How the page buffer picks a victim. Clock: CLOCK, a block read once gets no
// second chance until it is hit again. Lfu: cache by use, for skewed query
// streams: a small count-min sketch per shard counts every request for a block
// (hits and misses, weighted by how many queries asked), halved every
// kAgingRequests x frames requests so that old hotness fades; a missed block is admitted
// only if requested more often than the victim (TinyLFU), and victims are
// swept by a generalised CLOCK whose per-frame counters count hits. Auto: runs
// as one or the other, whichever serves more now: both are simulated in miniature
// (metadata only, on a sample of the blocks; Waldspurger et al., ATC 2017) and the
// buffer takes the mode whose miniature served more over the last periods. Lfu
// wins on skewed streams; Clock where new blocks come back soon and never again
// (TinyLFU's admission keeps them out).
enum class BufferPolicy { Clock, Lfu, Auto };
BufferPolicy parse_buffer_policy(const std::string& name);

// The DRAM page buffer: a fixed number of block frames shared by every query and
// thread. Blocks hash onto shards with one lock each so that concurrent queries
// rarely wait on one another. Lookups copy the block out under the lock: a copy
// of 4 KiB is cheaper than pinning frames against eviction. Pinned blocks (the
// pages of the hottest posting lists, chosen off the request path) are never
// evicted; at most 3/4 of a shard's frames are pinned, so the rest still turn over.
//
// Compressed (compress_gain > 1): the same capacity x block_bytes of memory is cut into chunks of kChunkBytes and
// each block is held zero-run coded (zero_runs_encode) in a chain of as many chunks as it needs, so that blocks
// with many zero bytes (8-bit images, ReLU outputs) fit about compress_gain times as many. Victims are
// swept as before until both an entry and enough chunks are free; entries are made for a quarter more blocks than
// compress_gain promises. A block coded no shorter than its bytes is kept as it is, in block_bytes / kChunkBytes
// chunks. Lookups decode into the caller's memory under the shard's lock.
class PageBuffer {
 public:
  // active false: made off (set_active), its metadata not allocated until it is turned on.
  PageBuffer(size_t capacity, size_t block_bytes, BufferPolicy policy = BufferPolicy::Clock, bool active = true,
             double compress_gain = 0);
  ~PageBuffer();
  // Blocks its memory holds uncompressed (its bytes are capacity() x block_bytes).
  size_t capacity() const { return capacity_; }
  bool compressed() const { return compressed_; }
  // Blocks it can hold at most: capacity(), or with compression its entries.
  size_t entries() const;
  // Bytes of coded blocks held now, chunks counted whole (compressed; 0 otherwise).
  size_t chunk_bytes_held();
  BufferPolicy policy() const { return policy_; }
  // The mode it runs in now: Clock or Lfu (Auto switches between them).
  BufferPolicy mode() const { return lfu_now() ? BufferPolicy::Lfu : BufferPolicy::Clock; }
  uint64_t switches() const { return switches_.load(std::memory_order_relaxed); }
  // weight: how many queries asked for the block (Lfu counts it; Clock ignores it).
  bool lookup(uint32_t block, uint8_t* out, uint32_t weight = 1);
  void insert(uint32_t block, const uint8_t* data, uint32_t weight = 1) { offer(block, data, weight, false); }
  // insert under one lock with a lookup before it when requested (a request counted, a hit if resident), as a
  // lookup and then an insert of what it missed would; returns whether the block was resident.
  bool offer(uint32_t block, const uint8_t* data, uint32_t weight, bool requested);
  bool resident(uint32_t block);
  // Copies the block to out (when not null) if it is resident, without counting a request
  // or a use: a look that the policy does not learn from. Returns whether it was there.
  bool peek(uint32_t block, uint8_t* out);
  // Replaces the pinned set by blocks (most wanted first); returns those of them
  // not resident, which the caller reads and inserts: they are pinned as they come in.
  std::vector<uint32_t> pin(const uint32_t* blocks, size_t n);
  size_t pinned();
  void clear();
  uint64_t evictions() const { return evictions_.load(std::memory_order_relaxed); }
  // Off: empty, its frames' memory given back to the system and its metadata freed; lookups miss and inserts
  // are dropped until it is on again (PageStore's adaptive layout keeps one of its two buffers on at a time).
  void set_active(bool on);
  bool active() const { return active_.load(std::memory_order_relaxed); }
  // (uses, block) of every block held now.
  std::vector<std::pair<uint32_t, uint32_t>> held_blocks();
  // Evicts block if held, its frame's memory given back; with take, take(its bytes) first. Whether it was held.
  bool evict(uint32_t block, const std::function<void(const uint8_t*)>& take = {});

 private:
  static constexpr uint32_t kEmpty = UINT32_MAX;
  static constexpr uint8_t kMaxUses = 15;  // bounds a sweep to 16 turns of the hand
  // Requests per frame between two halvings of the counts. 20, not TinyLFU's usual 10: chosen on
  // the tuning halves of three sets' query streams by replaying their block traces
  // (bench/cache/cache_sim.py, bench/results/cache/cache_sim.md); 10 forgot a skewed stream's hot pages too soon.
  static constexpr size_t kAgingRequests = 20;
  struct Shard {
    std::mutex mutex;
    uint8_t* frames = nullptr;
    size_t size = 0;  // frames it has when active
    std::vector<uint32_t> block_of;  // frame -> block, kEmpty when free
    std::vector<uint8_t> uses;       // Clock: the referenced bit; Lfu: hits, aged by the sweep
    std::vector<uint8_t> pinned;
    FrameMap frame_of;
    std::unordered_set<uint32_t> wanted;  // blocks to pin
    size_t hand = 0, num_pinned = 0;
    std::vector<uint8_t> sketch;  // Lfu and Auto: count-min, two counters per block
    uint64_t requests = 0;
    // Compressed: the shard's memory (frames) as chunks; frame f's block starts at chunk head[f], coded in
    // coded[f] bytes (block_bytes: as it is); next[c] is the chunk after c in its chain or in the free list.
    size_t nominal = 0;  // blocks its memory holds uncompressed
    std::vector<uint32_t> next, head;
    std::vector<uint32_t> coded;
    uint32_t free_head = kEmpty;
    size_t free_chunks = 0;
  };
  // Auto: the two policies simulated on the sampled blocks, in shadows of
  // capacity / rate frames that hold no data; a period is that many sampled requests.
  struct Miniature {
    std::mutex mutex;
    Shard shadow[2];  // [0] Clock, [1] Lfu
    size_t rate = 1;
    uint64_t seen = 0, period = 1, hits[2] = {0, 0};
    double score[2] = {0, 0};  // hits, each period's half the weight of the next
  };
  size_t shard_index(uint32_t block) const { return (block * 0x9E3779B1u >> 16) % shards_.size(); }
  Shard& shard(uint32_t block) { return shards_[shard_index(block)]; }
  // Compressed: 3/4 of the blocks the memory holds uncompressed, so pinned chains leave a quarter of the chunks.
  size_t pin_limit(const Shard& s) const { return (compressed_ ? s.nominal : s.block_of.size()) * 3 / 4; }
  void count(Shard& s, uint32_t block, uint32_t weight);
  uint32_t estimate(const Shard& s, uint32_t block) const;
  size_t victim(Shard& s);
  static void init(Shard& s, size_t frames, bool sketch);
  static void reset(Shard& s);
  void init_chunks(Shard& s) const;  // every chunk free (compressed)
  void drop_frame(Shard& s, size_t f);  // frees f's entry (and chunks); its block leaves frame_of
  void store_frame(Shard& s, size_t f, const uint8_t* data, const uint8_t* coded, size_t len);
  void load_frame(const Shard& s, size_t f, uint8_t* out) const;
  void reset_miniature();
  bool lfu_now() const {
    return policy_ == BufferPolicy::Lfu || (policy_ == BufferPolicy::Auto && lfu_mode_.load(std::memory_order_relaxed));
  }
  void hit(Shard& s, size_t frame, uint32_t weight, bool lfu);
  size_t place(Shard& s, uint32_t block, uint32_t weight, bool lfu, bool pin, size_t need, size_t* evicted);
  void simulate(uint32_t block, uint32_t weight);
  bool mini_sampled(uint32_t block) const {
    return (((uint64_t(block) + 1) * 0xD6E8FEB86659FD93ull) >> 40) % mini_->rate == 0;
  }

  size_t capacity_, block_bytes_, arena_bytes_ = 0;
  bool compressed_ = false;
  double entry_factor_ = 1;  // compressed: entries a shard has per block its memory holds uncompressed
  BufferPolicy policy_;
  void* arena_ = nullptr;
  std::vector<Shard> shards_;
  std::unique_ptr<Miniature> mini_;
  std::atomic<bool> lfu_mode_{true}, active_{true};
  std::atomic<uint64_t> evictions_{0}, switches_{0};
};

// Reads whole blocks; one implementation per I/O path so either can be swapped in.
struct BlockRead {
  uint32_t block;
  uint8_t* dst;  // block_bytes, 4096-aligned
};

// Reads under way: wait() returns once all are in, or throws as BlockReader::read;
// destroying one waits too, so its destination memory is never freed under a read.
class PendingRead {
 public:
  virtual ~PendingRead() = default;
  virtual void wait() = 0;
};

class BlockReader {
 public:
  virtual ~BlockReader() = default;
  virtual const char* name() const = 0;
  // Reads every block in full or throws naming the file, the block and the errno.
  virtual void read(const BlockRead* reads, size_t n) = 0;
  // Starts reading and returns at once; reads must stay valid until the wait.
  virtual std::unique_ptr<PendingRead> start(const BlockRead* reads, size_t n) = 0;
};

// The two implementations (block_io.cpp), reading fd's blocks of block_bytes. make_uring_reader: 0 with an io_uring
// reader put in `reader`, or the errno why this kernel gives none (reader left as it was). make_pread_reader: a
// pool of `threads` threads of plain blocking reads, for kernels or sandboxes without io_uring.
int make_uring_reader(const std::string& path, int fd, size_t block_bytes, std::unique_ptr<BlockReader>& reader);
std::unique_ptr<BlockReader> make_pread_reader(const std::string& path, int fd, size_t block_bytes, int threads);

// Blocks read ahead of the fetch expected to want them (one caller's: a re-rank
// worker's next round), so that the reads overlap the caller's computing.
class ReadAhead {
 public:
  size_t size() const { return blocks_.size(); }
  size_t bytes() const { return capacity_bytes(blocks_, taken_, reads_) + data_.bytes; }  // held, as capacity

 private:
  friend class PageStore;
  std::vector<uint32_t> blocks_;  // sorted
  std::vector<uint8_t> taken_;    // by a fetch
  std::vector<BlockRead> reads_;
  AlignedBuffer data_;
  std::unique_ptr<PendingRead> pending_;  // after data_: destroyed, so waited for, first
  bool failed_ = false;
};

struct PageStoreStats {
  uint64_t blocks_read, blocks_from_buffer, read_calls, evictions, pin_reads, pinned, read_ahead, read_ahead_unused,
      policy_switches, record_lookups, records_from_cache, layout_switches;
};

// The adaptive layout (PageStore with adaptive_layout): the same bytes held as whole blocks or as single records,
// whichever a miniature of both serves more blocks from memory now. Blocks win where the records a query wants
// share pages with what the next queries want (a uniform stream over lists laid out together); records where a
// few hot records sit in pages of cold ones (a skewed stream). Both are simulated on a sample of the blocks, by
// metadata only (shadow buffers with the Lfu policy at capacity / rate), per query and block touched: a block
// serves from memory in the block shadow if it is there, in the record shadow if every candidate of the query
// stored in it is. The store takes the other layout when its shadow's score (hits, each period's half the weight
// of the next) passes the current one's by kLayoutMargin, once both shadows are full, on a thread of its own: the
// layout given up is emptied and its memory given back (to records, the most used blocks' records move over).
struct LayoutMiniature;

// Host bytes a record cache entry holds beside its record: the frame's block number, use counter and pin flag,
// its sixteen sketch counters, and two to four slots of its shard's FrameMap, 8 bytes each (PageBuffer's
// per-frame metadata: at most 54 bytes; 96 was sized for a std::unordered_map's node and bucket, and kept so
// that the byte rule chosen with it still holds).
constexpr size_t kRecordCacheOverhead = 96;

// Whether a record cached alone, with its metadata, costs less than its share of a block (page_store.cpp).
bool records_denser(const PageLayout& layout);

// Record cache requests and hits a caller counts before it adds them to its store's stats (PageStore::tally).
struct RecordTally {
  uint64_t lookups = 0, hits = 0;
};

class PageStore {
 public:
  PageStore(const std::string& path, PageLayout layout, std::vector<uint32_t> block_crc, size_t buffer_blocks,
            const std::string& io_backend, const std::string& direct_io, int io_threads,
            BufferPolicy policy = BufferPolicy::Clock, size_t record_cache_records = 0, bool adaptive_layout = false,
            double compress_gain = 0);
  ~PageStore();

  // Copies blocks[i] to out + i * block_bytes (out 4096-aligned): from the page
  // buffer when there; the others are read from the SSD together, checked
  // against their CRC and put in the buffer. Returns how many came from the SSD;
  // when given, read_from_ssd[i] says whether blocks[i] did (1) or not (0), and
  // weights[i] how many queries asked for blocks[i] (1 when not given).
  // With ahead, a block read ahead into it is taken from there instead (and
  // counts as read from the SSD: it was), after waiting for those reads.
  size_t fetch(const uint32_t* blocks, size_t n, uint8_t* out, uint8_t* read_from_ssd = nullptr,
               const uint32_t* weights = nullptr, ReadAhead* ahead = nullptr);
  // Settles ahead, then starts reading into it those of blocks (sorted, distinct)
  // not in the page buffer now. They count as blocks_read at once, and as
  // read_ahead_unused when no fetch takes them before the next settle.
  void read_ahead(ReadAhead& ahead, const uint32_t* blocks, size_t n);
  // Waits for ahead's reads and empties it; with `unused`, it gets the blocks read
  // that no fetch took. A failed read ahead is not reported here: a fetch that
  // wants the block reads it again.
  void settle(ReadAhead& ahead, std::vector<uint32_t>* unused = nullptr);
  // Pins blocks (most wanted first) in the page buffer, in place of the pinned
  // set before, reading those not there (counted as pin_reads, not blocks_read).
  // Returns how many are pinned. Meant for a background thread.
  size_t pin(const uint32_t* blocks, size_t n);
  bool resident(uint32_t block) { return buffer_.resident(block); }
  // The block from the page buffer into out, if it is there now (nothing read, nothing counted:
  // blocks_from_buffer and the replacement policy do not see it). For block < num_blocks().
  bool peek(uint32_t block, uint8_t* out) { return buffer_.peek(block, out); }
  void reset_buffer() { buffer_.clear(), records_.clear(); }

  // The record cache: single records (slots), not blocks, kept by the same policy as the page buffer, for
  // records that leave part of their pages empty (a cached one costs its bytes and kRecordCacheOverhead). A
  // re-rank asks it for a round's candidates first and reads a block only if one of them is missing. Empty
  // when record_cache_records is 0.
  size_t record_cache_capacity() const { return records_.capacity(); }
  // Whether re-ranks use the record cache now: it has room and is the layout on.
  bool records_on() const { return records_.capacity() && records_.active(); }
  bool buffer_on() const { return buffer_.capacity() && buffer_.active(); }
  // The adaptive layout: whether there is one, whether block is in its sample, and one query's touch of a
  // block, with the record slots of its candidates stored there (every call's, whichever layout is on).
  bool adaptive() const { return bool(layout_mini_); }
  bool layout_sampled(uint32_t block) const;
  void observe(uint32_t block, const uint32_t* slots, size_t n);
  // Takes a layout now (records or blocks), as a switch would; hold: the miniature switches no more (tests).
  void set_layout(bool records, bool hold = false);
  // Waits for a switch the miniature started (it runs on a thread of its own, off the request path).
  void wait_layout();
  // Copies slot's record to out (record_bytes) if cached; counts the request either way, in t (tally(t) adds a
  // caller's counts to stats() once, not per record: shared counters bumped per record cost two threads a cache
  // line passed back and forth).
  bool lookup_record(uint32_t slot, uint8_t* out, RecordTally& t) {
    if (!records_.capacity()) return false;
    ++t.lookups;
    if (!records_.lookup(slot, out)) return false;
    ++t.hits;
    return true;
  }
  // Offers a record read with its block; the policy decides whether it stays. requested: not looked up yet, so
  // asked for now (counted in t, a hit if it is cached), under the same lock as the offer.
  void offer_record(uint32_t slot, const uint8_t* data, bool requested, RecordTally& t) {
    if (!records_.capacity()) return;
    const bool held = records_.offer(slot, data, 1, requested);
    if (requested) ++t.lookups, t.hits += held;
  }
  void tally(RecordTally& t) {
    if (t.lookups) record_lookups_.fetch_add(t.lookups, std::memory_order_relaxed);
    if (t.hits) records_from_cache_.fetch_add(t.hits, std::memory_order_relaxed);
    t = {};
  }
  bool record_cached(uint32_t slot) { return records_.resident(slot); }
  // Records every block fetch() is asked for, in order, with its weight (for offline
  // replays of buffer policies: bench/cache/cache_sim.py). Off: one relaxed load per fetch.
  void set_trace(bool on);
  // [kTraceCall, n, then n x (block, weight)] per fetch() call, oldest first; clears it.
  std::vector<uint32_t> take_trace();
  static constexpr uint32_t kTraceCall = 0xFFFFFFFFu;
  PageStoreStats stats();

  const std::string& path() const { return path_; }
  const PageLayout& layout() const { return layout_; }
  size_t num_blocks() const { return crc_.size(); }
  size_t buffer_capacity() const { return buffer_.capacity(); }
  bool buffer_compressed() const { return buffer_.compressed(); }
  size_t buffer_entries() const { return buffer_.entries(); }
  size_t buffer_chunk_bytes() { return buffer_.chunk_bytes_held(); }
  BufferPolicy buffer_policy() const { return buffer_.policy(); }
  BufferPolicy buffer_mode() const { return buffer_.mode(); }
  const char* backend() const { return reader_->name(); }
  bool direct() const { return direct_; }
  int fd() const { return fd_; }

 private:
  std::string path_;
  PageLayout layout_;
  std::vector<uint32_t> crc_;
  int fd_ = -1;
  bool direct_ = false;
  PageBuffer buffer_, records_;
  std::unique_ptr<LayoutMiniature> layout_mini_;
  std::mutex layout_mutex_;  // one switch at a time
  std::atomic<uint64_t> layout_switches_{0};
  std::atomic<bool> layout_held_{false}, switching_{false};
  std::mutex switcher_mutex_;
  std::thread switcher_;  // the miniature's last switch; joined before the next and by the destructor
  std::unique_ptr<BlockReader> reader_;
  std::mutex pin_mutex_;  // one re-pinning at a time
  std::atomic<bool> tracing_{false};
  std::mutex trace_mutex_;
  std::vector<uint32_t> trace_;
  std::atomic<uint64_t> blocks_read_{0}, blocks_from_buffer_{0}, read_calls_{0}, pin_reads_{0}, read_ahead_{0},
      read_ahead_unused_{0}, record_lookups_{0}, records_from_cache_{0};

  void check_crc(const BlockRead& r) const;
  void seed_records();
};

}  // namespace fusionrag
