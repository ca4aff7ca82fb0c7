#include "engine/control.h"

#include <cstring>

namespace ferry::engine {
namespace {
constexpr char kMagic[4] = {'F', 'R', 'Y', '1'};
}  // namespace

std::string EncodeControl(ControlType type, std::string_view sender, std::string_view payload) {
  if (sender.size() > kMaxSenderId) sender = sender.substr(0, kMaxSenderId);
  std::string out(kControlHeader, '\0');
  memcpy(out.data(), kMagic, 4);
  out[4] = static_cast<char>(type);
  out[6] = static_cast<char>(sender.size() & 0xff);
  out[7] = static_cast<char>(sender.size() >> 8);
  out.append(sender);
  out.append(payload);
  return out;
}

absl::StatusOr<ControlMessage> DecodeControl(std::string_view frame) {
  if (frame.size() < kControlHeader || memcmp(frame.data(), kMagic, 4) != 0) {
    return absl::InvalidArgumentError("control frame: short or bad magic");
  }
  const auto type = static_cast<uint8_t>(frame[4]);
  if (type < static_cast<uint8_t>(ControlType::kHello) ||
      type > static_cast<uint8_t>(ControlType::kFragment)) {
    return absl::InvalidArgumentError("control frame: unknown type");
  }
  const size_t sender_len =
      static_cast<uint8_t>(frame[6]) | (size_t{static_cast<uint8_t>(frame[7])} << 8);
  if (sender_len > kMaxSenderId || frame.size() < kControlHeader + sender_len) {
    return absl::InvalidArgumentError("control frame: bad sender length");
  }
  return ControlMessage{static_cast<ControlType>(type), frame.substr(kControlHeader, sender_len),
                        frame.substr(kControlHeader + sender_len)};
}

}  // namespace ferry::engine
