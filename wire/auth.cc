#include "wire/auth.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>

#include "absl/strings/str_cat.h"
#include "base/bytes.h"
#include "base/ids.h"

namespace ferry::wire {
namespace {

std::string Hmac(std::string_view key, std::string_view data) {
  unsigned char out[32];
  size_t n = 0;
  if (EVP_Q_mac(nullptr, "HMAC", nullptr, "SHA256", nullptr, key.data(), key.size(),
                reinterpret_cast<const unsigned char*>(data.data()), data.size(), out, sizeof(out),
                &n) == nullptr ||
      n != sizeof(out)) {
    return std::string();  // never matches a 32-byte MAC
  }
  return std::string(reinterpret_cast<const char*>(out), n);
}

}  // namespace

std::string ClusterKeyFromToken(std::string_view token) {
  if (token.empty()) return std::string();
  const std::string input =
      absl::StrCat("ferry cluster key v1", std::string(1, '\0'), std::string(token));
  unsigned char out[32];
  unsigned int n = 0;
  EVP_Digest(input.data(), input.size(), out, &n, EVP_sha256(), nullptr);
  return std::string(reinterpret_cast<const char*>(out), n);
}

MessageAuth::MessageAuth(std::string key) : key_(std::move(key)), nonce_(RandomU64()) {}

std::string MessageAuth::Seal(std::string message) {
  if (!enabled()) return message;
  uint64_t counter;
  {
    absl::MutexLock lock(&mu_);
    counter = ++counter_;
  }
  ByteWriter w(&message);
  w.U64(nonce_);
  w.U64(counter);
  message += Hmac(key_, message);
  return message;
}

absl::StatusOr<std::string_view> MessageAuth::Open(std::string_view sealed,
                                                   std::string_view sender) {
  if (!enabled()) return sealed;
  if (sealed.size() < kTrailer) return absl::UnauthenticatedError("message without a seal");
  const std::string_view signed_part = sealed.substr(0, sealed.size() - 32);
  const std::string mac = Hmac(key_, signed_part);
  if (mac.size() != 32 || CRYPTO_memcmp(mac.data(), sealed.data() + signed_part.size(), 32) != 0) {
    return absl::UnauthenticatedError("message sealed under another cluster key, or altered");
  }
  ByteReader r(signed_part.substr(signed_part.size() - 16));
  uint64_t nonce = 0, counter = 0;
  r.U64(&nonce);
  r.U64(&counter);
  const std::string session = absl::StrCat(std::string(sender), "/", nonce);
  absl::MutexLock lock(&mu_);
  auto [it, fresh] = seen_.try_emplace(session);
  if (fresh) {
    seen_order_.push_back(session);
    if (seen_order_.size() > kSessionsKept) {
      seen_.erase(seen_order_.front());
      seen_order_.pop_front();
    }
  }
  Seen& s = it->second;
  if (counter > s.highest) {
    const uint64_t shift = counter - s.highest;
    s.window = shift >= 64 ? 0 : s.window << shift;
    s.window |= 1;
    s.highest = counter;
  } else {
    const uint64_t age = s.highest - counter;
    if (age >= 64 || (s.window >> age) & 1) {
      return absl::UnauthenticatedError("message replayed, or too old to tell");
    }
    s.window |= uint64_t{1} << age;
  }
  return signed_part.substr(0, signed_part.size() - 16);
}

}  // namespace ferry::wire
