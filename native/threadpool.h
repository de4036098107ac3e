// A persistent worker pool: the hot paths are called once per query batch, and
// spawning threads per call would cost more than a small batch's work.
#pragma once
#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <exception>
#include <functional>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace fusionrag {

class ThreadPool {
 public:
  static ThreadPool& instance() {
    static ThreadPool pool(std::max(1u, std::thread::hardware_concurrency()));
    return pool;
  }

  size_t size() const { return workers_.size() + 1; }

  // Runs fn(i, worker) for i in [0, n) on at most `threads` threads (the caller
  // included); worker is in [0, threads) and lets fn use per-thread scratch.
  // Items are handed out one at a time, so uneven items balance themselves.
  // The first exception thrown by fn is rethrown here after all work stops.
  void parallel_for(size_t n, size_t threads, const std::function<void(size_t, size_t)>& fn) {
    threads = std::max<size_t>(1, std::min({threads, n, size()}));
    if (threads <= 1) {
      for (size_t i = 0; i < n; ++i) fn(i, 0);
      return;
    }
    std::lock_guard<std::mutex> one_job(job_mutex_);  // nested or concurrent calls queue up
    Job job{fn, n, {0}, {0}, nullptr, {}};
    {
      std::lock_guard<std::mutex> lk(mutex_);
      job_ = &job;
      helpers_wanted_ = threads - 1;
      ++generation_;
    }
    cv_.notify_all();
    run(job, 0);
    std::unique_lock<std::mutex> lk(mutex_);
    done_cv_.wait(lk, [&] { return helpers_wanted_ == 0 && helpers_running_ == 0; });
    job_ = nullptr;
    if (job.error) std::rethrow_exception(job.error);
  }

  ~ThreadPool() {
    {
      std::lock_guard<std::mutex> lk(mutex_);
      stop_ = true;
    }
    cv_.notify_all();
    for (auto& t : workers_) t.join();
  }

 private:
  struct Job {
    const std::function<void(size_t, size_t)>& fn;
    size_t n;
    std::atomic<size_t> next;
    std::atomic<size_t> next_worker;
    std::exception_ptr error;
    std::mutex error_mutex;
  };

  explicit ThreadPool(size_t n) {
    for (size_t i = 1; i < n; ++i) workers_.emplace_back([this] { loop(); });
  }

  static void run(Job& job, size_t worker) {
    for (size_t i; (i = job.next.fetch_add(1)) < job.n;) {
      try {
        job.fn(i, worker);
      } catch (...) {
        std::lock_guard<std::mutex> lk(job.error_mutex);
        if (!job.error) job.error = std::current_exception();
        job.next = job.n;  // stop handing out items
      }
    }
  }

  void loop() {
    size_t seen = 0;
    for (;;) {
      Job* job;
      size_t worker;
      {
        std::unique_lock<std::mutex> lk(mutex_);
        cv_.wait(lk, [&] { return stop_ || (generation_ != seen && helpers_wanted_ > 0); });
        if (stop_) return;
        seen = generation_;
        --helpers_wanted_;
        ++helpers_running_;
        job = job_;
      }
      worker = job->next_worker.fetch_add(1) + 1;
      run(*job, worker);
      {
        std::lock_guard<std::mutex> lk(mutex_);
        --helpers_running_;
      }
      done_cv_.notify_all();
    }
  }

  std::vector<std::thread> workers_;
  std::mutex job_mutex_, mutex_;
  std::condition_variable cv_, done_cv_;
  Job* job_ = nullptr;
  size_t generation_ = 0, helpers_wanted_ = 0, helpers_running_ = 0;
  bool stop_ = false;
};

// An entry point's num_threads: 0 means every worker of the pool.
inline size_t pool_threads(int num_threads) {
  if (num_threads < 0) throw std::invalid_argument("num_threads must be >= 0, got " + std::to_string(num_threads));
  return num_threads ? size_t(num_threads) : ThreadPool::instance().size();
}

}  // namespace fusionrag
