// Bytes as lowercase hex and back (fabric addresses and IPC handles travel as hex in JSON).
#ifndef FERRY_BASE_HEX_H_
#define FERRY_BASE_HEX_H_

#include <string>
#include <string_view>

#include "absl/status/statusor.h"

namespace ferry {

std::string HexEncode(std::string_view bytes);
// kInvalidArgument: odd length or a character that is not a hex digit.
absl::StatusOr<std::string> HexDecode(std::string_view hex);

}  // namespace ferry

#endif  // FERRY_BASE_HEX_H_
