// The page file's Python bindings: PageWriter, PageStore, and the CRC32C and zero-run helpers.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "crc32c.h"
#include "numpy_out.h"
#include "page_writer.h"
#include "pagefile.h"

namespace nb = nanobind;
using namespace nb::literals;

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
