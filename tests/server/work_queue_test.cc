// WorkQueue: work runs in order of arrival, Stop() runs what is queued, and work handed to a
// stopped queue (as the engine may hand a node a request while it shuts down) is dropped.
#include "server/work_queue.h"

#include <gmock/gmock.h>

#include <memory>
#include <vector>

#include "absl/synchronization/notification.h"

namespace ferry::server {
namespace {

TEST(WorkQueueTest, OneThreadRunsWorkInOrderAndStopRunsWhatIsQueued) {
  WorkQueue queue(1);
  absl::Notification release;
  std::vector<int> ran;  // by the one thread, read once it is joined
  ASSERT_TRUE(queue.Run([&] { release.WaitForNotification(); }));
  for (int i = 0; i < 5; ++i) {
    ASSERT_TRUE(queue.Run([&, i] {
      ran.push_back(i);
      // Work may queue more work, which runs before Stop() returns.
      if (i == 4) {
        EXPECT_TRUE(queue.Run([&] { ran.push_back(5); }));
      }
    }));
  }
  release.Notify();
  queue.Stop();
  EXPECT_THAT(ran, ::testing::ElementsAre(0, 1, 2, 3, 4, 5));
}

TEST(WorkQueueTest, WorkHandedToAStoppedQueueIsDroppedAndReleased) {
  WorkQueue queue(2);
  queue.Stop();
  auto held = std::make_shared<int>(7);
  bool ran = false;
  EXPECT_FALSE(queue.Run([&ran, held] { ran = true; }));
  EXPECT_FALSE(ran);
  EXPECT_EQ(held.use_count(), 1);  // the dropped work let go of what it held
  queue.Stop();                    // again: nothing to do
}

}  // namespace
}  // namespace ferry::server
