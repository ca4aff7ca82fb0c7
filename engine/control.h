// Framing of control messages (two-sided SENDs between engines). Wire format, little-endian:
//   u32 magic "FRY1" | u8 type | u8 reserved | u16 sender length | sender | payload
// type 1 = hello (rail warm-up, consumed by the engine), 2 = user message, 3 = bell ring,
// payload one byte (RingKind), 4 = a fragment of a user message too long for one frame:
//   u32 incarnation | u32 message id | u16 index | u16 count | bytes
// put together again by the receiving engine once all `count` have come.
#ifndef FERRY_ENGINE_CONTROL_H_
#define FERRY_ENGINE_CONTROL_H_

#include <cstdint>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"

namespace ferry::engine {

enum class ControlType : uint8_t { kHello = 1, kUser = 2, kBell = 3, kFragment = 4 };

inline constexpr size_t kFragmentHeader = 12;

// What a ring of a peer's bell says. kWake: a control message or hello follows (poll the
// rails a while). kBusy: WRITEs follow (be awake, as with Engine::KeepAwake, until kDone or
// until no kBusy has come for a while). kDone: this sender's WRITEs are over.
enum class RingKind : char { kWake = 'w', kBusy = 'b', kDone = 'd' };

inline constexpr size_t kControlHeader = 8;
inline constexpr size_t kMaxSenderId = 256;

// Bytes a receive buffer needs for a payload of `max_payload` bytes.
inline size_t ControlFrameCapacity(size_t max_payload) {
  return kControlHeader + kMaxSenderId + max_payload;
}

std::string EncodeControl(ControlType type, std::string_view sender, std::string_view payload);

struct ControlMessage {
  ControlType type;
  std::string_view sender;
  std::string_view payload;
};
// kInvalidArgument for a frame that is short, has a bad magic or an unknown type.
absl::StatusOr<ControlMessage> DecodeControl(std::string_view frame);

}  // namespace ferry::engine

#endif  // FERRY_ENGINE_CONTROL_H_
