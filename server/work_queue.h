// A fixed set of threads running queued work in order of arrival. Thread-safe.
#ifndef FERRY_SERVER_WORK_QUEUE_H_
#define FERRY_SERVER_WORK_QUEUE_H_

#include <deque>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace ferry::server {

class WorkQueue {
 public:
  explicit WorkQueue(size_t threads);
  // Stop(), then the queue goes.
  ~WorkQueue();
  WorkQueue(const WorkQueue&) = delete;
  WorkQueue& operator=(const WorkQueue&) = delete;
  // Queues `work`; after Stop() drops it and returns false.
  bool Run(std::function<void()> work);
  // Runs what is queued, then joins the threads; work queued from here on is dropped (work
  // running as Stop() is called may still queue more, which runs). Idempotent.
  void Stop();

 private:
  void Loop();
  absl::Mutex mu_;
  std::deque<std::function<void()>> queue_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;  // the threads end once the queue is empty
  bool stopped_ ABSL_GUARDED_BY(mu_) = false;   // the threads are gone
  std::vector<std::thread> threads_;
};

}  // namespace ferry::server

#endif  // FERRY_SERVER_WORK_QUEUE_H_
